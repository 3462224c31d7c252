//! What `memleak top` shows, and what each key does to it: the
//! processes and their histories, the stack selected and opened, the
//! order, the filter, a pause, and a diff against the last snapshot
//! saved. Nothing here draws or reads the terminal (`draw`, `mod`).

use std::{collections::HashMap, path::PathBuf, sync::Arc};

use crossterm::event::{KeyCode, KeyEvent, KeyEventKind, KeyModifiers};

use crate::{
    model::Frame,
    report::{
        culprit::SkipRules,
        diff::Diff,
        history::{stack_key, History},
        options::{DiffOrder, SortKey},
        saved::Saved,
        text, Report,
    },
};

/// Stacks a diff keeps of those that grew, and of those that shrank.
const DIFF_STACKS: usize = 100;

/// A process shown, with its latest report and the series of its past.
pub struct Process {
    pub pid: u32,
    pub report: Arc<Report>,
    pub history: History,
    pub exited: bool,
    /// What memleak's probes cost it so far, in seconds, where known
    /// (a daemon that priced them).
    pub overhead_seconds: Option<f64>,
}

/// A process's latest report, as a source hands it over.
pub struct Update {
    pub report: Report,
    pub exited: bool,
    pub overhead_seconds: Option<f64>,
    /// Its past as the daemon keeps it, which replaces what the view
    /// recorded: the report is in it already.
    pub history: Option<History>,
}

/// One row of the table: a stack, or the same stack summed over every
/// process (all together).
#[derive(Clone, Debug)]
pub struct Row {
    pub key: String,
    /// Its culprit's name, or its first named frame's.
    pub culprit: String,
    /// That frame's `file:line`, where known.
    pub place: Option<String>,
    pub bytes: u64,
    pub allocations: u64,
    /// Over the last round, or since the snapshot diffed against.
    pub growth: Option<i64>,
    /// Its outstanding bytes, round after round, oldest first.
    pub series: Vec<u64>,
    pub frames: Vec<Arc<Frame>>,
    pub plumbing: Vec<bool>,
    pub stack_lost: bool,
}

/// The snapshot `s` saved last, which `d` diffs against.
pub struct LastSave {
    pub path: PathBuf,
    pub snapshot: Saved,
}

/// What a key asks of the loop beyond the view.
#[derive(Debug, PartialEq, Eq)]
pub enum Asked {
    Nothing,
    Quit,
    /// Save the process shown (its pid).
    Save(u32),
}

/// Which processes the table is of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shown {
    All,
    /// The nth process.
    One(usize),
}

pub struct View {
    processes: Vec<Process>,
    /// While paused: what was shown when `p` was pressed.
    frozen: Option<Vec<Process>>,
    pub shown: Shown,
    pub sort: SortKey,
    pub selected: usize,
    /// The selected stack's frames are shown under it.
    pub opened: bool,
    /// Every frame, plumbing too.
    pub full_stacks: bool,
    /// What rows must mention (function, file or object), lower case.
    pub filter: String,
    /// The filter being typed, after `/`.
    pub typing: Option<String>,
    pub last_save: Option<LastSave>,
    /// `d` was pressed: the growth shown is since the last snapshot
    /// saved.
    pub diffing: bool,
    /// That diff, once a round newer than the snapshot came.
    pub diff: Option<Diff>,
    /// The last thing said: memleak's own lines, a save, an error.
    pub status: String,
    skips: Arc<SkipRules>,
}

impl View {
    pub fn new(sort: SortKey, skips: Arc<SkipRules>) -> Self {
        Self {
            processes: Vec::new(),
            frozen: None,
            shown: Shown::All,
            sort,
            selected: 0,
            opened: false,
            full_stacks: false,
            filter: String::new(),
            typing: None,
            last_save: None,
            diffing: false,
            diff: None,
            status: String::new(),
            skips,
        }
    }

    /// The processes as shown: frozen while paused.
    pub fn processes(&self) -> &[Process] {
        self.frozen.as_deref().unwrap_or(&self.processes)
    }

    pub fn paused(&self) -> bool {
        self.frozen.is_some()
    }

    /// The process the table is of, unless it is of all together.
    pub fn process(&self) -> Option<&Process> {
        match self.shown {
            Shown::One(index) => self.processes().get(index),
            Shown::All => match self.processes() {
                [only] => Some(only),
                _ => None,
            },
        }
    }

    /// Takes a round of reports in. A paused view keeps them for later:
    /// its history goes on.
    pub fn take(&mut self, updates: Vec<Update>) {
        for update in updates {
            let report = Arc::new(update.report);
            let known = self.processes.iter().position(|process| process.pid == report.pid);
            let index = known.unwrap_or_else(|| {
                self.processes.push(Process {
                    pid: report.pid,
                    report: Arc::clone(&report),
                    history: History::default(),
                    exited: false,
                    overhead_seconds: None,
                });
                self.processes.len() - 1
            });
            let process = &mut self.processes[index];
            match update.history {
                Some(history) => process.history = history,
                None => process.history.record(&report),
            }
            process.report = report;
            process.exited = update.exited;
            process.overhead_seconds = update.overhead_seconds;
        }
        if self.diffing && !self.paused() {
            self.diff = self.diff_against_last_save();
        }
    }

    /// The rows of the table, filtered and in order.
    pub fn rows(&self) -> Vec<Row> {
        let mut rows = match (self.diffing, &self.diff, self.process()) {
            (true, Some(diff), _) => self.diff_rows(diff),
            // The diff waits for a round newer than the snapshot.
            (true, None, _) => Vec::new(),
            (false, _, Some(process)) => process_rows(process),
            (false, _, None) => merged_rows(self.processes()),
        };
        if !self.filter.is_empty() {
            rows.retain(|row| mentions(row, &self.filter));
        }
        let sort = if self.diffing { SortKey::Growth } else { self.sort };
        rows.sort_by(|a, b| {
            let rank = |row: &Row| match sort {
                SortKey::Size => (i128::from(row.bytes), i128::from(row.allocations)),
                SortKey::Count => (i128::from(row.allocations), i128::from(row.bytes)),
                SortKey::Growth => (i128::from(row.growth.unwrap_or(0)), i128::from(row.bytes)),
            };
            rank(b).cmp(&rank(a)).then_with(|| a.key.cmp(&b.key))
        });
        rows
    }

    fn diff_rows(&self, diff: &Diff) -> Vec<Row> {
        let history = self.process().map(|process| &process.history);
        diff.stacks
            .iter()
            .map(|stack| {
                let key = crate::symbolize::stable_id::stable_id(&stack.frames);
                let (culprit, place) =
                    culprit_label(stack.culprit.as_deref(), &stack.frames, stack.stack_lost);
                Row {
                    culprit,
                    place,
                    bytes: stack.new_bytes,
                    allocations: stack.new_allocations,
                    growth: Some(stack.delta_bytes),
                    series: history.map(|history| history.series_of(&key)).unwrap_or_default(),
                    frames: stack.frames.clone(),
                    plumbing: stack.plumbing.clone(),
                    stack_lost: stack.stack_lost,
                    key,
                }
            })
            .collect()
    }

    /// What `key` does; `rows` is how many rows the table has now.
    pub fn key(&mut self, key: KeyEvent, rows: usize, page: usize) -> Asked {
        if key.kind == KeyEventKind::Release {
            return Asked::Nothing;
        }
        if key.modifiers.contains(KeyModifiers::CONTROL) && key.code == KeyCode::Char('c') {
            return Asked::Quit;
        }
        if self.typing.is_some() {
            self.type_filter(key.code);
            return Asked::Nothing;
        }
        let last = rows.saturating_sub(1);
        match key.code {
            KeyCode::Char('q') => return Asked::Quit,
            KeyCode::Up | KeyCode::Char('k') => self.select(self.selected.saturating_sub(1)),
            KeyCode::Down | KeyCode::Char('j') => self.select((self.selected + 1).min(last)),
            KeyCode::PageUp => self.select(self.selected.saturating_sub(page)),
            KeyCode::PageDown => self.select((self.selected + page).min(last)),
            KeyCode::Home => self.select(0),
            KeyCode::End => self.select(last),
            KeyCode::Enter => self.opened = !self.opened,
            KeyCode::Char('o') => {
                self.sort = match self.sort {
                    SortKey::Growth => SortKey::Size,
                    SortKey::Size => SortKey::Count,
                    SortKey::Count => SortKey::Growth,
                };
                self.select(0);
            }
            KeyCode::Char('f') => self.full_stacks = !self.full_stacks,
            KeyCode::Char('/') => self.typing = Some(self.filter.clone()),
            KeyCode::Esc => {
                self.filter.clear();
                self.opened = false;
            }
            KeyCode::Char('p') => {
                self.frozen = match self.frozen.take() {
                    Some(_) => None,
                    None => Some(self.processes.iter().map(Process::copy).collect()),
                };
            }
            KeyCode::Tab | KeyCode::BackTab => self.next_process(key.code == KeyCode::BackTab),
            KeyCode::Char('s') => match self.process() {
                Some(process) => return Asked::Save(process.pid),
                None => "s saves one process: Tab to it first".clone_into(&mut self.status),
            },
            KeyCode::Char('d') => self.toggle_diff(),
            _ => {}
        }
        Asked::Nothing
    }

    /// A key while the filter is typed, after `/`.
    fn type_filter(&mut self, key: KeyCode) {
        let Some(typed) = self.typing.as_mut() else { return };
        match key {
            KeyCode::Enter => {
                self.filter = typed.trim().to_lowercase();
                self.typing = None;
                self.selected = 0;
            }
            KeyCode::Esc => self.typing = None,
            KeyCode::Backspace => {
                typed.pop();
            }
            KeyCode::Char(character) => typed.push(character),
            _ => {}
        }
    }

    fn select(&mut self, row: usize) {
        if row != self.selected {
            self.opened = false;
        }
        self.selected = row;
    }

    /// All together, then each process in turn.
    fn next_process(&mut self, backwards: bool) {
        let count = self.processes().len();
        if count < 2 {
            return;
        }
        // All is place 0, process n is place n + 1.
        let place = match self.shown {
            Shown::All => 0,
            Shown::One(index) => index + 1,
        };
        let place = if backwards { (place + count) % (count + 1) } else { (place + 1) % (count + 1) };
        self.shown = if place == 0 { Shown::All } else { Shown::One(place - 1) };
        self.diffing = false;
        self.diff = None;
        self.select(0);
    }

    /// `d`: the growth since the last snapshot saved, for its process,
    /// as each round moves it; `d` again goes back to the live growth.
    fn toggle_diff(&mut self) {
        if std::mem::take(&mut self.diffing) {
            self.diff = None;
            self.status.clear();
            return;
        }
        let Some(save) = &self.last_save else {
            "d diffs against the last snapshot saved: press s first".clone_into(&mut self.status);
            return;
        };
        let (path, base_pid) = (save.path.display().to_string(), save.snapshot.report().pid);
        let Some(index) = self.processes().iter().position(|process| process.pid == base_pid) else {
            self.status = format!("{path} is of pid {base_pid}, no longer shown");
            return;
        };
        self.diffing = true;
        self.shown = Shown::One(index);
        self.diff = self.diff_against_last_save();
        self.status = format!("the growth since {path}; d goes back to the growth over a round");
        self.select(0);
    }

    /// The process of the last snapshot saved, from then to its latest
    /// round; none before a round newer than the snapshot.
    fn diff_against_last_save(&self) -> Option<Diff> {
        let save = self.last_save.as_ref()?;
        let base = save.snapshot.report();
        let process = self.processes().iter().find(|process| process.pid == base.pid)?;
        if process.report.time_unix_ms <= base.time_unix_ms {
            return None;
        }
        let now = Saved::from_report((*process.report).clone());
        Some(Diff::of(&save.snapshot, &now, DIFF_STACKS, DiffOrder::Growth, &self.skips))
    }
}

impl Process {
    /// A copy to freeze: the report is shared.
    fn copy(&self) -> Self {
        Self {
            pid: self.pid,
            report: Arc::clone(&self.report),
            history: self.history.clone(),
            exited: self.exited,
            overhead_seconds: self.overhead_seconds,
        }
    }
}

fn process_rows(process: &Process) -> Vec<Row> {
    process
        .report
        .stacks
        .iter()
        .map(|stack| {
            let key = stack_key(stack);
            let (culprit, place) = culprit_label(stack.culprit.as_deref(), &stack.frames, stack.stack_lost);
            Row {
                culprit,
                place,
                bytes: stack.bytes,
                allocations: stack.allocations,
                growth: process.history.last_change(&key),
                series: process.history.series_of(&key),
                frames: stack.frames.clone(),
                plumbing: stack.plumbing.clone(),
                stack_lost: stack.stack_lost,
                key,
            }
        })
        .collect()
}

/// Every process's rows, the same stack summed: its series added up
/// round by round from the newest back.
fn merged_rows(processes: &[Process]) -> Vec<Row> {
    let mut merged: Vec<Row> = Vec::new();
    let mut places: HashMap<String, usize> = HashMap::new();
    for row in processes.iter().flat_map(process_rows) {
        let Some(&place) = places.get(&row.key) else {
            places.insert(row.key.clone(), merged.len());
            merged.push(row);
            continue;
        };
        let into = &mut merged[place];
        into.bytes += row.bytes;
        into.allocations += row.allocations;
        into.growth = match (into.growth, row.growth) {
            (Some(a), Some(b)) => Some(a + b),
            (a, b) => a.or(b),
        };
        if row.series.len() > into.series.len() {
            let missing = row.series.len() - into.series.len();
            into.series.splice(0..0, std::iter::repeat_n(0, missing));
        }
        let offset = into.series.len() - row.series.len();
        for (sum, bytes) in into.series[offset..].iter_mut().zip(&row.series) {
            *sum += bytes;
        }
    }
    merged
}

/// The name and `file:line` of the culprit, else of the first frame
/// with a name; what a lost stack is.
pub fn culprit_label(
    culprit: Option<&Frame>,
    frames: &[Arc<Frame>],
    stack_lost: bool,
) -> (String, Option<String>) {
    if stack_lost {
        return ("[stack lost: raise --max-stacks]".to_owned(), None);
    }
    let Some(frame) = culprit.or_else(|| frames.iter().find(|frame| frame.function.is_some()).map(|f| &**f))
    else {
        let name = frames.first().map_or_else(|| "[no frames]".to_owned(), |frame| text::frame_name(frame));
        return (name, None);
    };
    let place = match (&frame.file, frame.line) {
        (Some(file), Some(line)) => Some(format!("{file}:{line}")),
        (Some(file), None) => Some(file.clone()),
        _ => None,
    };
    (text::frame_name(frame), place)
}

/// Whether a row's frames mention `filter` (lower case) in a function,
/// file or object.
fn mentions(row: &Row, filter: &str) -> bool {
    let has =
        |text: &Option<String>| text.as_deref().is_some_and(|text| text.to_lowercase().contains(filter));
    row.frames.iter().any(|frame| has(&frame.function) || has(&frame.file) || has(&frame.module))
}

#[cfg(test)]
mod tests {
    use crossterm::event::KeyEvent;

    use super::*;
    use crate::report::tests::sample_report;

    /// The sample report of `pid` at `time`, its fibonacci stack holding
    /// `bytes`.
    fn round(pid: u32, time_unix_ms: u64, bytes: u64) -> Update {
        let mut report = sample_report(usize::MAX);
        report.pid = pid;
        report.time_unix_ms = time_unix_ms;
        let fibonacci =
            report.stacks.iter_mut().find(|stack| stack.bytes == 24_576).expect("the large stack");
        fibonacci.bytes = bytes;
        Update { report, exited: false, overhead_seconds: None, history: None }
    }

    fn press(view: &mut View, code: KeyCode) -> Asked {
        let rows = view.rows().len();
        view.key(KeyEvent::from(code), rows, 10)
    }

    fn fibonacci(view: &View) -> Row {
        view.rows().into_iter().find(|row| row.culprit == "fibonacci").expect("the fibonacci row")
    }

    #[test]
    fn processes_are_shown_together_then_each_in_turn() {
        let mut view = View::new(SortKey::Growth, Arc::new(SkipRules::default()));
        view.take(vec![round(1, 1_000, 1_000), round(2, 1_000, 5_000)]);
        view.take(vec![round(1, 2_000, 3_000), round(2, 2_000, 5_000)]);
        assert_eq!(view.shown, Shown::All);
        let together = fibonacci(&view);
        assert_eq!(
            (together.bytes, together.growth, together.series),
            (8_000, Some(2_000), vec![6_000, 8_000])
        );
        assert_eq!(view.rows()[0].culprit, "fibonacci", "the one that grew comes first");
        press(&mut view, KeyCode::Tab);
        assert_eq!(view.shown, Shown::One(0));
        assert_eq!(fibonacci(&view).growth, Some(2_000));
        press(&mut view, KeyCode::Tab);
        assert_eq!((view.shown, fibonacci(&view).growth), (Shown::One(1), Some(0)));
        press(&mut view, KeyCode::Tab);
        assert_eq!(view.shown, Shown::All);
        press(&mut view, KeyCode::BackTab);
        assert_eq!(view.shown, Shown::One(1));
        assert_eq!(press(&mut view, KeyCode::Char('s')), Asked::Save(2));
    }

    #[test]
    fn keys_order_filter_open_and_pause() {
        let mut view = View::new(SortKey::Growth, Arc::new(SkipRules::default()));
        view.take(vec![round(1, 1_000, 1_000)]);
        press(&mut view, KeyCode::Char('o'));
        assert_eq!(view.sort, SortKey::Size);
        press(&mut view, KeyCode::Char('o'));
        assert_eq!(view.sort, SortKey::Count);
        press(&mut view, KeyCode::Char('o'));
        assert_eq!(view.sort, SortKey::Growth);

        press(&mut view, KeyCode::Char('/'));
        for character in "FIB".chars() {
            press(&mut view, KeyCode::Char(character));
        }
        assert_eq!(press(&mut view, KeyCode::Char('q')), Asked::Nothing, "q is typed into the filter");
        press(&mut view, KeyCode::Backspace);
        press(&mut view, KeyCode::Enter);
        assert_eq!(view.filter, "fib");
        let culprits: Vec<String> = view.rows().into_iter().map(|row| row.culprit).collect();
        assert_eq!(culprits, ["fibonacci"]);
        press(&mut view, KeyCode::Esc);
        assert!(view.rows().len() > 1);

        press(&mut view, KeyCode::Down);
        assert_eq!(view.selected, 1);
        press(&mut view, KeyCode::Enter);
        assert!(view.opened);
        press(&mut view, KeyCode::Up);
        assert!(!view.opened, "another row selected is closed");

        press(&mut view, KeyCode::Char('p'));
        view.take(vec![round(1, 2_000, 9_000)]);
        assert_eq!(fibonacci(&view).bytes, 1_000, "paused");
        press(&mut view, KeyCode::Char('p'));
        assert_eq!(
            (fibonacci(&view).bytes, fibonacci(&view).growth),
            (9_000, Some(8_000)),
            "the round taken meanwhile"
        );
        assert_eq!(press(&mut view, KeyCode::Char('d')), Asked::Nothing);
        assert!(!view.diffing, "nothing saved yet: {}", view.status);
        assert_eq!(press(&mut view, KeyCode::Char('q')), Asked::Quit);
    }
}
