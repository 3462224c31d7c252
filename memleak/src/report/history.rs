//! A process's recent reports as series: its totals and each stack's
//! outstanding bytes, round after round. `memleak top` draws its
//! sparklines and growth from one; `memleak serve` keeps one for each
//! process it follows (`/api/v1/history`), so that a view opened later
//! starts with the past instead of an empty chart.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use super::{Report, ReportStack};
use crate::symbolize::stable_id;

/// Rounds kept: four minutes at `memleak top`'s 2 s, four at the
/// daemon's. A stack's series is 8 bytes a round.
pub const ROUNDS_KEPT: usize = 120;

/// What a lost stack's series is named (`[stack lost]`).
pub const LOST_STACK_KEY: &str = "lost";

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct History {
    /// Oldest first, `ROUNDS_KEPT` at most.
    pub rounds: VecDeque<RoundTotals>,
    /// Each stack's outstanding bytes in each of `rounds` (0 in those it
    /// held nothing in), by its key (`stack_key`). A stack that held
    /// nothing in any round kept is dropped.
    pub stacks: BTreeMap<String, VecDeque<u64>>,
}

/// A round's totals over every stack of the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoundTotals {
    pub time_unix_ms: u64,
    pub total_bytes: u64,
    pub total_allocations: u64,
    /// Its resident memory then, where it was read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resident_bytes: Option<u64>,
}

impl History {
    /// Adds `report` as the newest round. A report no newer than the last
    /// round is the same round seen twice (a view asking more often than
    /// rounds are taken) and is left out.
    pub fn record(&mut self, report: &Report) {
        if self.rounds.back().is_some_and(|last| last.time_unix_ms >= report.time_unix_ms) {
            return;
        }
        self.rounds.push_back(RoundTotals {
            time_unix_ms: report.time_unix_ms,
            total_bytes: report.total_bytes,
            total_allocations: report.total_allocations,
            resident_bytes: report.memory.resident.as_ref().map(|resident| resident.resident_bytes),
        });
        let rounds = self.rounds.len();
        for series in self.stacks.values_mut() {
            series.push_back(0);
        }
        for stack in &report.stacks {
            let series =
                self.stacks.entry(stack_key(stack)).or_insert_with(|| VecDeque::from(vec![0; rounds]));
            if let Some(newest) = series.back_mut() {
                *newest += stack.bytes;
            }
        }
        if self.rounds.len() > ROUNDS_KEPT {
            self.rounds.pop_front();
            for series in self.stacks.values_mut() {
                series.pop_front();
            }
        }
        self.stacks.retain(|_, series| series.iter().any(|&bytes| bytes > 0));
    }

    /// The stack's outstanding bytes, round after round, oldest first.
    pub fn series(&self, key: &str) -> Option<&VecDeque<u64>> {
        self.stacks.get(key)
    }

    /// The same, as a list of its own (empty for a stack not seen).
    pub fn series_of(&self, key: &str) -> Vec<u64> {
        self.series(key).map(|series| series.iter().copied().collect()).unwrap_or_default()
    }

    /// How much the stack's outstanding bytes changed over the last
    /// round; `None` before a second round.
    pub fn last_change(&self, key: &str) -> Option<i64> {
        let series = self.series(key)?;
        let newest = *series.back()?;
        let before = *series.get(series.len().checked_sub(2)?)?;
        Some(newest as i64 - before as i64)
    }

    /// The same for the process's total.
    pub fn last_total_change(&self) -> Option<i64> {
        let newest = self.rounds.back()?;
        let before = self.rounds.get(self.rounds.len().checked_sub(2)?)?;
        Some(newest.total_bytes as i64 - before.total_bytes as i64)
    }
}

/// What a stack's series is kept under: its stable id, the same in every
/// report of the process (`symbolize::stable_id`), or `lost`.
pub fn stack_key(stack: &ReportStack) -> String {
    if stack.stack_lost {
        return LOST_STACK_KEY.to_owned();
    }
    stack.stable_id.clone().unwrap_or_else(|| stable_id::stable_id(&stack.frames))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::sample_report;

    fn report_at(time_unix_ms: u64, bytes: &[u64]) -> Report {
        let mut report = sample_report(usize::MAX);
        report.time_unix_ms = time_unix_ms;
        report.stacks.truncate(bytes.len());
        for (index, (stack, &held)) in report.stacks.iter_mut().zip(bytes).enumerate() {
            stack.bytes = held;
            stack.stack_lost = false;
            stack.stable_id = Some(format!("stack{index}"));
        }
        report.total_bytes = bytes.iter().sum();
        report
    }

    #[test]
    fn series_line_up_with_rounds_and_stacks_come_and_go() {
        let mut history = History::default();
        history.record(&report_at(1_000, &[100]));
        history.record(&report_at(2_000, &[150, 10]));
        // The same round again: left out.
        history.record(&report_at(2_000, &[999, 999]));
        history.record(&report_at(3_000, &[200]));
        assert_eq!(history.rounds.len(), 3);
        assert_eq!(history.series("stack0"), Some(&VecDeque::from(vec![100, 150, 200])));
        assert_eq!(history.series("stack1"), Some(&VecDeque::from(vec![0, 10, 0])));
        assert_eq!(history.last_change("stack0"), Some(50));
        assert_eq!(history.last_change("stack1"), Some(-10));
        assert_eq!(history.last_total_change(), Some(40));
    }

    #[test]
    fn only_the_last_rounds_are_kept_and_empty_series_go() {
        let mut history = History::default();
        history.record(&report_at(1, &[5, 7]));
        for round in 2..=(ROUNDS_KEPT as u64 + 1) {
            history.record(&report_at(round, &[round]));
        }
        assert_eq!(history.rounds.len(), ROUNDS_KEPT);
        assert_eq!(history.rounds.front().map(|round| round.time_unix_ms), Some(2));
        assert_eq!(history.series("stack0").map(VecDeque::len), Some(ROUNDS_KEPT));
        assert_eq!(history.series("stack1"), None, "its one round is gone");
        let back: History = serde_json::from_str(&serde_json::to_string(&history).unwrap()).unwrap();
        assert_eq!(back, history);
    }
}
