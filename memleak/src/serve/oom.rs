//! The evidence of OOM kills: for each process followed or watched that
//! the OOM killer picked, what memleak knew of it when it died (its last
//! report if it was traced, its memory's history if it was only watched),
//! written to the state directory (--state-dir) so that it outlives the
//! victim and memleak's own restarts, and served at /api/v1/oom.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    sync::Arc,
};

use serde::Serialize;
use serde_json::Value;

use super::state::{Followed, OomView, WorkloadLabels};
use crate::{
    model::Workload,
    report::{self, options::Format, Report},
    status,
    watch::describe_rate,
};

/// Kills kept and served at most, the latest; older files stay on disk.
const KEPT: usize = 100;

/// Where kills are written, under the state directory.
const KILLS_DIR: &str = "oom";

/// One kill, as it is written and served.
#[derive(Serialize)]
struct Record<'a> {
    pid: u32,
    program: &'a str,
    /// When memleak saw the kill.
    killed_unix_ms: u64,
    #[serde(flatten)]
    workload: WorkloadLabels<'a>,
    /// With --watch: its anonymous memory at the last look before the kill.
    anon_bytes_last_seen: Option<u64>,
    /// Whether memleak traced it when it died: then `report` is its last.
    traced: bool,
    /// The function and line of the stack holding the most, if traced.
    culprit: Option<String>,
    culprit_bytes: Option<u64>,
    culprit_allocations: Option<u64>,
    /// What memleak says of the kill, in one line.
    summary: &'a str,
    /// Its last report, as the json format writes it.
    report: Option<Value>,
    /// With --watch: its anonymous memory over the latest window.
    history: &'a [HistoryPoint],
}

/// A sample of a watched process's memory.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct HistoryPoint {
    pub unix_ms: u64,
    pub anon_bytes: u64,
}

/// What is known of a victim when it dies.
pub struct Evidence<'a> {
    pub pid: u32,
    pub followed: Option<&'a Followed>,
    pub program: &'a str,
    pub workload: Option<&'a Workload>,
    pub history: Vec<HistoryPoint>,
    /// With --watch, its growth as last judged (bytes per second).
    pub growth: Option<f64>,
}

/// The kills known, newest last, and the state directory they go to.
pub struct OomStore {
    /// `None`: kept in memory only, as said at start.
    dir: Option<PathBuf>,
    kills: Vec<Arc<Value>>,
    /// Kills seen by this run, by their labels, for /metrics.
    counted: BTreeMap<Vec<(String, String)>, u64>,
}

impl OomStore {
    /// Opens the state directory and reads the kills written there by
    /// earlier runs. A directory the user named must be usable; the
    /// default one is created if it can be, and kills are kept in memory
    /// only if not (a read-only root, say), as said.
    pub fn open(dir: &Path, named: bool) -> Result<Self, String> {
        let kills_dir = dir.join(KILLS_DIR);
        // Kills name programs and their stacks: for root's eyes only.
        let made = fs::create_dir_all(&kills_dir).and_then(|()| {
            fs::set_permissions(&kills_dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
        });
        if let Err(error) = made {
            let reason = format!("cannot use {} to keep OOM kills: {error}", kills_dir.display());
            if named {
                return Err(format!("--state-dir {}: {reason}", dir.display()));
            }
            status::say(&format!("{reason}; they are kept in memory only (give --state-dir DIR)"));
            return Ok(Self { dir: None, kills: Vec::new(), counted: BTreeMap::new() });
        }
        let mut store = Self { dir: Some(kills_dir.clone()), kills: Vec::new(), counted: BTreeMap::new() };
        store.kills = read_kills(&kills_dir);
        if !store.kills.is_empty() {
            log::debug!("{} OOM kills read from {}", store.kills.len(), kills_dir.display());
        }
        Ok(store)
    }

    /// Keeps the evidence of a kill: written to the state directory,
    /// served, counted, and said in one line naming the culprit.
    pub fn keep(&mut self, evidence: &Evidence<'_>) {
        let report = evidence.followed.and_then(|followed| followed.report.as_deref());
        let culprit = report.and_then(Report::largest_culprit);
        let killed_unix_ms = crate::clock::wall_ms();
        let summary = summary(evidence, culprit.as_ref().map(|(stack, named)| (*stack, named.as_str())));
        let record = Record {
            pid: evidence.pid,
            program: evidence.program,
            killed_unix_ms,
            workload: WorkloadLabels::of(evidence.workload),
            anon_bytes_last_seen: evidence.history.last().map(|point| point.anon_bytes),
            traced: report.is_some(),
            culprit: culprit.as_ref().map(|(_, named)| named.clone()),
            culprit_bytes: culprit.as_ref().map(|(stack, _)| stack.bytes),
            culprit_allocations: culprit.as_ref().map(|(stack, _)| stack.allocations),
            summary: &summary,
            report: report.and_then(report_json),
            history: &evidence.history,
        };
        let Ok(value) = serde_json::to_value(&record) else { return };
        let saved =
            self.dir.as_ref().map(|dir| write(dir, &format!("{killed_unix_ms}-{}", evidence.pid), &value));
        let saved = match saved {
            Some(Ok(path)) => format!("; saved in {}", path.display()),
            Some(Err(error)) => format!("; cannot save it: {error}"),
            None => String::new(),
        };
        status::say(&format!("{summary}{saved}"));
        let mut labels = vec![("exe".to_owned(), executable(evidence.program).to_owned())];
        labels.extend(
            evidence
                .workload
                .into_iter()
                .flat_map(Workload::labels)
                .map(|(name, value)| (name.to_owned(), value.to_owned())),
        );
        labels.push(("traced".to_owned(), report.is_some().to_string()));
        // An empty label is no label to Prometheus: none without a culprit.
        if let Some((_, named)) = culprit {
            labels.push(("culprit".to_owned(), named));
        }
        *self.counted.entry(labels).or_default() += 1;
        self.kills.push(Arc::new(value));
        if self.kills.len() > KEPT {
            self.kills.remove(0);
        }
    }

    pub fn view(&self) -> OomView {
        OomView {
            kills: self.kills.iter().rev().cloned().collect(),
            counted: self.counted.iter().map(|(labels, count)| (labels.clone(), *count)).collect(),
        }
    }
}

/// `pid 42 (growth) was killed by the OOM killer; the stack holding the
/// most: leak_slowly (growth.c:31), 40.0 MiB in 10240 allocations`.
fn summary(evidence: &Evidence<'_>, culprit: Option<(&report::ReportStack, &str)>) -> String {
    let killed =
        format!("pid {} ({}) was killed by the OOM killer", evidence.pid, executable(evidence.program));
    match (evidence.followed.and_then(|followed| followed.report.as_ref()), culprit) {
        (Some(_), Some((stack, named))) => format!(
            "{killed}; the stack holding the most: {named}, {} in {} allocations",
            status::readable_bytes(stack.bytes),
            stack.allocations
        ),
        (Some(_), None) => format!("{killed}; its last report holds no allocation"),
        (None, _) => {
            let held = evidence
                .history
                .last()
                .map(|point| {
                    format!(
                        " with {} of anonymous memory at the last look",
                        status::readable_bytes(point.anon_bytes)
                    )
                })
                .unwrap_or_default();
            let growth = evidence
                .growth
                .filter(|rate| *rate > 0.0)
                .map(|rate| format!(", growing {}", describe_rate(rate)))
                .unwrap_or_default();
            format!("{killed}{held}; it was watched{growth}, not traced: no stack is known")
        }
    }
}

fn executable(program: &str) -> &str {
    Path::new(program).file_name().and_then(|name| name.to_str()).unwrap_or(program)
}

/// A report as the json format writes it, every stack in it.
fn report_json(report: &Report) -> Option<Value> {
    let mut body = Vec::new();
    let rendering = report::options::Rendering {
        format: Format::Json,
        weight: report::options::Weight::Bytes,
        full_stacks: true,
    };
    report::render(rendering, report, &mut body).ok()?;
    serde_json::from_slice(&body).ok()
}

/// Writes `value` as `dir/NAME.json`, whole or not at all: a crash
/// midway leaves no half record for the next start to read.
fn write(dir: &Path, name: &str, value: &Value) -> std::io::Result<PathBuf> {
    let path = dir.join(format!("{name}.json"));
    let partial = dir.join(format!(".{name}.json.partial"));
    let body = serde_json::to_vec_pretty(value).map_err(std::io::Error::other)?;
    fs::write(&partial, body)?;
    fs::rename(&partial, &path)?;
    Ok(path)
}

/// The kills an earlier run wrote, oldest first, the latest `KEPT`. A
/// file that is not one is said and left alone.
fn read_kills(dir: &Path) -> Vec<Arc<Value>> {
    let Ok(entries) = fs::read_dir(dir) else { return Vec::new() };
    let mut paths: Vec<PathBuf> = entries
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|extension| extension == "json"))
        .collect();
    // Named by the time of the kill: the name's order is the kills'.
    paths.sort_by_key(|path| {
        let stem = path.file_stem().and_then(|stem| stem.to_str()).unwrap_or_default();
        stem.split('-').next().and_then(|ms| ms.parse::<u64>().ok()).unwrap_or_default()
    });
    let skipped = paths.len().saturating_sub(KEPT);
    paths
        .into_iter()
        .skip(skipped)
        .filter_map(|path| {
            let read = fs::read(&path).ok().and_then(|body| serde_json::from_slice::<Value>(&body).ok());
            if read.is_none() {
                log::warn!("{} is no OOM kill memleak wrote: left alone", path.display());
            }
            read.map(Arc::new)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temporary_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("memleak-oom-test-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn a_kill_kept_is_read_again_by_the_next_run_and_a_stray_file_is_left_alone() {
        let dir = temporary_dir("reread");
        let mut store = OomStore::open(&dir, true).unwrap();
        let history = vec![HistoryPoint { unix_ms: 1000, anon_bytes: 48 << 20 }];
        let evidence = Evidence {
            pid: 42,
            followed: None,
            program: "/srv/growth",
            workload: None,
            history,
            growth: Some(65536.0),
        };
        store.keep(&evidence);
        fs::write(dir.join(KILLS_DIR).join("0-1.json"), "not json").unwrap();
        let again = OomStore::open(&dir, true).unwrap();
        let kills = again.view().kills;
        assert_eq!(kills.len(), 1, "{kills:?}");
        assert_eq!(kills, store.view().kills);
        let kill = &kills[0];
        assert_eq!((kill["pid"].as_u64(), kill["traced"].as_bool()), (Some(42), Some(false)));
        assert_eq!(
            kill["summary"],
            "pid 42 (growth) was killed by the OOM killer with 48.0 MiB of anonymous memory at the last look; it was \
             watched, growing 64.0 KiB/s, not traced: no stack is known"
        );
        assert_eq!(
            (kill["history"][0]["anon_bytes"].as_u64(), kill["anon_bytes_last_seen"].as_u64()),
            (Some(48 << 20), Some(48 << 20))
        );
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_state_dir_named_that_cannot_be_made_is_refused_and_the_default_falls_back_to_memory() {
        let file = temporary_dir("file");
        fs::write(&file, "").unwrap();
        let refused = OomStore::open(&file, true).err().unwrap_or_default();
        assert!(refused.starts_with(&format!("--state-dir {}: cannot use", file.display())), "{refused}");
        let in_memory = OomStore::open(&file, false).unwrap();
        assert!(in_memory.dir.is_none());
        let _ = fs::remove_file(&file);
    }
}
