//! The house rules the architecture chapter states, checked: every
//! folder of the crates' sources opens with a comment that says what it
//! holds, and the chapter names every folder of memleak/src.

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use crate::root;

    /// The folders below `source` (a path from the workspace root), each
    /// with the file that opens it: its mod.rs, or the module file beside
    /// it (`report/saved.rs` for `report/saved/`).
    fn folders(source: &str) -> Vec<(PathBuf, PathBuf)> {
        let mut found = Vec::new();
        let mut pending = vec![root().join(source)];
        while let Some(directory) = pending.pop() {
            for entry in std::fs::read_dir(&directory).expect("a source folder") {
                let path = entry.expect("an entry").path();
                if path.is_dir() {
                    let inside = path.join("mod.rs");
                    let opening = if inside.exists() { inside } else { path.with_extension("rs") };
                    found.push((path.clone(), opening));
                    pending.push(path);
                }
            }
        }
        found.sort();
        found
    }

    #[test]
    fn every_folder_opens_with_a_comment_that_says_what_it_holds() {
        let mut bare = Vec::new();
        for source in ["memleak/src", "memleak-ebpf/src", "xtask/src"] {
            for (folder, opening) in folders(source) {
                let text = std::fs::read_to_string(&opening).unwrap_or_default();
                if !text.starts_with("//!") {
                    bare.push(format!("{} ({})", folder.display(), opening.display()));
                }
            }
        }
        assert!(bare.is_empty(), "folders whose module file does not open with a //! comment: {bare:#?}");
    }

    #[test]
    fn the_architecture_chapter_names_every_folder_of_memleak() {
        let chapter = std::fs::read_to_string(root().join("docs/src/architecture.md")).expect("the chapter");
        let source = root().join("memleak/src");
        let missing: Vec<String> = folders("memleak/src")
            .into_iter()
            .filter_map(|(folder, _)| {
                let name = folder.strip_prefix(&source).ok()?.display().to_string();
                // A folder of a module's own files (`report/saved/`) is its
                // module's; the top-level ones are the stages.
                (Path::new(&name).components().count() == 1 && !chapter.contains(&format!("`{name}/`")))
                    .then_some(name)
            })
            .collect();
        assert!(
            missing.is_empty(),
            "docs/src/architecture.md does not name memleak/src's folders {missing:?}"
        );
    }
}
