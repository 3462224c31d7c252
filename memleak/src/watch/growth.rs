//! Is a process's memory growing, or only moving? Judged from samples of
//! its anonymous resident memory over a window, as the kernel counts it,
//! with no probe in the process.
//!
//! A leak raises the floor: the least memory the process holds, quarter
//! of the window after quarter, goes up. A runtime that allocates and
//! frees (a GC's sawtooth, a request's buffers) comes back down to the
//! same floor in every quarter however high it climbs between, and a
//! one-off step (a cache filled once, a big request) raises one quarter's
//! floor and no other's. So a process is judged growing when each
//! quarter's floor stands above the one before by a share of the least
//! growth asked for, and the window's robust slope (Theil-Sen: the
//! median of the slopes between every two samples, which one outlier
//! cannot move) is at least that growth.

use std::{collections::VecDeque, time::Duration};

/// The quarters a window is cut into: a floor must rise at each cut.
const QUARTERS: usize = 4;

/// Of the least growth asked for, the share each quarter's floor must
/// rise by: a leak at exactly the least rate raises each floor by a whole
/// quarter's worth, less what its samples' jitter takes off.
const FLOOR_RISE_SHARE: f64 = 0.25;

/// Samples a window needs at least before anything is judged.
const MIN_SAMPLES: usize = 2 * QUARTERS;

/// Of the window, the span its samples must cover: one look late (a busy
/// machine) must not put off every judgement by a whole window.
const COVERED_SHARE: f64 = 0.9;

/// What counts as growth.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GrowthRule {
    /// The span judged, the latest samples' (--growth-window).
    pub window: Duration,
    /// The least growth judged a leak, in bytes per second (--min-growth).
    pub min_bytes_per_second: f64,
}

/// What the samples say.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Judgement {
    /// Fewer samples than a window yet.
    TooEarly,
    /// Not growing as the rule asks.
    Steady,
    /// Growing, at this robust rate.
    Growing { bytes_per_second: f64 },
}

/// A process's samples over the latest window: (seconds on a monotonic
/// clock, bytes).
#[derive(Clone, Debug, Default)]
pub struct Samples {
    samples: VecDeque<(f64, u64)>,
}

impl Samples {
    /// Adds a sample taken at `seconds`, and lets go of those older than
    /// the window needs.
    pub fn push(&mut self, seconds: f64, bytes: u64, window: Duration) {
        self.samples.push_back((seconds, bytes));
        let oldest_kept = seconds - window.as_secs_f64();
        while self.samples.len() > MIN_SAMPLES
            && self.samples.front().is_some_and(|(at, _)| *at < oldest_kept)
        {
            self.samples.pop_front();
        }
    }

    /// Forgets every sample: the next judgement waits for a whole window.
    pub fn clear(&mut self) {
        self.samples.clear();
    }

    /// Every sample kept, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = (f64, u64)> + '_ {
        self.samples.iter().copied()
    }

    pub fn judge(&self, rule: &GrowthRule) -> Judgement {
        let (Some((first, _)), Some((last, _))) = (self.samples.front(), self.samples.back()) else {
            return Judgement::TooEarly;
        };
        let span = last - first;
        if self.samples.len() < MIN_SAMPLES || span < rule.window.as_secs_f64() * COVERED_SHARE {
            return Judgement::TooEarly;
        }
        let floors = self.floors(*first, span);
        let least_rise = rule.min_bytes_per_second * span / QUARTERS as f64 * FLOOR_RISE_SHARE;
        let floors_rise = floors.windows(2).all(|pair| match pair {
            [Some(lower), Some(higher)] => *higher as f64 - *lower as f64 >= least_rise,
            _ => false,
        });
        if !floors_rise {
            return Judgement::Steady;
        }
        let bytes_per_second = self.theil_sen_slope();
        if bytes_per_second >= rule.min_bytes_per_second {
            Judgement::Growing { bytes_per_second }
        } else {
            Judgement::Steady
        }
    }

    /// The least bytes of each quarter of the `span` from `first`; `None`
    /// for a quarter with no sample (looks missed).
    fn floors(&self, first: f64, span: f64) -> [Option<u64>; QUARTERS] {
        let mut floors = [None; QUARTERS];
        for (at, bytes) in &self.samples {
            #[allow(
                clippy::cast_possible_truncation,
                clippy::cast_sign_loss,
                reason = "a share of QUARTERS, 0 to 4, the sample being within the span"
            )]
            let quarter = (((at - first) / span * QUARTERS as f64) as usize).min(QUARTERS - 1);
            let floor = &mut floors[quarter];
            *floor = Some(floor.map_or(*bytes, |lowest: u64| lowest.min(*bytes)));
        }
        floors
    }

    /// The median of the slopes between every two samples, in bytes per
    /// second. A window holds a few hundred samples at most.
    fn theil_sen_slope(&self) -> f64 {
        let mut slopes = Vec::with_capacity(self.samples.len() * self.samples.len() / 2);
        for (index, (at, bytes)) in self.samples.iter().enumerate() {
            for (later_at, later_bytes) in self.samples.iter().skip(index + 1) {
                let elapsed = later_at - at;
                if elapsed > 0.0 {
                    slopes.push((*later_bytes as f64 - *bytes as f64) / elapsed);
                }
            }
        }
        if slopes.is_empty() {
            return 0.0;
        }
        let middle = slopes.len() / 2;
        let (_, median, _) = slopes.select_nth_unstable_by(middle, f64::total_cmp);
        *median
    }
}

#[cfg(test)]
#[allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "the samples made up here are positive and far below 2^52"
)]
mod tests {
    use super::*;

    const KIB: f64 = 1024.0;

    /// 16 KiB/s over 60 s, as the tests below sample it: once a second.
    fn rule() -> GrowthRule {
        GrowthRule { window: Duration::from_mins(1), min_bytes_per_second: 16.0 * KIB }
    }

    /// The judgement of 121 samples, one a second, each `bytes(second)`:
    /// the window's 60 s and a minute before it.
    fn judged(bytes: impl Fn(u64) -> f64) -> Judgement {
        let mut samples = Samples::default();
        for second in 0..=120 {
            samples.push(second as f64, bytes(second).max(0.0) as u64, rule().window);
        }
        samples.judge(&rule())
    }

    const BASE: f64 = 200.0 * 1024.0 * 1024.0;

    /// Jitter of a few pages up and down, the same for each run.
    fn jitter(second: u64) -> f64 {
        ((second * 7919) % 13) as f64 * 4096.0 - 6.0 * 4096.0
    }

    #[test]
    fn a_slow_leak_with_jitter_is_growing_at_its_rate() {
        let Judgement::Growing { bytes_per_second } =
            judged(|second| BASE + 64.0 * KIB * second as f64 + jitter(second))
        else {
            panic!("a 64 KiB/s leak was not judged growing");
        };
        assert!((bytes_per_second - 64.0 * KIB).abs() < 4.0 * KIB, "{bytes_per_second}");
    }

    #[test]
    fn a_leak_below_the_least_growth_is_steady() {
        assert_eq!(judged(|second| BASE + 4.0 * KIB * second as f64), Judgement::Steady);
    }

    #[test]
    fn a_flat_process_with_jitter_is_steady() {
        assert_eq!(judged(|second| BASE + jitter(second)), Judgement::Steady);
    }

    #[test]
    fn a_sawtooth_of_50_mb_is_steady_whatever_its_period() {
        for period in [4, 10, 25, 40] {
            let sawtooth = |second: u64| BASE + 50e6 * (second % period) as f64 / period as f64;
            assert_eq!(judged(sawtooth), Judgement::Steady, "a sawtooth of period {period} s");
        }
    }

    #[test]
    fn one_step_up_is_steady_wherever_it_falls() {
        for step_at in [65, 80, 90, 100, 115] {
            let step = |second: u64| if second < step_at { BASE } else { BASE + 100e6 };
            assert_eq!(judged(step), Judgement::Steady, "a step at {step_at} s");
        }
    }

    #[test]
    fn a_staircase_of_frequent_steps_is_growing() {
        // 1 MiB every 8 s: a leak in bursts, 128 KiB/s on average.
        let staircase = |second: u64| BASE + (second / 8) as f64 * 1024.0 * KIB;
        assert!(matches!(judged(staircase), Judgement::Growing { .. }), "{:?}", judged(staircase));
    }

    #[test]
    fn a_leak_on_a_sawtooth_is_growing() {
        let both = |second: u64| BASE + 64.0 * KIB * second as f64 + 50e6 * (second % 5) as f64 / 5.0;
        assert!(matches!(judged(both), Judgement::Growing { .. }), "{:?}", judged(both));
    }

    #[test]
    fn nothing_is_judged_before_a_window_is_covered() {
        let mut samples = Samples::default();
        for second in 0..50 {
            samples.push(f64::from(second), (BASE + 1e6 * f64::from(second)) as u64, rule().window);
        }
        assert_eq!(samples.judge(&rule()), Judgement::TooEarly);
        samples.clear();
        assert_eq!(samples.judge(&rule()), Judgement::TooEarly);
    }
}
