//! The dynamic linker's link-map order, which decides whose malloc a
//! program calls: the binary, then `LD_PRELOAD` objects, then the binary's
//! `DT_NEEDED` libraries in order, then the rest.

/// Orders mapped files as the dynamic linker's link map has them: the
/// binary (mapped first), the `LD_PRELOAD` objects, the binary's `DT_NEEDED`
/// libraries in order, then everything else as mapped.
pub fn link_order<'a>(mapped: &[&'a str], preloads: &[String], needed: &[String]) -> Vec<&'a str> {
    let rank = |index: usize, file: &str| -> usize {
        let preload = preloads.iter().position(|preload| same_library(file, preload));
        let dependency = needed.iter().position(|name| same_library(file, name));
        match (index, preload, dependency) {
            (0, _, _) => 0,
            (_, Some(position), _) => 1 + position,
            (_, None, Some(position)) => 1_000 + position,
            _ => 1_000_000 + index,
        }
    };
    let mut ranked: Vec<(usize, &str)> =
        mapped.iter().enumerate().map(|(i, file)| (rank(i, file), *file)).collect();
    ranked.sort_by_key(|(rank, _)| *rank);
    ranked.into_iter().map(|(_, file)| file).collect()
}

/// Whether mapped `file` is the library `name` (a path or a soname): the
/// file is often the soname's symlink target, libfoo.so.4 -> libfoo.so.4.5.10.
fn same_library(file: &str, name: &str) -> bool {
    let base = |path: &'_ str| path.rsplit('/').next().unwrap_or(path).to_owned();
    let (file, name) = (base(file), base(name));
    file == name || file.strip_prefix(&name).is_some_and(|rest| rest.starts_with('.'))
}

/// The `LD_PRELOAD` entries of a NUL-separated environment block.
pub fn preloads(environ: &[u8]) -> Vec<String> {
    environ
        .split(|&byte| byte == 0)
        .filter_map(|entry| entry.strip_prefix(b"LD_PRELOAD="))
        .flat_map(|value| {
            String::from_utf8_lossy(value).split([':', ' ']).map(str::to_owned).collect::<Vec<_>>()
        })
        .filter(|entry| !entry.is_empty())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_order_puts_the_binary_then_preloads_then_needed_libraries_first() {
        let mapped =
            ["/app/redis", "/lib/ld.so", "/lib/libc.so.6", "/lib/libm.so.6", "/opt/libjemalloc.so.2"];
        let needed = ["libjemalloc.so.2".to_owned(), "libm.so.6".to_owned(), "libc.so.6".to_owned()];
        assert_eq!(
            link_order(&mapped, &[], &needed),
            ["/app/redis", "/opt/libjemalloc.so.2", "/lib/libm.so.6", "/lib/libc.so.6", "/lib/ld.so"]
        );
        let preloads = ["/opt/libtcmalloc.so".to_owned()];
        let mapped = ["/app/a", "/lib/libc.so.6", "/opt/libtcmalloc.so"];
        assert_eq!(
            link_order(&mapped, &preloads, &["libc.so.6".to_owned()]),
            ["/app/a", "/opt/libtcmalloc.so", "/lib/libc.so.6"]
        );
    }

    #[test]
    fn preloads_are_read_from_the_environment() {
        let environ = b"HOME=/root\0LD_PRELOAD=/a.so:/b.so c.so\0PATH=/bin\0";
        assert_eq!(preloads(environ), ["/a.so", "/b.so", "c.so"]);
    }
}
