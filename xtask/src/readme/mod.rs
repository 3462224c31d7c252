//! `cargo xtask readme`: the README's example outputs, made again from
//! real runs, so that they cannot go stale.
//!
//! Each generated block in README.md is a fenced block right after an
//! HTML comment that names its example:
//!
//! ````text
//! <!-- example: demo -->
//! ```
//! $ sudo memleak -c './leaker demo --exit' 1
//! ...
//! ```
//! ````
//!
//! `examples.rs` holds one function per example, which runs the real
//! commands (memleak, the fixtures, redis-server, curl, go tool pprof...)
//! in a scratch directory, `/tmp/memleak-readme`, and returns the block's
//! new text; some also make files the README shows (`docs/*.svg`, the
//! serve page's screenshot). Adding an example is a function there, a line
//! in `EXAMPLES` and a marker in the README.
//!
//! Output is kept real: times, pids, addresses and ports are what the run
//! printed. But a block is only rewritten when it changed in more than
//! what is run-specific (`normalise`): a regenerated README then differs
//! from the last one only where memleak's output did, not at every pid.
//! `--check` makes every block again, writes nothing, and fails naming
//! each example whose output changed, with the lines that did.

mod examples;
mod normalise;
mod workshop;

use std::{
    collections::BTreeSet,
    fmt::Write as _,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context as _, Result};

use crate::{cargo, install_missing_packages, require_root, root, run as run_command, setup};
pub use normalise::Check;
use workshop::Workshop;

/// One example of the README: its name in the marker, how its blocks are
/// compared, and the function that makes its text.
pub struct Example {
    pub name: &'static str,
    pub check: Check,
    pub make: fn(&mut Workshop) -> Result<Made>,
}

/// What an example made: the text of its block, of the blocks of its
/// parts (`<!-- example: NAME/PART -->`: one run shown in several blocks,
/// with prose between them), and files it shows.
#[derive(Default)]
pub struct Made {
    pub text: String,
    pub parts: Vec<(&'static str, String)>,
    /// Paths relative to the workspace root, and their new contents.
    pub files: Vec<(PathBuf, Artifact)>,
}

/// A file an example makes for the README to show.
pub enum Artifact {
    /// Text, compared as blocks are.
    Text(String),
    /// A picture, compared by the text it was drawn from: `source` is
    /// stored in the PNG as a `tEXt` chunk, and the picture is replaced
    /// only when the source changed in more than what is run-specific.
    Png { png: Vec<u8>, source: String },
}

/// Why an example made nothing here, when it could not: a tool or a
/// program this machine lacks. Its blocks are left as they are.
#[derive(Debug)]
pub struct Unavailable(pub String);

impl std::fmt::Display for Unavailable {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(&self.0)
    }
}

impl std::error::Error for Unavailable {}

/// What the run does: write the README, or only check it.
pub struct Options {
    pub check: bool,
    /// Rewrite each block made, even where only run-specific values
    /// changed: a fresh transcript.
    pub fresh: bool,
    /// Only these examples; all when empty.
    pub only: Vec<String>,
}

/// Packages the examples run, besides what the tests install: the
/// README's real programs.
const PACKAGES: [&str; 10] = [
    "gcc",
    "g++",
    "redis-server",
    "golang-go",
    "prometheus",
    "chromium",
    "curl",
    "python3",
    "util-linux",
    "binutils",
];

pub fn run(options: &Options) -> Result<()> {
    setup::run()?;
    require_root("cargo xtask readme")?;
    install_missing_packages(&PACKAGES, "the README's examples")?;
    run_command(cargo().args(["build", "--package", "memleak"]))?;
    let readme_path = root().join("README.md");
    let readme = std::fs::read_to_string(&readme_path).context("cannot read README.md")?;
    let blocks = blocks(&readme)?;
    let chosen = chosen(&blocks, &options.only)?;
    let mut workshop = Workshop::new(&root().join("target/debug/memleak"))?;
    // A marker no example answers fails on its own; the others run.
    let mut outcomes: Vec<Outcome> = unknown(&blocks)
        .into_iter()
        .map(|block| Outcome::Failed {
            name: block.name.clone(),
            error: format!(
                "README.md line {}: no example called {:?} (see xtask/src/readme/examples.rs)",
                block.line,
                example_of(&block.name)
            ),
        })
        .collect();
    for example in examples::EXAMPLES.iter().filter(|example| chosen.contains(example.name)) {
        eprintln!("readme: {}", example.name);
        let made = workshop.make(example);
        outcomes.extend(compare(example, &blocks, &readme, made, options.fresh));
    }
    let summary = summarise(&outcomes, options.check);
    print!("{summary}");
    if options.check {
        if outcomes.iter().any(|outcome| !matches!(outcome, Outcome::Same | Outcome::Unavailable { .. })) {
            bail!("the README's examples are not what memleak prints now: run `cargo xtask readme`");
        }
        return Ok(());
    }
    let mut changed: Vec<(&Block, &String)> = outcomes
        .iter()
        .filter_map(|outcome| match outcome {
            Outcome::Changed { block: Some(block), text, .. } => Some((block, text)),
            _ => None,
        })
        .collect();
    // From the end, so that earlier blocks' offsets stay right.
    changed.sort_by_key(|(block, _)| std::cmp::Reverse(block.content.start));
    let mut updated = readme.clone();
    for (block, text) in changed {
        updated.replace_range(block.content.clone(), text);
    }
    if updated != readme {
        std::fs::write(&readme_path, updated).context("cannot write README.md")?;
    }
    for outcome in &outcomes {
        if let Outcome::Changed { files, .. } = outcome {
            for (path, bytes) in files {
                std::fs::write(root().join(path), bytes)
                    .with_context(|| format!("cannot write {}", path.display()))?;
            }
        }
    }
    if outcomes.iter().any(|outcome| matches!(outcome, Outcome::Failed { .. })) {
        bail!("some examples failed: their blocks are left as they were");
    }
    Ok(())
}

/// The example a block belongs to: `serve` for `serve` and `serve/curl`.
fn example_of(block: &str) -> &str {
    block.split_once('/').map_or(block, |(example, _)| example)
}

/// The blocks whose markers name no example.
fn unknown(blocks: &[Block]) -> Vec<&Block> {
    let known = |name: &str| examples::EXAMPLES.iter().any(|example| example.name == name);
    blocks.iter().filter(|block| !known(example_of(&block.name))).collect()
}

/// The examples to run: those asked for, else every one the README
/// marks. An example asked for that there is not, or that the README does
/// not mark, is an error.
fn chosen(blocks: &[Block], only: &[String]) -> Result<BTreeSet<&'static str>> {
    let known: BTreeSet<&'static str> = examples::EXAMPLES.iter().map(|example| example.name).collect();
    if let Some(unknown) = only.iter().find(|name| !known.contains(name.as_str())) {
        let known: Vec<&str> = known.into_iter().collect();
        bail!("no example called {unknown:?}; the examples: {}", known.join(", "));
    }
    let marked: BTreeSet<&str> = blocks.iter().map(|block| example_of(&block.name)).collect();
    let mut chosen = BTreeSet::new();
    for example in examples::EXAMPLES {
        let asked = only.is_empty() || only.iter().any(|name| name == example.name);
        if asked && marked.contains(example.name) {
            chosen.insert(example.name);
        } else if asked && !only.is_empty() {
            bail!("README.md has no `<!-- example: {} -->` block", example.name);
        }
    }
    Ok(chosen)
}

/// A generated block of the README.
#[derive(Clone, Debug)]
struct Block {
    name: String,
    /// The line of its marker, from 1.
    line: usize,
    /// Byte range of its contents, between the fences' lines.
    content: std::ops::Range<usize>,
}

const MARKER_START: &str = "<!-- example: ";
const MARKER_END: &str = " -->";

/// Every marked block of `readme`: a marker line, then at once an opening
/// fence; the block runs to the next fence line.
fn blocks(readme: &str) -> Result<Vec<Block>> {
    let mut blocks: Vec<Block> = Vec::new();
    let mut offset = 0;
    let mut lines = readme.split_inclusive('\n').enumerate().peekable();
    while let Some((index, line)) = lines.next() {
        offset += line.len();
        let Some(name) =
            line.trim_end().strip_prefix(MARKER_START).and_then(|rest| rest.strip_suffix(MARKER_END))
        else {
            continue;
        };
        let marker_line = index + 1;
        let Some((_, fence)) = lines.next().filter(|(_, fence)| fence.starts_with("```")) else {
            bail!("README.md line {marker_line}: the example marker must be followed by a ``` line");
        };
        offset += fence.len();
        let start = offset;
        let mut end = None;
        for (_, line) in lines.by_ref() {
            if line.trim_end() == "```" {
                end = Some(offset);
                offset += line.len();
                break;
            }
            offset += line.len();
        }
        let Some(end) = end else {
            bail!("README.md line {marker_line}: the block of {name:?} is not closed")
        };
        if blocks.iter().any(|block| block.name == name) {
            bail!("README.md line {marker_line}: a second block for example {name:?}");
        }
        blocks.push(Block { name: name.to_owned(), line: marker_line, content: start..end });
    }
    Ok(blocks)
}

/// What became of one block, or of an example's files.
enum Outcome {
    Same,
    Changed {
        /// The block's name, or the example's for its files.
        name: String,
        /// The block, when a block changed.
        block: Option<Block>,
        text: String,
        /// Lines that differ beyond what is run-specific, old then new.
        difference: String,
        files: Vec<(PathBuf, Vec<u8>)>,
    },
    Unavailable {
        name: String,
        why: String,
    },
    Failed {
        name: String,
        error: String,
    },
}

/// What `made` changes of the blocks of `example` in `readme`, and of the
/// files it shows.
fn compare(
    example: &Example,
    blocks: &[Block],
    readme: &str,
    made: Result<Made>,
    fresh: bool,
) -> Vec<Outcome> {
    let name = example.name.to_owned();
    let made = match made {
        Ok(made) => made,
        Err(error) => {
            return vec![match error.downcast_ref::<Unavailable>() {
                Some(why) => Outcome::Unavailable { name, why: why.0.clone() },
                None => Outcome::Failed { name, error: format!("{error:#}") },
            }];
        }
    };
    let mut texts = vec![(example.name.to_owned(), made.text)];
    texts.extend(made.parts.into_iter().map(|(part, text)| (format!("{}/{part}", example.name), text)));
    let mut outcomes = Vec::new();
    for block in blocks.iter().filter(|block| example_of(&block.name) == example.name) {
        let Some(position) = texts.iter().position(|(name, _)| *name == block.name) else {
            let error = format!("made no text for the block {:?}", block.name);
            outcomes.push(Outcome::Failed { name: block.name.clone(), error });
            continue;
        };
        let (_, mut text) = texts.remove(position);
        if !text.ends_with('\n') {
            text.push('\n');
        }
        let old = &readme[block.content.clone()];
        let mut difference = normalise::difference(example.check, old, &text);
        if fresh && difference.is_empty() && old != text {
            "  (run-specific values only: --fresh)\n".clone_into(&mut difference);
        }
        outcomes.push(if difference.is_empty() {
            Outcome::Same
        } else {
            Outcome::Changed {
                name: block.name.clone(),
                block: Some(block.clone()),
                text,
                difference,
                files: Vec::new(),
            }
        });
    }
    for (part, _) in texts.into_iter().filter(|(part, _)| part != example.name) {
        outcomes.push(Outcome::Failed {
            name: part.clone(),
            error: format!("README.md has no block for {part:?}"),
        });
    }
    outcomes.extend(compare_files(example, made.files, fresh));
    outcomes
}

/// What an example's new files change of those the README shows; with
/// `fresh`, any change.
fn compare_files(example: &Example, made: Vec<(PathBuf, Artifact)>, fresh: bool) -> Vec<Outcome> {
    let name = example.name.to_owned();
    let mut difference = String::new();
    let mut files = Vec::new();
    for (path, artifact) in made {
        let existing = std::fs::read(root().join(&path)).unwrap_or_default();
        match artifact {
            Artifact::Text(new) => {
                let mut changed =
                    normalise::difference(example.check, &String::from_utf8_lossy(&existing), &new);
                if fresh && changed.is_empty() && existing != new.as_bytes() {
                    "  (run-specific values only: --fresh)\n".clone_into(&mut changed);
                }
                if !changed.is_empty() {
                    let _ = writeln!(difference, "{}:\n{changed}", path.display());
                    files.push((path, new.into_bytes()));
                }
            }
            Artifact::Png { png, source } => {
                let old_source = workshop::png_text(&existing, examples::PNG_SOURCE_KEY).unwrap_or_default();
                let mut changed = normalise::difference(example.check, &old_source, &source);
                if fresh && changed.is_empty() {
                    "  (drawn again: --fresh)\n".clone_into(&mut changed);
                }
                if changed.is_empty() {
                    continue;
                }
                match workshop::with_png_text(&png, examples::PNG_SOURCE_KEY, &source) {
                    Ok(tagged) => {
                        let _ = writeln!(difference, "{} (drawn from):\n{changed}", path.display());
                        files.push((path, tagged));
                    }
                    Err(error) => {
                        let error = format!("{}: {error:#}", path.display());
                        return vec![Outcome::Failed { name, error }];
                    }
                }
            }
        }
    }
    if files.is_empty() {
        return Vec::new();
    }
    vec![Outcome::Changed { name, block: None, text: String::new(), difference, files }]
}

fn summarise(outcomes: &[Outcome], check: bool) -> String {
    let mut summary = String::new();
    let same = outcomes.iter().filter(|outcome| matches!(outcome, Outcome::Same)).count();
    let blocks =
        outcomes.iter().filter(|outcome| !matches!(outcome, Outcome::Changed { block: None, .. })).count();
    let _ = writeln!(summary, "{same} of {blocks} blocks as the README has them");
    for outcome in outcomes {
        let _ = match outcome {
            Outcome::Same => Ok(()),
            Outcome::Changed { name, difference, files, .. } => {
                let verb = if check { "would change" } else { "changed" };
                let files: Vec<String> = files.iter().map(|(path, _)| path.display().to_string()).collect();
                let what = if files.is_empty() { String::new() } else { format!(" ({})", files.join(", ")) };
                writeln!(summary, "{name}{what}: {verb}:\n{}", indent(difference))
            }
            Outcome::Unavailable { name, why } => writeln!(summary, "{name}: not made here: {why}"),
            Outcome::Failed { name, error } => writeln!(summary, "{name}: failed: {error}"),
        };
    }
    summary
}

fn indent(text: &str) -> String {
    text.lines().fold(String::new(), |mut indented, line| {
        let _ = writeln!(indented, "    {line}");
        indented
    })
}

/// The workspace-relative path of a file the README shows.
pub fn docs(name: &str) -> PathBuf {
    Path::new("docs").join(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_found_by_their_markers() {
        let readme =
            "# x\n<!-- example: one -->\n```\n$ a\nb\n```\ntext\n<!-- example: two -->\n```json\n{}\n```\n";
        let found = blocks(readme).unwrap();
        assert_eq!(found.len(), 2);
        assert_eq!((found[0].name.as_str(), &readme[found[0].content.clone()]), ("one", "$ a\nb\n"));
        assert_eq!((found[1].name.as_str(), &readme[found[1].content.clone()]), ("two", "{}\n"));
        assert_eq!(found[1].line, 8);
    }

    #[test]
    fn a_marker_needs_its_block() {
        assert!(blocks("<!-- example: one -->\ntext\n").is_err());
        assert!(blocks("<!-- example: one -->\n```\nnever closed\n").is_err());
        assert!(blocks("<!-- example: a -->\n```\n```\n<!-- example: a -->\n```\n```\n").is_err());
    }
}
