//! The docs' links, checked where readers follow them. In the book, in
//! the pages mdbook made: every `href` and `src` of a chapter's page must
//! name a file of the book and, with a `#fragment`, an element of that
//! page with that id (mdbook gives one to each heading); a link that
//! leaves the book is broken too, as it would be once the book is put
//! online. On the front page, README.md, in its Markdown: its links lead
//! to files of the repository, the book's chapters among them, whose
//! headings are the ids of their pages.
//!
//! mdbook itself checks none of this. External links (http, https) are
//! listed, not fetched: CI runs offline.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    path::{Component, Path, PathBuf},
    sync::LazyLock,
};

use anyhow::{Context as _, Result};
use regex::Regex;

use super::SOURCE;

/// The page mdbook makes of `chapter`, a path below docs/src.
fn page_of(chapter: &Path) -> PathBuf {
    chapter.with_extension("html")
}

/// A built book: its files, and the text of its HTML pages.
#[derive(Default)]
pub struct Site {
    /// Every file, as a path below the book's root.
    files: BTreeSet<PathBuf>,
    /// The ids of each HTML page's elements.
    ids: BTreeMap<PathBuf, BTreeSet<String>>,
    /// Each HTML page's text.
    pages: BTreeMap<PathBuf, String>,
}

impl Site {
    /// The book mdbook wrote into `root`.
    pub fn read(root: &Path) -> Result<Self> {
        let mut files = Vec::new();
        let mut pending = vec![root.to_path_buf()];
        while let Some(directory) = pending.pop() {
            for entry in std::fs::read_dir(&directory)
                .with_context(|| format!("cannot list {}", directory.display()))?
            {
                let entry = entry?;
                if entry.file_type()?.is_dir() {
                    pending.push(entry.path());
                } else {
                    files.push(entry.path());
                }
            }
        }
        let mut site = Self::default();
        for path in files {
            let relative = path.strip_prefix(root).context("a file of the book")?.to_path_buf();
            if relative.extension().is_some_and(|extension| extension == "html") {
                let html = std::fs::read_to_string(&path)
                    .with_context(|| format!("cannot read {}", path.display()))?;
                site.add_page(relative, html);
            } else {
                site.files.insert(relative);
            }
        }
        Ok(site)
    }

    fn add_page(&mut self, path: PathBuf, html: String) {
        self.ids.insert(path.clone(), ids(&html));
        self.files.insert(path.clone());
        self.pages.insert(path, html);
    }
}

/// What a check found.
#[derive(Default, Debug)]
pub struct Findings {
    /// One line each: where, the link, and what is wrong.
    pub broken: Vec<String>,
    /// External links, and the first place each was seen.
    pub external: BTreeMap<String, String>,
    /// Internal links checked.
    pub checked: usize,
}

impl Findings {
    pub fn add(&mut self, other: Self) {
        self.broken.extend(other.broken);
        for (link, place) in other.external {
            self.external.entry(link).or_insert(place);
        }
        self.checked += other.checked;
    }

    pub fn summary(&self) -> String {
        let mut summary = String::new();
        let _ = writeln!(
            summary,
            "docs: {} internal links checked, {} broken; {} external links, not fetched:",
            self.checked,
            self.broken.len(),
            self.external.len()
        );
        for (link, place) in &self.external {
            let _ = writeln!(summary, "    {link} ({place})");
        }
        for broken in &self.broken {
            let _ = writeln!(summary, "broken: {broken}");
        }
        summary
    }

    /// Notes `link`, seen at `place`, pointing at `target` in `site`
    /// (a path below its root, and a fragment), as checked or broken.
    fn check_target(&mut self, site: &Site, place: &str, link: &str, target: &Path, fragment: Option<&str>) {
        self.checked += 1;
        if !site.files.contains(target) {
            self.broken.push(format!("{place}: {link}: no such file in the book ({})", target.display()));
            return;
        }
        let Some(fragment) = fragment.filter(|fragment| !fragment.is_empty()) else { return };
        match site.ids.get(target) {
            Some(ids) if ids.contains(fragment) => {}
            Some(_) => self.broken.push(format!(
                "{place}: {link}: {} has no heading or element with id {fragment:?}",
                target.display()
            )),
            None => self.broken.push(format!("{place}: {link}: a #fragment on a file that is no page")),
        }
    }
}

/// Checks the links of each chapter's page. `chapters` are the chapters'
/// Markdown files, as paths below docs/src; a chapter without a page is
/// one SUMMARY.md does not list, which no reader reaches.
pub fn check_book(site: &Site, chapters: &[PathBuf]) -> Findings {
    let mut findings = Findings::default();
    for chapter in chapters {
        let place = Path::new(SOURCE).join(chapter).display().to_string();
        let page = page_of(chapter);
        let Some(html) = site.pages.get(&page) else {
            findings.broken.push(format!("{place}: not in docs/src/SUMMARY.md, so in no page of the book"));
            continue;
        };
        for link in links_of_page(html) {
            if let Some(external) = external(&link) {
                findings.external.entry(external).or_insert_with(|| place.clone());
                continue;
            }
            if ignored(&link) {
                continue;
            }
            let (path, fragment) = split(&link);
            let base = page.parent().unwrap_or_else(|| Path::new(""));
            let target = if path.is_empty() { Some(page.clone()) } else { resolve(base, path) };
            if let Some(target) = target {
                findings.check_target(site, &place, &link, &target, fragment);
            } else {
                findings.checked += 1;
                findings.broken.push(format!("{place}: {link}: leads out of the book"));
            }
        }
    }
    findings
}

/// Checks the Markdown links of the front page, `path` (relative to the
/// repository's root, as `text` names files): each must lead to a file
/// that `exists`, and one into docs/src with a fragment to a heading of
/// that chapter's page in `site`.
pub fn check_front_page(path: &str, text: &str, site: &Site, exists: &dyn Fn(&Path) -> bool) -> Findings {
    let mut findings = Findings::default();
    for (line, link) in markdown_links(text) {
        let place = format!("{path} line {line}");
        if let Some(external) = external(&link) {
            findings.external.entry(external).or_insert(place);
            continue;
        }
        if ignored(&link) {
            continue;
        }
        let (target, fragment) = split(&link);
        let base = Path::new(path).parent().unwrap_or_else(|| Path::new(""));
        let Some(target) =
            (if target.is_empty() { Some(PathBuf::from(path)) } else { resolve(base, target) })
        else {
            findings.checked += 1;
            findings.broken.push(format!("{place}: {link}: leads out of the repository"));
            continue;
        };
        match target.strip_prefix(SOURCE) {
            Ok(chapter) if chapter.extension().is_some_and(|extension| extension == "md") => {
                findings.check_target(site, &place, &link, &page_of(chapter), fragment);
            }
            _ => {
                findings.checked += 1;
                if !exists(&target) {
                    findings.broken.push(format!("{place}: {link}: no such file"));
                } else if fragment.is_some_and(|fragment| !fragment.is_empty()) {
                    findings.broken.push(format!("{place}: {link}: a #fragment on a file outside the book"));
                }
            }
        }
    }
    findings
}

/// The link as it would be fetched, if it leaves this site.
fn external(link: &str) -> Option<String> {
    let lower = link.to_ascii_lowercase();
    (lower.starts_with("http://") || lower.starts_with("https://") || lower.starts_with("//"))
        .then(|| link.to_owned())
}

/// Links that name no file: mail, scripts, inline data.
fn ignored(link: &str) -> bool {
    let lower = link.to_ascii_lowercase();
    ["mailto:", "javascript:", "data:", "tel:"].iter().any(|scheme| lower.starts_with(scheme))
}

/// A link's path and fragment, its query left out.
fn split(link: &str) -> (&str, Option<&str>) {
    let (path, fragment) = match link.split_once('#') {
        Some((path, fragment)) => (path, Some(fragment)),
        None => (link, None),
    };
    (path.split_once('?').map_or(path, |(path, _)| path), fragment)
}

/// `target` read from a file in `base`, as a path below the root; None
/// when it climbs above the root, or is absolute.
fn resolve(base: &Path, target: &str) -> Option<PathBuf> {
    let mut resolved = PathBuf::new();
    for component in base.join(target).components() {
        match component {
            Component::Normal(part) => resolved.push(part),
            Component::CurDir => {}
            Component::ParentDir => {
                if !resolved.pop() {
                    return None;
                }
            }
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    // A link to a directory is to its index page.
    if target.ends_with('/') || target.is_empty() {
        resolved.push("index.html");
    }
    Some(resolved)
}

static ID: LazyLock<Regex> = LazyLock::new(|| Regex::new(r#"\sid="([^"]*)""#).expect("a valid pattern"));
static LINK: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r#"\s(?:href|src)="([^"]*)""#).expect("a valid pattern"));

/// The ids of `html`'s elements.
fn ids(html: &str) -> BTreeSet<String> {
    ID.captures_iter(html).map(|capture| unescape(&capture[1])).collect()
}

/// The targets of `html`'s links, pictures, scripts and styles. Text in
/// a page has its quotes escaped, so only attributes match.
fn links_of_page(html: &str) -> Vec<String> {
    LINK.captures_iter(html).map(|capture| unescape(&capture[1])).collect()
}

fn unescape(attribute: &str) -> String {
    attribute
        .replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&amp;", "&")
}

static MARKDOWN_LINK: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r#"\]\(<?([^)\s>]+)>?(?:\s+"[^"]*")?\)"#).expect("a valid pattern"));

/// The inline links and pictures of Markdown `text`, with their lines,
/// outside fenced code blocks and code spans.
fn markdown_links(text: &str) -> Vec<(usize, String)> {
    let mut links = Vec::new();
    let mut fenced = false;
    for (index, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let outside_code: String =
            line.split('`').enumerate().filter(|(part, _)| part % 2 == 0).map(|(_, text)| text).collect();
        for capture in MARKDOWN_LINK.captures_iter(&outside_code) {
            links.push((index + 1, capture[1].to_owned()));
        }
    }
    links
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A book of two chapters, as mdbook lays it out.
    fn site() -> Site {
        let mut site = Site::default();
        site.add_page(
            "tracing.html".into(),
            r##"<link rel="stylesheet" href="css/general.css">
<h1 id="tracing-a-process"><a class="header" href="#tracing-a-process">Tracing a process</a></h1>
<p>See <a href="stacks.html#the-culprit">The culprit</a> and <a href="https://example.org/x">x</a>.</p>
<img src="images/flamegraph.svg" alt="a flame graph">
<pre><code>href=&quot;nowhere.html&quot;</code></pre>"##
                .to_owned(),
        );
        site.add_page(
            "stacks.html".into(),
            r##"<h2 id="the-culprit"><a class="header" href="#the-culprit">The culprit</a></h2>"##.to_owned(),
        );
        site.files.insert("css/general.css".into());
        site.files.insert("images/flamegraph.svg".into());
        site
    }

    fn chapters() -> Vec<PathBuf> {
        vec!["stacks.md".into(), "tracing.md".into()]
    }

    #[test]
    fn a_whole_book_passes_and_lists_its_external_links() {
        let findings = check_book(&site(), &chapters());
        assert_eq!(findings.broken, Vec::<String>::new());
        assert_eq!(findings.checked, 5, "css, the chapter link, the image and the two headings' own links");
        assert_eq!(findings.external.keys().collect::<Vec<_>>(), ["https://example.org/x"]);
    }

    #[test]
    fn a_missing_page_anchor_or_picture_is_broken() {
        for (link, what) in [
            (r#"<a href="overhead.html">"#, "no such file in the book (overhead.html)"),
            (
                r#"<a href="stacks.html#the-culprits">"#,
                "stacks.html has no heading or element with id \"the-culprits\"",
            ),
            (r##"<a href="#nowhere">"##, "tracing.html has no heading or element with id \"nowhere\""),
            (r#"<img src="images/serve-page.png">"#, "no such file in the book (images/serve-page.png)"),
            (r#"<a href="../README.md">"#, "leads out of the book"),
        ] {
            let mut site = site();
            site.add_page("tracing.html".into(), format!(r#"<h1 id="t">T</h1>{link}"#));
            let findings = check_book(&site, &chapters());
            assert_eq!(findings.broken.len(), 1, "{link}: {:?}", findings.broken);
            assert!(findings.broken[0].starts_with("docs/src/tracing.md: "), "{}", findings.broken[0]);
            assert!(findings.broken[0].ends_with(what), "{link}: {}", findings.broken[0]);
        }
    }

    #[test]
    fn a_chapter_summary_does_not_list_is_broken() {
        let mut chapters = chapters();
        chapters.push("orphan.md".into());
        let findings = check_book(&site(), &chapters);
        assert_eq!(
            findings.broken,
            ["docs/src/orphan.md: not in docs/src/SUMMARY.md, so in no page of the book"]
        );
    }

    #[test]
    fn the_front_page_links_into_the_chapters_headings() {
        let readme = "# memleak\n\
            See [the culprit](docs/src/stacks.md#the-culprit), [tracing](docs/src/tracing.md),\n\
            [a missing heading](docs/src/stacks.md#culprit) and [a file](contrib/prometheus.yml).\n\
            ```\n[not a link](nowhere.md)\n```\n\
            `[nor this](nowhere.md)` but [this](nowhere.md) and [that](https://example.org).\n";
        let exists = |path: &Path| path == Path::new("contrib/prometheus.yml");
        let findings = check_front_page("README.md", readme, &site(), &exists);
        assert_eq!(findings.checked, 5);
        assert_eq!(
            findings.broken,
            [
                "README.md line 3: docs/src/stacks.md#culprit: stacks.html has no heading or element with id \"culprit\"",
                "README.md line 7: nowhere.md: no such file",
            ]
        );
        assert_eq!(findings.external.keys().collect::<Vec<_>>(), ["https://example.org"]);
    }

    #[test]
    fn paths_resolve_below_the_root_only() {
        assert_eq!(resolve(Path::new("a"), "../b/c.html"), Some(PathBuf::from("b/c.html")));
        assert_eq!(resolve(Path::new(""), "./"), Some(PathBuf::from("index.html")));
        assert_eq!(resolve(Path::new("a"), "../../x"), None);
        assert_eq!(resolve(Path::new(""), "/etc/passwd"), None);
        assert_eq!(split("a.html?x=1#y"), ("a.html", Some("y")));
    }
}
