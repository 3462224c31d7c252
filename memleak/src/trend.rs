//! Leak or full cache? How each stack's outstanding bytes moved from one
//! report to the next. A steady leak grows report after report; a cache
//! grows, then holds still.

use std::collections::HashMap;

use serde::Serialize;

use crate::model::Snapshot;

/// The movement of one stack since the previous report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Trend {
    /// Change in outstanding bytes since the previous report; `None` in the
    /// first report, which has nothing to compare with.
    pub delta_bytes: Option<i64>,
    /// Reports in a row, this one included, in which the stack grew.
    pub growing_reports: u32,
}

/// Remembers the previous report of one process.
#[derive(Debug, Default)]
pub struct TrendTracker {
    /// Bytes and growth streak of each stack in the previous report; `None`
    /// before the first report.
    previous: Option<HashMap<u64, (u64, u32)>>,
}

impl TrendTracker {
    /// Compares `snapshot` with the previous one and remembers it.
    pub fn observe(&mut self, snapshot: &Snapshot) -> HashMap<u64, Trend> {
        let mut current = HashMap::with_capacity(snapshot.stacks.len());
        let mut trends = HashMap::with_capacity(snapshot.stacks.len());
        for stack in &snapshot.stacks {
            let trend = match &self.previous {
                None => Trend::default(),
                Some(previous) => {
                    // A stack missing last time held nothing then.
                    let (bytes_before, streak) = previous.get(&stack.stack_id).copied().unwrap_or((0, 0));
                    let delta = stack.bytes as i64 - bytes_before as i64;
                    Trend {
                        delta_bytes: Some(delta),
                        growing_reports: if delta > 0 { streak + 1 } else { 0 },
                    }
                }
            };
            current.insert(stack.stack_id, (stack.bytes, trend.growing_reports));
            trends.insert(stack.stack_id, trend);
        }
        self.previous = Some(current);
        trends
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::StackUsage;

    fn snapshot(stacks: &[(u64, u64)]) -> Snapshot {
        Snapshot {
            stacks: stacks
                .iter()
                .map(|&(stack_id, bytes)| StackUsage {
                    stack_id,
                    bytes,
                    allocations: 1,
                    ..StackUsage::default()
                })
                .collect(),
            ..Snapshot::default()
        }
    }

    #[test]
    fn a_leak_grows_every_report_and_a_cache_stops() {
        let mut tracker = TrendTracker::default();
        let first = tracker.observe(&snapshot(&[(1, 100), (2, 100)]));
        assert_eq!(first[&1], Trend { delta_bytes: None, growing_reports: 0 });
        tracker.observe(&snapshot(&[(1, 200), (2, 300)]));
        let third = tracker.observe(&snapshot(&[(1, 300), (2, 300), (3, 50)]));
        assert_eq!(third[&1], Trend { delta_bytes: Some(100), growing_reports: 2 });
        assert_eq!(third[&2], Trend { delta_bytes: Some(0), growing_reports: 0 });
        assert_eq!(third[&3], Trend { delta_bytes: Some(50), growing_reports: 1 }, "new since last report");
        let fourth = tracker.observe(&snapshot(&[(1, 250)]));
        assert_eq!(fourth[&1], Trend { delta_bytes: Some(-50), growing_reports: 0 });
    }
}
