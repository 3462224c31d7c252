//! Debian's real Prometheus server, started by a test to scrape `memleak
//! serve`, and asked through its own HTTP query API what it stored: the
//! tests read memleak's series as a dashboard or an alert would.

use std::{
    fs,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use serde_json::Value;

use crate::{
    http::{free_port, get},
    memleak::PATIENCE,
    rootfs::tempdir::TempDir,
};

/// A Prometheus server on a free loopback port, scraping one target
/// every second, its storage in a directory of its own. Killed, and its
/// directory removed, when dropped: a failing test leaves none running.
pub struct Prometheus {
    child: Child,
    pub port: u16,
    /// Its config and storage; removed once `Drop` has killed it, which
    /// runs before any field is dropped.
    _directory: TempDir,
}

impl Prometheus {
    /// Starts Prometheus scraping `http://127.0.0.1:{target_port}/metrics`
    /// every second, and waits until it is ready to answer queries.
    pub fn scraping(target_port: u16) -> Self {
        Self::configured(&format!(
            "  - job_name: memleak\n    static_configs:\n      - targets: ['127.0.0.1:{target_port}']\n"
        ))
    }

    /// Starts Prometheus with `scrape_configs`, YAML indented as a list
    /// under that key, each job scraping every second unless it says
    /// otherwise; and waits until it is ready.
    pub fn configured(scrape_configs: &str) -> Self {
        let directory = TempDir::new("memleak-prometheus");
        let config = directory.path().join("prometheus.yml");
        fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n{scrape_configs}"
            ),
        )
        .expect("write prometheus.yml");
        let port = free_port();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", directory.path().join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start prometheus (Debian's prometheus package; `cargo xtask test` installs it)");
        let mut prometheus = Self { child, port, _directory: directory };
        prometheus.wait_ready();
        prometheus
    }

    /// Waits for `/-/ready`, or fails the test if Prometheus exited.
    fn wait_ready(&mut self) {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("prometheus exited before it was ready: {status}");
            }
            if get(self.port, "/-/ready").is_ok_and(|response| response.status == 200) {
                return;
            }
            assert!(Instant::now() < deadline, "prometheus not ready after {PATIENCE:?}");
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// The instant vector that the query `query` evaluates to now: each
    /// series as its labels and its value as Prometheus writes it
    /// ("17264"), compared exactly.
    pub fn query(&self, query: &str) -> Vec<(Value, String)> {
        let path = format!("/api/v1/query?query={}", percent_encoded(query));
        let response = get(self.port, &path).unwrap_or_else(|error| panic!("GET {path}: {error}"));
        let answer: Value = serde_json::from_str(&response.body)
            .unwrap_or_else(|error| panic!("not JSON ({error}) from {path}: {response:#?}"));
        assert_eq!(answer["status"], "success", "{query}: {answer:#}");
        let results = answer["data"]["result"].as_array().cloned().unwrap_or_default();
        results
            .into_iter()
            .map(|result| {
                let value = result["value"][1].as_str();
                let value = value.unwrap_or_else(|| panic!("{query}: no value in {result:#}"));
                (result["metric"].clone(), value.to_owned())
            })
            .collect()
    }

    /// Polls `query` until `wanted` holds for its result, or fails the
    /// test after `PATIENCE` with the last result.
    pub fn query_until(
        &self,
        query: &str,
        wanted: impl Fn(&[(Value, String)]) -> bool,
    ) -> Vec<(Value, String)> {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let result = self.query(query);
            if wanted(&result) {
                return result;
            }
            assert!(Instant::now() < deadline, "{query}: not as wanted after {PATIENCE:?}: {result:?}");
            thread::sleep(Duration::from_millis(250));
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `text` as a URL's query value: everything but unreserved characters
/// percent-encoded (queries are full of braces, quotes and brackets).
fn percent_encoded(text: &str) -> String {
    text.bytes()
        .map(|byte| match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                char::from(byte).to_string()
            }
            other => format!("%{other:02X}"),
        })
        .collect()
}
