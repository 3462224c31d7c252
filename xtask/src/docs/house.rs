//! The house rules the architecture chapter states, checked: every
//! folder of the crates' sources opens with a comment that says what it
//! holds, the chapter names every folder of memleak/src, and no file
//! imports another that imports it back.

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

    /// A source file's module path from its crate's root: `serve::http`
    /// for serve/http.rs, `serve` for serve/mod.rs.
    fn module_of(file: &Path, source: &Path) -> Vec<String> {
        let relative = file.strip_prefix(source).expect("a file of the crate").with_extension("");
        let mut path: Vec<String> =
            relative.components().map(|part| part.as_os_str().to_string_lossy().into_owned()).collect();
        if matches!(path.last().map(String::as_str), Some("mod" | "main" | "lib")) {
            path.pop();
        }
        path
    }

    /// Every `.rs` file below `source`.
    fn files(source: &Path) -> Vec<PathBuf> {
        let mut found = Vec::new();
        let mut pending = vec![source.to_path_buf()];
        while let Some(directory) = pending.pop() {
            for entry in std::fs::read_dir(&directory).expect("a source folder") {
                let path = entry.expect("an entry").path();
                if path.is_dir() {
                    pending.push(path);
                } else if path.extension().is_some_and(|extension| extension == "rs") {
                    found.push(path);
                }
            }
        }
        found
    }

    /// The paths `text` names through `crate::` and `super::`, with every
    /// `use` tree's branches spelled out, as module paths from the crate's
    /// root (`module`: the file's own). Code in `#[cfg(test)]` modules is
    /// left out: a test may use what it likes.
    fn paths_named(text: &str, module: &[String]) -> Vec<Vec<String>> {
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        let tokens: Vec<&str> = tokenize(code);
        let mut named = Vec::new();
        let mut index = 0;
        while index < tokens.len() {
            let start = match tokens[index] {
                "crate" => Some(Vec::new()),
                // super from a file's own module (mod.rs: its folder).
                "super" => Some(module[..module.len().saturating_sub(1)].to_vec()),
                _ => None,
            };
            if let (Some(prefix), Some(&"::")) = (start, tokens.get(index + 1)) {
                index = expand(&tokens, index + 2, prefix, &mut named);
            } else {
                index += 1;
            }
        }
        named
    }

    /// Identifiers, `::` and the punctuation of `use` trees.
    fn tokenize(code: &str) -> Vec<&str> {
        let mut tokens = Vec::new();
        let mut rest = code;
        while let Some(first) = rest.chars().next() {
            if rest.starts_with("//") {
                rest = rest.find('\n').map_or("", |end| &rest[end..]);
            } else if rest.starts_with("::") {
                tokens.push("::");
                rest = &rest[2..];
            } else if first.is_alphanumeric() || first == '_' {
                let end = rest.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(rest.len());
                tokens.push(&rest[..end]);
                rest = &rest[end..];
            } else {
                if "{},;".contains(first) {
                    tokens.push(&rest[..1]);
                }
                rest = &rest[first.len_utf8()..];
            }
        }
        tokens
    }

    /// Reads the path or `use` tree at `tokens[index]` below `prefix` into
    /// `named`; returns where it ends.
    fn expand(
        tokens: &[&str],
        mut index: usize,
        mut prefix: Vec<String>,
        named: &mut Vec<Vec<String>>,
    ) -> usize {
        loop {
            match tokens.get(index) {
                Some(&"{") => {
                    index += 1;
                    while let Some(&token) = tokens.get(index) {
                        if token == "}" {
                            return index + 1;
                        }
                        if token == "," {
                            index += 1;
                            continue;
                        }
                        index = expand(tokens, index, prefix.clone(), named);
                    }
                    return index;
                }
                Some(&"self") => {
                    named.push(prefix);
                    return index + 1;
                }
                Some(token) if token.chars().next().is_some_and(|c| c.is_alphanumeric() || c == '_') => {
                    prefix.push((*token).to_owned());
                    if tokens.get(index + 1) == Some(&"::") {
                        index += 2;
                    } else {
                        named.push(prefix);
                        return index + 1;
                    }
                }
                _ => {
                    named.push(prefix);
                    return index;
                }
            }
        }
    }

    #[test]
    fn no_file_imports_another_that_imports_it_back() {
        let mut cycles = Vec::new();
        for crate_source in ["memleak/src", "memleak-ebpf/src", "memleak-common/src", "xtask/src"] {
            let source = root().join(crate_source);
            let modules: Vec<(Vec<String>, PathBuf)> =
                files(&source).into_iter().map(|file| (module_of(&file, &source), file)).collect();
            // A path names the longest module it starts with.
            let file_of = |path: &[String]| {
                modules
                    .iter()
                    .filter(|(module, _)| !module.is_empty() && path.starts_with(module))
                    .max_by_key(|(module, _)| module.len())
                    .map(|(_, file)| file.clone())
            };
            let mut imports: std::collections::BTreeMap<PathBuf, std::collections::BTreeSet<PathBuf>> =
                std::collections::BTreeMap::new();
            for (module, file) in &modules {
                let text = std::fs::read_to_string(file).expect("a source file");
                let used = paths_named(&text, module).into_iter().filter_map(|path| file_of(&path));
                imports.entry(file.clone()).or_default().extend(used.filter(|used| used != file));
            }
            for (file, used) in &imports {
                for other in used.iter().filter(|other| *other > file) {
                    if imports.get(other).is_some_and(|back| back.contains(file)) {
                        let name =
                            |path: &PathBuf| path.strip_prefix(root()).unwrap_or(path).display().to_string();
                        cycles.push(format!("{} <-> {}", name(file), name(other)));
                    }
                }
            }
        }
        assert!(cycles.is_empty(), "files that import each other: {cycles:#?}");
    }

    #[test]
    fn a_use_tree_names_each_of_its_branches() {
        let named = paths_named(
            "use crate::{\n    maps::{A, B},\n    tunables, // c::d\n};\nfn f() { super::x::y(); }",
            &["unwind".to_owned(), "reuse".to_owned()],
        );
        let joined: Vec<String> = named.iter().map(|path| path.join("::")).collect();
        assert_eq!(joined, ["maps::A", "maps::B", "tunables", "unwind::x::y"]);
    }
}
