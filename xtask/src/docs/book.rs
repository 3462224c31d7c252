//! The book: mdbook, pinned and installed from the crates registry under
//! target/tools the first time, builds docs/ into target/book; then
//! `links` checks every link of it and of the front page.

use std::{path::PathBuf, process::Command};

use anyhow::{bail, Context as _, Result};

use super::{links, SOURCE};
use crate::{cargo, root, run};

/// The book's root, which holds book.toml.
const BOOK: &str = "docs";
/// Where mdbook writes the book (docs/book.toml's `build-dir`).
const OUTPUT: &str = "target/book";
/// The front page, which links into the book's sources.
const FRONT_PAGE: &str = "README.md";

/// Pinned, and installed `--locked`, so that every machine builds the
/// book with the same mdbook and the same dependencies.
const MDBOOK_VERSION: &str = "0.5.4";

/// Builds the book into target/book and checks its links and the front
/// page's: fails naming each broken one; lists the external ones, which
/// are not fetched.
pub fn build() -> Result<()> {
    let mdbook = install_mdbook()?;
    let output = root().join(OUTPUT);
    // A page left by an earlier build, of a chapter removed since, would
    // answer a link to that chapter.
    if output.exists() {
        std::fs::remove_dir_all(&output).with_context(|| format!("cannot empty {}", output.display()))?;
    }
    run(Command::new(&mdbook).arg("build").arg(root().join(BOOK)))?;
    let site = links::Site::read(&output)?;
    let mut findings = links::check_book(&site, &chapters()?);
    let front_page = std::fs::read_to_string(root().join(FRONT_PAGE))
        .with_context(|| format!("cannot read {FRONT_PAGE}"))?;
    findings.add(links::check_front_page(FRONT_PAGE, &front_page, &site, &|path| root().join(path).exists()));
    print!("{}", findings.summary());
    if !findings.broken.is_empty() {
        bail!("{} broken links in the docs", findings.broken.len());
    }
    eprintln!("docs: the book is in {}", output.join("index.html").display());
    Ok(())
}

/// Each chapter's Markdown, as a path below docs/src: every `.md` file
/// there but SUMMARY.md, which lists them.
fn chapters() -> Result<Vec<PathBuf>> {
    let source = root().join(SOURCE);
    let mut chapters = Vec::new();
    for entry in std::fs::read_dir(&source).with_context(|| format!("cannot list {}", source.display()))? {
        let path = entry?.path();
        let Some(name) = path.file_name() else { continue };
        if path.extension().is_some_and(|extension| extension == "md") && name != "SUMMARY.md" {
            chapters.push(PathBuf::from(name));
        }
    }
    chapters.sort();
    Ok(chapters)
}

/// target/tools/mdbook-VERSION/bin/mdbook, installed there unless it is.
/// A debug build: from a clean `CARGO_HOME` it took 67 s here against
/// 264 s for a release build, and it builds this book in under a second
/// all the same.
fn install_mdbook() -> Result<PathBuf> {
    let tools = root().join(format!("target/tools/mdbook-{MDBOOK_VERSION}"));
    let binary = tools.join("bin/mdbook");
    if binary.exists() {
        return Ok(binary);
    }
    eprintln!("xtask: installing mdbook {MDBOOK_VERSION} in {}", tools.display());
    run(cargo()
        .args(["install", "mdbook", "--locked", "--debug", "--version", MDBOOK_VERSION])
        // Without `mdbook serve` and `watch`, which pull in a web server
        // and a file watcher that nothing here uses.
        .args(["--no-default-features", "--features", "search", "--root"])
        .arg(&tools)
        .env("CARGO_TARGET_DIR", root().join("target/tools/mdbook-build")))?;
    Ok(binary)
}
