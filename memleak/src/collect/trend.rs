//! Leak or full cache? How each stack's outstanding bytes moved from one
//! report to the next. A steady leak grows report after report; a cache
//! grows, then holds still. Growth is counted in new memory: a cache
//! replacing entries it made before the attach takes up outstanding bytes
//! in memleak's eyes, but its blocks say they replace old ones.

use std::collections::HashMap;

use crate::model::{Snapshot, Trend};

/// Remembers the previous report of one process.
#[derive(Debug, Default)]
pub struct TrendTracker {
    /// Each stack of the previous report; `None` before the first report.
    previous: Option<HashMap<u64, Seen>>,
    /// The frees of blocks memleak never saw allocated, as of the previous
    /// report.
    previous_unrecorded_frees: Option<u64>,
}

/// What the tracker keeps of a stack between reports.
#[derive(Clone, Copy, Debug, Default)]
struct Seen {
    bytes: u64,
    /// Its bytes that replacing old blocks does not explain.
    new_bytes: u64,
    /// Reports in a row in which those grew.
    streak: u32,
    /// Its new bytes just before the streak began.
    streak_start: u64,
}

impl TrendTracker {
    /// Compares `snapshot` with the previous one and remembers it.
    pub fn observe(&mut self, snapshot: &Snapshot) -> HashMap<u64, Trend> {
        let (trends, current) = self.compare(snapshot);
        self.previous = Some(current);
        self.previous_unrecorded_frees = snapshot.counters.unrecorded_frees;
        trends
    }

    /// The frees of blocks memleak never saw allocated (allocated before
    /// it attached, or left out) since the previous report, as of
    /// `snapshot`; `None` before the first report. The blocks' stacks are
    /// not known, so no stack's trend can take them off: a stack that
    /// replaced them grew in memleak's eyes only.
    pub fn unrecorded_frees_since(&self, snapshot: &Snapshot) -> Option<u64> {
        let (before, now) = (self.previous_unrecorded_frees?, snapshot.counters.unrecorded_frees?);
        Some(now.saturating_sub(before))
    }

    /// Compares `snapshot` with the previous one, which stays the one the
    /// next report is compared with: for a report taken aside the series.
    pub fn peek(&self, snapshot: &Snapshot) -> HashMap<u64, Trend> {
        self.compare(snapshot).0
    }

    fn compare(&self, snapshot: &Snapshot) -> (HashMap<u64, Trend>, HashMap<u64, Seen>) {
        let mut current = HashMap::with_capacity(snapshot.stacks.len());
        let mut trends = HashMap::with_capacity(snapshot.stacks.len());
        for stack in &snapshot.stacks {
            let (trend, seen) = match &self.previous {
                None => (
                    Trend::default(),
                    Seen { bytes: stack.bytes, new_bytes: stack.new_bytes(), ..Seen::default() },
                ),
                Some(previous) => {
                    // A stack missing last time held nothing then.
                    let before = previous.get(&stack.stack_id).copied().unwrap_or_default();
                    let new_bytes = stack.new_bytes();
                    let streak = if new_bytes > before.new_bytes { before.streak + 1 } else { 0 };
                    let streak_start =
                        if before.streak == 0 { before.new_bytes } else { before.streak_start };
                    let growth =
                        (streak > 0).then(|| (new_bytes as i64 - streak_start as i64) / i64::from(streak));
                    let trend = Trend {
                        delta_bytes: Some(stack.bytes as i64 - before.bytes as i64),
                        growing_reports: streak,
                        growth_per_report: growth,
                    };
                    (trend, Seen { bytes: stack.bytes, new_bytes, streak, streak_start })
                }
            };
            current.insert(stack.stack_id, seen);
            trends.insert(stack.stack_id, trend);
        }
        (trends, current)
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
        assert_eq!(first[&1], Trend { delta_bytes: None, growing_reports: 0, growth_per_report: None });
        tracker.observe(&snapshot(&[(1, 200), (2, 300)]));
        let third = tracker.observe(&snapshot(&[(1, 300), (2, 300), (3, 50)]));
        assert_eq!(
            third[&1],
            Trend { delta_bytes: Some(100), growing_reports: 2, growth_per_report: Some(100) }
        );
        assert_eq!(third[&2], Trend { delta_bytes: Some(0), growing_reports: 0, growth_per_report: None });
        let new = Trend { delta_bytes: Some(50), growing_reports: 1, growth_per_report: Some(50) };
        assert_eq!(third[&3], new, "new since last report");
        let fourth = tracker.observe(&snapshot(&[(1, 250)]));
        assert_eq!(fourth[&1], Trend { delta_bytes: Some(-50), growing_reports: 0, growth_per_report: None });
    }

    #[test]
    fn growth_per_report_averages_the_streak() {
        let mut tracker = TrendTracker::default();
        tracker.observe(&snapshot(&[(1, 1000)]));
        tracker.observe(&snapshot(&[(1, 1100)]));
        tracker.observe(&snapshot(&[(1, 1400)]));
        let trend = tracker.observe(&snapshot(&[(1, 1600)]))[&1];
        assert_eq!((trend.growing_reports, trend.growth_per_report), (3, Some(200)));
    }

    #[test]
    fn a_cache_replacing_old_blocks_is_not_growth() {
        // Stack 1 replaces 100-byte blocks from before the attach, 10 a
        // report; stack 2 leaks 50 bytes a report beside it.
        let at = |report: u64| Snapshot {
            stacks: vec![
                StackUsage {
                    stack_id: 1,
                    bytes: report * 1000,
                    allocations: report * 10,
                    replacing: crate::model::Replacing { bytes: report * 1000, allocations: report * 10 },
                    ..StackUsage::default()
                },
                StackUsage { stack_id: 2, bytes: report * 50, allocations: report, ..StackUsage::default() },
            ],
            ..Snapshot::default()
        };
        let mut tracker = TrendTracker::default();
        tracker.observe(&at(1));
        tracker.observe(&at(2));
        let third = tracker.observe(&at(3));
        assert_eq!(third[&1], Trend { delta_bytes: Some(1000), growing_reports: 0, growth_per_report: None });
        assert_eq!(
            third[&2],
            Trend { delta_bytes: Some(50), growing_reports: 2, growth_per_report: Some(50) }
        );
    }

    #[test]
    fn unrecorded_frees_are_counted_since_the_previous_report_of_the_series() {
        let with_frees = |frees| Snapshot {
            counters: crate::model::HealthCounters { unrecorded_frees: Some(frees), ..Default::default() },
            ..snapshot(&[(1, 100)])
        };
        let mut tracker = TrendTracker::default();
        assert_eq!(tracker.unrecorded_frees_since(&with_frees(5)), None, "no report before the first");
        tracker.observe(&with_frees(5));
        assert_eq!(tracker.unrecorded_frees_since(&with_frees(125)), Some(120));
        tracker.peek(&with_frees(125));
        tracker.observe(&with_frees(130));
        assert_eq!(tracker.unrecorded_frees_since(&with_frees(130)), Some(0));
    }

    #[test]
    fn a_report_taken_aside_leaves_the_series_as_it_was() {
        let mut tracker = TrendTracker::default();
        tracker.observe(&snapshot(&[(1, 100)]));
        let aside = tracker.peek(&snapshot(&[(1, 900)]));
        assert_eq!(aside[&1].delta_bytes, Some(800));
        let next = tracker.observe(&snapshot(&[(1, 150)]));
        assert_eq!(next[&1].delta_bytes, Some(50), "compared with the last report of the series");
    }
}
