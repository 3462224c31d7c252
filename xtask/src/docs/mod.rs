//! `cargo xtask docs`: the manual, an mdBook in docs/, built into
//! target/book with every internal link checked (`book`, `links`); and the
//! example outputs of the book and of the front page, README.md, made
//! again from real runs, so that they cannot go stale.
//!
//! Each generated block is a fenced block right after an HTML comment
//! that names its example, in README.md or in a chapter under docs/src:
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
//! new text; some also make files the book shows (`docs/src/images/`, the
//! serve page's screenshot among them). Adding an example is a function
//! there, a line in `EXAMPLES` and a marker in a chapter.
//!
//! Output is kept real: times, pids, addresses and ports are what the run
//! printed. But a block is only rewritten when it changed in more than
//! what is run-specific (`normalise`): regenerated docs then differ from
//! the last ones only where memleak's output did, not at every pid.
//! `--check` makes the blocks again, writes nothing, and fails naming
//! each example whose output changed, with the lines that did.
//! `cargo xtask test` checks `CHECKED_BY_TEST` so.

mod book;
mod examples;
mod house;
mod links;
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

/// The chapters' Markdown, and the pictures they show.
pub const SOURCE: &str = "docs/src";

/// One example of the docs: its name in the marker, how its blocks are
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

/// A file an example makes for the book to show.
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

/// What `cargo xtask docs` does besides building the book.
pub struct Options {
    /// Make the example outputs again first (as root), and rewrite the
    /// blocks that changed.
    pub examples: bool,
    /// Make the examples again but write nothing; fail naming each one
    /// whose output changed.
    pub check: bool,
    /// Rewrite each block made, even where only run-specific values
    /// changed: a fresh transcript.
    pub fresh: bool,
    /// Only these examples; all when empty.
    pub only: Vec<String>,
}

/// Packages the examples run, besides what the tests install: the
/// docs' real programs.
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

/// The examples `cargo xtask test` makes again and compares with the
/// docs, failing on a difference: those compared exactly, whose frames
/// and bytes are the same in every run, that need no program the tests
/// do not install already, and that report at their end rather than
/// every second; about 30 s in all on 2 cores. The others (the demo's
/// timed counts, reports a second apart, the kernel's and redis's stacks
/// under load, cgroups and containers, pyenv's python, the daemon's
/// scrapes, headless Chromium) are checked by `cargo xtask docs --check`.
pub const CHECKED_BY_TEST: &[&str] = &[
    "execve",
    "forks",
    "mappings",
    "reservations",
    "sessions",
    "sessions-fp",
    "culprit",
    "python",
    "stripped",
    "jit",
    "operators",
    "go-static",
    "flame-graph",
    "pprof",
    "trace",
    "json",
    "stats",
    "privileges",
];

pub fn run(options: &Options) -> Result<()> {
    if options.examples || options.check || options.fresh || !options.only.is_empty() {
        setup::run()?;
        require_root("cargo xtask docs --examples")?;
        install_missing_packages(&PACKAGES, "the docs' examples")?;
        run_command(cargo().args(["build", "--package", "memleak"]))?;
        examples_in_docs(&options.only, options.check, options.fresh)?;
    }
    book::build()
}

/// Makes the examples named in `only` again (all when empty) with the
/// memleak of target/debug, as root, and checks them (`check`) or
/// rewrites the blocks that changed.
pub fn examples_in_docs(only: &[String], check: bool, fresh: bool) -> Result<()> {
    let mut documents = documents()?;
    let mut blocks = Vec::new();
    for (index, document) in documents.iter().enumerate() {
        blocks.extend(blocks_of(index, &document.path, &document.text)?);
    }
    if let Some((first, second)) = repeated(&blocks) {
        bail!(
            "{}: a second block for example {:?} (the first is in {})",
            located(&documents, second),
            second.name,
            located(&documents, first)
        );
    }
    let chosen = chosen(&blocks, only)?;
    let mut workshop = Workshop::new(&root().join("target/debug/memleak"))?;
    // A marker no example answers fails on its own; the others run.
    let mut outcomes: Vec<Outcome> = unknown(&blocks)
        .into_iter()
        .map(|block| Outcome::Failed {
            name: block.name.clone(),
            error: format!(
                "{}: no example called {:?} (see xtask/src/docs/examples.rs)",
                located(&documents, block),
                example_of(&block.name)
            ),
        })
        .collect();
    for example in examples::EXAMPLES.iter().filter(|example| chosen.contains(example.name)) {
        eprintln!("docs: example {}", example.name);
        let made = workshop.make(example);
        outcomes.extend(compare(example, &blocks, &documents, made, fresh));
    }
    let summary = summarise(&outcomes, check);
    print!("{summary}");
    if check {
        if outcomes.iter().any(|outcome| !matches!(outcome, Outcome::Same | Outcome::Unavailable { .. })) {
            bail!("the docs' examples are not what memleak prints now: run `sudo -E cargo xtask docs --examples`");
        }
        return Ok(());
    }
    write_changes(&mut documents, &outcomes)?;
    if outcomes.iter().any(|outcome| matches!(outcome, Outcome::Failed { .. })) {
        bail!("some examples failed: their blocks are left as they were");
    }
    Ok(())
}

/// Writes the blocks and files that `outcomes` changed.
fn write_changes(documents: &mut [Document], outcomes: &[Outcome]) -> Result<()> {
    let mut changed: Vec<(&Block, &String)> = outcomes
        .iter()
        .filter_map(|outcome| match outcome {
            Outcome::Changed { block: Some(block), text, .. } => Some((block, text)),
            _ => None,
        })
        .collect();
    // From the end, so that earlier blocks' offsets stay right.
    changed.sort_by_key(|(block, _)| std::cmp::Reverse((block.document, block.content.start)));
    for (block, text) in changed {
        documents[block.document].text.replace_range(block.content.clone(), text);
    }
    for document in documents.iter() {
        if document.text != document.original {
            std::fs::write(root().join(&document.path), &document.text)
                .with_context(|| format!("cannot write {}", document.path.display()))?;
        }
    }
    for outcome in outcomes {
        if let Outcome::Changed { files, .. } = outcome {
            for (path, bytes) in files {
                std::fs::write(root().join(path), bytes)
                    .with_context(|| format!("cannot write {}", path.display()))?;
            }
        }
    }
    Ok(())
}

/// A file that holds example blocks.
struct Document {
    /// Relative to the workspace root.
    path: PathBuf,
    original: String,
    text: String,
}

/// The front page and the book's chapters, the files whose blocks the
/// examples fill.
fn documents() -> Result<Vec<Document>> {
    let mut paths = vec![PathBuf::from("README.md")];
    let chapters = root().join(SOURCE);
    let mut found: Vec<PathBuf> = std::fs::read_dir(&chapters)
        .with_context(|| format!("cannot list {}", chapters.display()))?
        .map(|entry| entry.map(|entry| entry.path()))
        .collect::<Result<_, _>>()?;
    found.retain(|path| path.extension().is_some_and(|extension| extension == "md"));
    found.sort();
    paths.extend(found.into_iter().map(|path| Path::new(SOURCE).join(path.file_name().unwrap_or_default())));
    paths
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(root().join(&path))
                .with_context(|| format!("cannot read {}", path.display()))?;
            Ok(Document { path, original: text.clone(), text })
        })
        .collect()
}

/// Where a block's marker is: `docs/src/outputs.md line 12`.
fn located(documents: &[Document], block: &Block) -> String {
    format!("{} line {}", documents[block.document].path.display(), block.line)
}

/// Two blocks of one name, if there are: each example part is shown once.
fn repeated(blocks: &[Block]) -> Option<(&Block, &Block)> {
    blocks.iter().enumerate().find_map(|(index, second)| {
        blocks[..index].iter().find(|first| first.name == second.name).map(|first| (first, second))
    })
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

/// The examples to run: those asked for, else every one the docs mark.
/// An example asked for that there is not, or that no document marks, is
/// an error.
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
            bail!("no document has a `<!-- example: {} -->` block", example.name);
        }
    }
    Ok(chosen)
}

/// A generated block of a document.
#[derive(Clone, Debug)]
struct Block {
    name: String,
    /// Its document, an index into `documents()`.
    document: usize,
    /// The line of its marker, from 1.
    line: usize,
    /// Byte range of its contents, between the fences' lines.
    content: std::ops::Range<usize>,
}

const MARKER_START: &str = "<!-- example: ";
const MARKER_END: &str = " -->";

/// Every marked block of `text`, document number `document` at `path`:
/// a marker line, then at once an opening fence; the block runs to the
/// next fence line.
fn blocks_of(document: usize, path: &Path, text: &str) -> Result<Vec<Block>> {
    let path = path.display();
    let mut blocks: Vec<Block> = Vec::new();
    let mut offset = 0;
    let mut lines = text.split_inclusive('\n').enumerate().peekable();
    while let Some((index, line)) = lines.next() {
        offset += line.len();
        let Some(name) =
            line.trim_end().strip_prefix(MARKER_START).and_then(|rest| rest.strip_suffix(MARKER_END))
        else {
            continue;
        };
        let marker_line = index + 1;
        let Some((_, fence)) = lines.next().filter(|(_, fence)| fence.starts_with("```")) else {
            bail!("{path} line {marker_line}: the example marker must be followed by a ``` line");
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
        let Some(end) = end else { bail!("{path} line {marker_line}: the block of {name:?} is not closed") };
        blocks.push(Block { name: name.to_owned(), document, line: marker_line, content: start..end });
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

/// What `made` changes of the blocks of `example` in `documents`, and of the
/// files it shows.
fn compare(
    example: &Example,
    blocks: &[Block],
    documents: &[Document],
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
        let old = &documents[block.document].text[block.content.clone()];
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
            error: format!("no document has a block for {part:?}"),
        });
    }
    outcomes.extend(compare_files(example, made.files, fresh));
    outcomes
}

/// What an example's new files change of those the docs show; with
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
    let _ = writeln!(summary, "{same} of {blocks} blocks as the docs have them");
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

/// The workspace-relative path of a picture the book shows.
pub fn image(name: &str) -> PathBuf {
    Path::new(SOURCE).join("images").join(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_found_by_their_markers() {
        let text =
            "# x\n<!-- example: one -->\n```\n$ a\nb\n```\ntext\n<!-- example: two -->\n```json\n{}\n```\n";
        let found = blocks_of(3, Path::new("docs/src/x.md"), text).unwrap();
        assert_eq!(found.len(), 2);
        assert_eq!((found[0].name.as_str(), &text[found[0].content.clone()]), ("one", "$ a\nb\n"));
        assert_eq!((found[1].name.as_str(), &text[found[1].content.clone()]), ("two", "{}\n"));
        assert_eq!((found[1].document, found[1].line), (3, 8));
    }

    #[test]
    fn a_marker_needs_its_block() {
        let path = Path::new("README.md");
        assert!(blocks_of(0, path, "<!-- example: one -->\ntext\n").is_err());
        assert!(blocks_of(0, path, "<!-- example: one -->\n```\nnever closed\n").is_err());
    }

    #[test]
    fn each_block_is_shown_once_in_all_the_documents() {
        let mut blocks = blocks_of(0, Path::new("README.md"), "<!-- example: a -->\n```\n```\n").unwrap();
        blocks.extend(blocks_of(1, Path::new("docs/src/b.md"), "<!-- example: b -->\n```\n```\n").unwrap());
        assert!(repeated(&blocks).is_none());
        blocks.extend(blocks_of(2, Path::new("docs/src/c.md"), "<!-- example: a -->\n```\n```\n").unwrap());
        let (first, second) = repeated(&blocks).expect("the second `a` found");
        assert_eq!((first.document, second.document), (0, 2));
    }
}
