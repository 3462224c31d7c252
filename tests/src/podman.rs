//! Real containers, run by Debian's podman with runc, for `memleak serve
//! --container`. Each `Podman` keeps its images and containers in storage
//! of its own under a temporary directory, named to podman (and to the
//! memleak that inherits `env()`) by `CONTAINERS_STORAGE_CONF` and
//! `CONTAINERS_CONF`: the host's podman state is never read or changed,
//! and tests running side by side never see each other's containers.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use crate::{leaker::Leaker, rootfs::tempdir::TempDir};

/// Podman's settings that run containers on these machines: runc (crun
/// refuses a hybrid cgroup host), cgroups made directly (no systemd),
/// events in a file (no journal).
const ENGINE: &str = r#"cgroup_manager = "cgroupfs"
events_logger = "file"
runtime = "runc"
"#;

/// A container's limits, within the hard limits root has here (no
/// `CAP_SYS_RESOURCE`): podman's defaults are above them.
const ULIMITS: [&str; 4] = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096"];

/// Podman with storage of its own, and one image in it: the leaker's
/// root filesystem, imported, or an image built. The image is removed
/// when dropped.
pub struct Podman {
    dir: TempDir,
    /// The image: with `with_image`, holding the leaker at /app/leaker.
    pub image: String,
}

impl Podman {
    /// Private storage under a temporary directory, `tag` telling it from
    /// other tests', with `rootfs` imported as an image. Panics when
    /// podman cannot run here: a test needing it must not pass without it.
    pub fn with_image(tag: &str, rootfs: &Path) -> Self {
        let podman = Self::new(tag);
        let tarball = podman.dir.path().join("image.tar");
        run(Command::new("tar").arg("-C").arg(rootfs).arg("-cf").arg(&tarball).arg("."));
        run(podman.command().arg("import").arg(&tarball).arg(&podman.image).stdout(Stdio::null()));
        podman
    }

    /// Its image built from `containerfile`, with `context` as the build's
    /// directory: the `COPY`s of an image of scratch need no network.
    pub fn with_built_image(tag: &str, containerfile: &Path, context: &Path) -> Self {
        let podman = Self::new(tag);
        let mut build = podman.command();
        build.args(["build", "--quiet", "--network", "none", "--file"]).arg(containerfile);
        run(build.args(["--tag", &podman.image]).arg(context).stdout(Stdio::null()));
        podman
    }

    /// Private storage, no image in it yet; see `with_image`.
    fn new(tag: &str) -> Self {
        let dir = TempDir::new(&format!("memleak-podman-{tag}"));
        let at = |name: &str| dir.path().join(name).display().to_string();
        fs::write(
            dir.path().join("storage.conf"),
            format!(
                "[storage]\ndriver = \"overlay\"\ngraphroot = \"{}\"\nrunroot = \"{}\"\n",
                at("storage"),
                at("runroot")
            ),
        )
        .expect("write storage.conf");
        fs::write(
            dir.path().join("containers.conf"),
            format!(
                "[engine]\n{ENGINE}tmp_dir = \"{}\"\n\n[network]\nnetwork_config_dir = \"{}\"\n",
                at("tmp"),
                at("networks")
            ),
        )
        .expect("write containers.conf");
        let expected = format!("{} runc", at("storage"));
        let image = format!("localhost/memleak-test:{tag}-{}", std::process::id());
        let podman = Self { dir, image };
        let info = podman
            .command()
            .args(["info", "--format", "{{.Store.GraphRoot}} {{.Host.OCIRuntime.Name}}"])
            .output();
        match info {
            Ok(info) if info.status.success() && String::from_utf8_lossy(&info.stdout).trim() == expected => {
            }
            Ok(info) => panic!(
                "podman cannot run here with its storage in {} and runc (`cargo xtask test` installs \
                 podman and runc): `podman info` said {}{}",
                podman.dir.path().display(),
                String::from_utf8_lossy(&info.stdout),
                String::from_utf8_lossy(&info.stderr)
            ),
            Err(error) => panic!(
                "this test runs a real container with podman, which cannot start ({error}): \
                 `cargo xtask test` installs podman and runc"
            ),
        }
        podman
    }

    /// The environment that points podman at this storage, for memleak to
    /// inherit and pass on to the `podman inspect` it runs.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        let conf = |name: &str| self.dir.path().join(name).display().to_string();
        vec![("CONTAINERS_STORAGE_CONF", conf("storage.conf")), ("CONTAINERS_CONF", conf("containers.conf"))]
    }

    /// `podman` run on this storage.
    pub fn command(&self) -> Command {
        let mut command = Command::new("podman");
        command.envs(self.env());
        command
    }

    /// Runs `/app/leaker KIND --wait` in a new container called `name`,
    /// its stdin and stderr those of the `podman run` the test starts, so
    /// that the leaker's handshake passes through podman. The container
    /// is removed when dropped.
    pub fn run_leaker(&self, name: &str, kind: &[&str]) -> Container<'_> {
        let id_file = self.dir.path().join(format!("{name}.id"));
        let mut command = self.command();
        command
            .args(["run", "-i", "--rm", "--name", name, "--network", "none", "--cidfile"])
            .arg(&id_file)
            .args(ULIMITS)
            .arg(&self.image)
            .arg("/app/leaker")
            .args(kind)
            .arg("--wait");
        // Removed first should the handshake fail: the guard exists before.
        let mut container = Container { podman: self, name: name.to_owned(), id_file, leaker: None };
        container.leaker = Some(Leaker::start_command(command));
        container
    }

    /// Runs `/app/leaker ARGS` in a new container called `name`, detached
    /// and kept when it stops (so that it can be started again), with
    /// the host's directory `shared` at /shared: the test talks to the
    /// leaker through a FIFO there (`--input`), as `podman restart` gives
    /// the new process no stdin of the test's. Removed when dropped.
    pub fn run_detached(&self, name: &str, shared: &Path, args: &[&str]) -> Container<'_> {
        let id_file = self.dir.path().join(format!("{name}.id"));
        let mut command = self.command();
        command
            .args(["run", "--detach", "--name", name, "--network", "none", "--cidfile"])
            .arg(&id_file)
            .args(ULIMITS)
            .arg("--volume")
            .arg(format!("{}:/shared", shared.display()))
            .arg(&self.image)
            .arg("/app/leaker")
            .args(args)
            .stdout(Stdio::null());
        // Removed should anything after fail: the guard exists before.
        let container = Container { podman: self, name: name.to_owned(), id_file, leaker: None };
        run(&mut command);
        container
    }

    /// Runs the image's entry point with `args`, in a container removed
    /// once it exits, and returns what it did.
    pub fn run_image(&self, args: &[&str]) -> std::process::Output {
        let mut command = self.command();
        command.args(["run", "--rm", "--network", "none"]).args(ULIMITS).arg(&self.image).args(args);
        command.output().unwrap_or_else(|error| panic!("run {command:?}: {error}"))
    }

    /// `podman ARGS`, to success.
    pub fn run(&self, args: &[&str]) {
        run(self.command().args(args).stdout(Stdio::null()));
    }

    /// `podman inspect --format FORMAT NAME`, trimmed.
    pub fn inspect(&self, name: &str, format: &str) -> String {
        let output = self
            .command()
            .args(["inspect", "--type", "container", "--format", format, "--", name])
            .output()
            .expect("run podman inspect");
        assert!(
            output.status.success(),
            "podman inspect {name}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        let _ = self.command().args(["rmi", "--force", &self.image]).output();
        // Podman unmounts its storage as each command ends; should a mount
        // be left (a podman killed midway), unmount it before the
        // directory goes, so no removal ever runs through a mount.
        let prefix = self.dir.path().display().to_string();
        let mounts = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mut left: Vec<&str> = mounts
            .lines()
            .filter_map(|line| line.split_whitespace().nth(4))
            .filter(|mount_point| mount_point.starts_with(&prefix))
            .collect();
        left.sort_by_key(|mount_point| std::cmp::Reverse(mount_point.len()));
        for mount_point in left {
            let _ = Command::new("umount").args(["--lazy", mount_point]).status();
        }
    }
}

/// A container running the leaker; `podman rm --force` when dropped,
/// whether the test passed or not.
pub struct Container<'a> {
    podman: &'a Podman,
    pub name: String,
    /// Where `podman run --cidfile` writes its id as it creates it.
    id_file: PathBuf,
    leaker: Option<Leaker>,
}

impl Container<'_> {
    /// The leaker's handshake, through `podman run`.
    pub fn leaker(&mut self) -> &mut Leaker {
        self.leaker.as_mut().expect("the leaker started")
    }

    /// Its full id, as podman gives it.
    pub fn id(&self) -> String {
        self.podman.inspect(&self.name, "{{.Id}}")
    }

    /// The leaker's pid on the host (`podman run`'s is the client's).
    pub fn host_pid(&self) -> u32 {
        let pid = self.podman.inspect(&self.name, "{{.State.Pid}}");
        pid.parse().unwrap_or_else(|error| panic!("podman's pid of {}: {pid:?}: {error}", self.name))
    }

    /// Lets the leaker exit, which ends the container (`--rm` removes it)
    /// and `podman run`.
    pub fn exit(mut self) {
        if let Some(leaker) = self.leaker.take() {
            leaker.exit();
        }
    }
}

impl Drop for Container<'_> {
    fn drop(&mut self) {
        // By id: once `--rm` has removed the container, its name may read
        // to podman as a prefix of another's id (a hex name), and that
        // other container would go.
        let id = fs::read_to_string(&self.id_file).unwrap_or_default();
        let reference = if id.trim().is_empty() { self.name.clone() } else { id.trim().to_owned() };
        let _ = self.podman.command().args(["rm", "--force", "--time", "0", "--ignore", &reference]).output();
        // `podman run --cidfile` refuses a file left: a container run again
        // under the same name (a redeploy) writes its id there anew.
        let _ = fs::remove_file(&self.id_file);
        drop(self.leaker.take());
    }
}

/// Runs `command` to success, or panics with what it said.
fn run(command: &mut Command) {
    let output = command.output().unwrap_or_else(|error| panic!("run {command:?}: {error}"));
    assert!(
        output.status.success(),
        "{command:?}: {}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
}
