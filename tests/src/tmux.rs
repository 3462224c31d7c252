//! A terminal for `memleak top`: a tmux server of the test's own, keys
//! sent with `send-keys`, screens read with `capture-pane`.

use std::{
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use crate::memleak::PATIENCE;

/// A tmux server with one window running a shell command, until dropped.
pub struct Tmux {
    /// The server's socket name (`tmux -L`), the test's own.
    socket: String,
}

impl Tmux {
    /// Runs `script` (a `sh -c` script) in a `width` x `height` window.
    pub fn start(name: &str, width: u16, height: u16, script: &str) -> Self {
        let socket = format!("memleak-{name}-{}", std::process::id());
        let tmux = Self { socket };
        let status = tmux
            .command()
            .args([
                "new-session",
                "-d",
                "-x",
                &width.to_string(),
                "-y",
                &height.to_string(),
                "sh",
                "-c",
                script,
            ])
            .status()
            .expect("run tmux");
        assert!(status.success(), "tmux new-session: {status}");
        tmux
    }

    fn command(&self) -> Command {
        let mut command = Command::new("tmux");
        command.args(["-L", &self.socket]).env_remove("TMUX");
        command
    }

    /// Types `keys`, each as `tmux send-keys` names it (`Enter`, `C-c`, `q`).
    pub fn send(&self, keys: &[&str]) {
        let status = self.command().arg("send-keys").args(keys).status().expect("run tmux send-keys");
        assert!(status.success(), "tmux send-keys {keys:?}: {status}");
    }

    /// Types `text` as it is.
    pub fn type_text(&self, text: &str) {
        let status = self.command().args(["send-keys", "-l", text]).status().expect("run tmux send-keys");
        assert!(status.success(), "tmux send-keys -l {text:?}: {status}");
    }

    /// The screen as it is now, a line each.
    pub fn screen(&self) -> String {
        let output = self.command().args(["capture-pane", "-p"]).output().expect("run tmux capture-pane");
        assert!(output.status.success(), "tmux capture-pane: {}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// The screen once `wanted` holds for it; panics with the last screen
    /// after `PATIENCE`.
    pub fn wait_for(&self, what: &str, wanted: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let screen = self.screen();
            if wanted(&screen) {
                return screen;
            }
            assert!(
                Instant::now() < deadline,
                "no screen with {what} after {PATIENCE:?}; the last:\n{screen}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.command().arg("kill-server").status();
    }
}

/// Waits for `path` to be written (a script's marker file), and reads it.
pub fn wait_for_file(path: &Path) -> String {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            if text.ends_with('\n') {
                return text;
            }
        }
        assert!(Instant::now() < deadline, "{} was not written in {PATIENCE:?}", path.display());
        std::thread::sleep(Duration::from_millis(100));
    }
}
