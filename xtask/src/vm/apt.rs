//! A private apt configuration for Debian's kernel packages, under
//! target/vm/apt/: its own sources list, package lists, cache and
//! preferences, and no dpkg status, so `apt-get download` can fetch any
//! Debian kernel (bullseye's 5.10 to trixie-backports' newest) on any host
//! without touching the machine's own apt sources or installing anything.
//! Also Debian's version ordering, to pick the newest of several packages.

use std::{
    cmp::Ordering,
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, SystemTime},
};

use anyhow::{bail, Context as _, Result};

use super::{Arch, Verbosity};

/// The suites whose kernels can be had from Debian's registry here:
/// bullseye's 5.10, bookworm's 6.1, bookworm-backports' and trixie's
/// 6.12, trixie-backports' 6.16 and later. There is no bullseye-backports
/// nor any archive host to fetch older or other distributions' kernels.
const SUITES: [(&str, &str); 8] = [
    ("http://deb.debian.org/debian", "bullseye"),
    ("http://deb.debian.org/debian-security", "bullseye-security"),
    ("http://deb.debian.org/debian", "bookworm"),
    ("http://deb.debian.org/debian-security", "bookworm-security"),
    ("http://deb.debian.org/debian", "bookworm-backports"),
    ("http://deb.debian.org/debian", "trixie"),
    ("http://deb.debian.org/debian-security", "trixie-security"),
    ("http://deb.debian.org/debian", "trixie-backports"),
];

/// Debian's keys, from the debian-archive-keyring package: named in the
/// sources list so the lists are checked against Debian's own keys, not
/// whatever the host's apt trusts.
const DEBIAN_KEYRING: &str = "/usr/share/keyrings/debian-archive-keyring.gpg";

/// How old the package lists may get before `apt-get update` runs again:
/// security updates replace kernel packages every few weeks, and a
/// package gone from the registry can no longer be downloaded.
const LISTS_MAX_AGE: Duration = Duration::from_hours(24);

/// The private apt configuration, its lists up to date.
pub struct Apt {
    dir: PathBuf,
}

/// One package's record in the lists: what `apt-cache show` prints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub package: String,
    pub version: String,
    /// The Depends field as written, alternatives and versions included.
    pub depends: String,
}

impl Apt {
    /// Writes the configuration for `arch`'s packages under `dir` and
    /// updates the lists when they are missing, older than a day or of
    /// other sources.
    pub fn new(dir: &Path, arch: Arch, verbosity: Verbosity) -> Result<Self> {
        let apt = Self { dir: dir.to_owned() };
        for sub in ["sources.list.d", "preferences.d", "lists/partial", "cache/archives/partial"] {
            fs::create_dir_all(dir.join(sub)).with_context(|| format!("cannot create {}", dir.display()))?;
        }
        let sources = sources_list();
        write_if_changed(&dir.join("sources.list"), &sources)?;
        write_if_changed(&dir.join("preferences"), "")?;
        write_if_changed(&apt.config(), &apt_conf(dir, arch))?;
        let stamp = dir.join("updated");
        let fresh = fs::read_to_string(&stamp).is_ok_and(|updated_for| updated_for == sources)
            && fs::metadata(&stamp).and_then(|metadata| metadata.modified()).is_ok_and(|modified| {
                SystemTime::now().duration_since(modified).unwrap_or_default() < LISTS_MAX_AGE
            });
        if !fresh {
            verbosity.say(format!(
                "updating the lists of Debian's {} packages (apt-get update, private to {})",
                arch.debian_name(),
                dir.display()
            ));
            run_quietly(apt.command("apt-get").args(["-q", "update"]))?;
            fs::write(&stamp, &sources).with_context(|| format!("cannot write {}", stamp.display()))?;
        }
        Ok(apt)
    }

    /// Where its configuration, lists and cache are.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn config(&self) -> PathBuf {
        self.dir.join("apt.conf")
    }

    /// `program` (apt-get or apt-cache) run with this configuration.
    pub fn command(&self, program: &str) -> Command {
        let mut command = Command::new(program);
        command.env("APT_CONFIG", self.config());
        command
    }

    /// The names of the real packages starting with `prefix`.
    pub fn package_names(&self, prefix: &str) -> Result<Vec<String>> {
        let listed = output_of(self.command("apt-cache").args(["pkgnames", prefix]))?;
        Ok(listed.lines().map(str::trim).filter(|name| !name.is_empty()).map(str::to_owned).collect())
    }

    /// Every record of the packages `names`, each version of each.
    pub fn records(&self, names: &[String]) -> Result<Vec<Record>> {
        if names.is_empty() {
            return Ok(Vec::new());
        }
        let shown = output_of(self.command("apt-cache").arg("show").args(names))?;
        Ok(parse_records(&shown))
    }

    /// Downloads `package` at `version` into `dir` and returns the file.
    pub fn download(&self, package: &str, version: &str, dir: &Path) -> Result<PathBuf> {
        fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        run_quietly(
            self.command("apt-get")
                .args(["-q", "download"])
                .arg(format!("{package}={version}"))
                .current_dir(dir),
        )?;
        // apt-get names it PACKAGE_VERSION_ARCH.deb, with an epoch's colon
        // written %3a.
        let prefix = format!("{package}_{}_", version.replace(':', "%3a"));
        let found = fs::read_dir(dir)
            .with_context(|| format!("cannot read {}", dir.display()))?
            .filter_map(Result::ok)
            .map(|entry| entry.path())
            .find(|path| {
                path.file_name().and_then(|name| name.to_str()).is_some_and(|name| name.starts_with(&prefix))
                    && path.extension().is_some_and(|extension| extension == "deb")
            });
        found.with_context(|| {
            format!("apt-get download {package}={version} left no {prefix}*.deb in {}", dir.display())
        })
    }
}

fn sources_list() -> String {
    let signed_by = if Path::new(DEBIAN_KEYRING).exists() {
        format!(" [signed-by={DEBIAN_KEYRING}]")
    } else {
        String::new()
    };
    let mut list = String::new();
    for (mirror, suite) in SUITES {
        let _ = writeln!(list, "deb{signed_by} {mirror} {suite} main");
    }
    list
}

/// Everything apt reads or writes points into `dir`, but for the host's
/// apt.conf.d, read before this file, which may hold the proxy that
/// reaches deb.debian.org. The status file is empty: nothing counts as
/// installed, so nothing the host has pins a version.
fn apt_conf(dir: &Path, arch: Arch) -> String {
    let dir = dir.display();
    let arch = arch.debian_name();
    format!(
        "Dir::Etc::SourceList \"{dir}/sources.list\";\n\
         Dir::Etc::SourceParts \"{dir}/sources.list.d\";\n\
         Dir::Etc::Preferences \"{dir}/preferences\";\n\
         Dir::Etc::PreferencesParts \"{dir}/preferences.d\";\n\
         Dir::State::Lists \"{dir}/lists\";\n\
         Dir::Cache \"{dir}/cache\";\n\
         Dir::State::status \"/dev/null\";\n\
         APT::Architecture \"{arch}\";\n\
         APT::Architectures {{ \"{arch}\"; }};\n\
         Acquire::Languages \"none\";\n\
         APT::Sandbox::User \"root\";\n"
    )
}

fn write_if_changed(path: &Path, contents: &str) -> Result<()> {
    if fs::read_to_string(path).is_ok_and(|old| old == contents) {
        return Ok(());
    }
    fs::write(path, contents).with_context(|| format!("cannot write {}", path.display()))
}

/// Runs `command` with its output kept, shown only if it fails.
pub fn run_quietly(command: &mut Command) -> Result<()> {
    output_of(command).map(drop)
}

/// What `command` prints on its stdout, or an error with its stderr.
pub fn output_of(command: &mut Command) -> Result<String> {
    let output = command.output().with_context(|| format!("cannot run {}", describe(command)))?;
    if !output.status.success() {
        bail!(
            "{} failed ({}): {}",
            describe(command),
            output.status,
            last_lines(&String::from_utf8_lossy(&output.stderr), 5)
        );
    }
    String::from_utf8(output.stdout)
        .with_context(|| format!("{} printed other than UTF-8", describe(command)))
}

/// A command line as typed, without the environment.
fn describe(command: &Command) -> String {
    std::iter::once(command.get_program())
        .chain(command.get_args())
        .map(|word| word.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ")
}

fn last_lines(text: &str, count: usize) -> String {
    let lines: Vec<&str> = text.lines().filter(|line| !line.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(count)..].join(" / ")
}

/// The records of `apt-cache show`'s output: paragraphs of `Field: value`
/// lines, continued by lines starting with a space.
pub fn parse_records(shown: &str) -> Vec<Record> {
    let mut records = Vec::new();
    for paragraph in shown.split("\n\n") {
        let mut fields: Vec<(&str, String)> = Vec::new();
        for line in paragraph.lines() {
            if line.starts_with([' ', '\t']) {
                if let Some((_, value)) = fields.last_mut() {
                    value.push(' ');
                    value.push_str(line.trim());
                }
            } else if let Some((name, value)) = line.split_once(':') {
                fields.push((name, value.trim().to_owned()));
            }
        }
        let field =
            |wanted: &str| fields.iter().find(|(name, _)| *name == wanted).map(|(_, value)| value.clone());
        if let (Some(package), Some(version)) = (field("Package"), field("Version")) {
            records.push(Record { package, version, depends: field("Depends").unwrap_or_default() });
        }
    }
    records
}

/// The packages `depends` names at exactly `version` (`name (= version)`,
/// no alternatives): the parts a split kernel package is made of.
pub fn same_version_dependencies(depends: &str, version: &str) -> Vec<String> {
    depends
        .split(',')
        .map(str::trim)
        .filter(|dependency| !dependency.contains('|'))
        .filter_map(|dependency| {
            let (name, constraint) = dependency.split_once('(')?;
            let constraint = constraint.trim_end_matches(')').trim();
            (constraint.strip_prefix('=')?.trim() == version).then(|| name.trim().to_owned())
        })
        .collect()
}

/// Debian's ordering of versions, as `dpkg --compare-versions` has it:
/// epoch, then upstream version, then revision, each compared by runs of
/// non-digits (letters before other characters, `~` before anything, even
/// the end) and runs of digits (by value).
pub fn compare_versions(left: &str, right: &str) -> Ordering {
    let (left_epoch, left_upstream, left_revision) = split_version(left);
    let (right_epoch, right_upstream, right_revision) = split_version(right);
    left_epoch
        .cmp(&right_epoch)
        .then_with(|| compare_fragment(left_upstream, right_upstream))
        .then_with(|| compare_fragment(left_revision, right_revision))
}

/// (epoch, upstream version, revision); a missing epoch is 0 and a
/// missing revision empty.
fn split_version(version: &str) -> (u64, &str, &str) {
    let (epoch, rest) = match version.split_once(':') {
        Some((epoch, rest)) => (epoch.parse().unwrap_or(0), rest),
        None => (0, version),
    };
    match rest.rsplit_once('-') {
        Some((upstream, revision)) => (epoch, upstream, revision),
        None => (epoch, rest, ""),
    }
}

/// dpkg's `verrevcmp`.
fn compare_fragment(left: &str, right: &str) -> Ordering {
    let (left, right) = (left.as_bytes(), right.as_bytes());
    let (mut i, mut j) = (0, 0);
    while i < left.len() || j < right.len() {
        while left.get(i).is_some_and(|c| !c.is_ascii_digit())
            || right.get(j).is_some_and(|c| !c.is_ascii_digit())
        {
            let ordering = weight(left.get(i).copied()).cmp(&weight(right.get(j).copied()));
            if ordering != Ordering::Equal {
                return ordering;
            }
            i += 1;
            j += 1;
        }
        while left.get(i) == Some(&b'0') {
            i += 1;
        }
        while right.get(j) == Some(&b'0') {
            j += 1;
        }
        let left_digits = left[i.min(left.len())..].iter().take_while(|c| c.is_ascii_digit()).count();
        let right_digits = right[j.min(right.len())..].iter().take_while(|c| c.is_ascii_digit()).count();
        // Without leading zeros, the longer run of digits is the larger
        // number; runs as long compare as strings do.
        let ordering = left_digits
            .cmp(&right_digits)
            .then_with(|| left[i..i + left_digits].cmp(&right[j..j + right_digits]));
        if ordering != Ordering::Equal {
            return ordering;
        }
        i += left_digits;
        j += right_digits;
    }
    Ordering::Equal
}

/// A non-digit's place in the ordering: `~` first, then the end of the
/// string (or a digit), then letters, then everything else.
fn weight(character: Option<u8>) -> i32 {
    match character {
        None => 0,
        Some(b'~') => -1,
        Some(c) if c.is_ascii_digit() => 0,
        Some(c) if c.is_ascii_alphabetic() => i32::from(c),
        Some(c) => i32::from(c) + 256,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_compare_as_dpkg_does() {
        let ascending = [
            "6.1.180-1~deb11u1",
            "6.1.192-1",
            "6.1.192-3",
            "6.12.118-1~bpo12+1",
            "6.12.118-1",
            "6.12.118-1+b1",
            "7.3.4-1~bpo13+1",
            "7.3.4-1",
            "7.3.4a-1",
            "7.3.4.1-1",
            "7.3.10-1",
            "1:0.1-1",
        ];
        for (index, left) in ascending.iter().enumerate() {
            for (other, right) in ascending.iter().enumerate() {
                assert_eq!(compare_versions(left, right), index.cmp(&other), "{left} against {right}");
            }
        }
        assert_eq!(compare_versions("1.0~rc1", "1.0"), Ordering::Less);
        assert_eq!(compare_versions("1.0", "1.0+"), Ordering::Less);
        assert_eq!(compare_versions("1.01", "1.1"), Ordering::Equal);
        assert_eq!(compare_versions("1.0-1", "1.0-1"), Ordering::Equal);
    }

    #[test]
    fn records_and_split_dependencies_are_read() {
        let shown = "Package: linux-image-7.3.4+deb13-amd64\nVersion: 7.3.4-1~bpo13+1\n\
                     Depends: dracut | initramfs-tools (>= 0.120+deb8u2) | linux-initramfs-tool, \
                     linux-base-7.3.4+deb13-amd64 (= 7.3.4-1~bpo13+1),\n linux-binary-7.3.4+deb13-amd64 (= 7.3.4-1~bpo13+1)\n\
                     Description: Linux\n\nPackage: busybox-static\nVersion: 1:1.37.0-6+b9\n";
        let records = parse_records(shown);
        assert_eq!(records.len(), 2);
        assert_eq!(
            records[1],
            Record {
                package: "busybox-static".into(),
                version: "1:1.37.0-6+b9".into(),
                depends: String::new()
            }
        );
        assert_eq!(
            same_version_dependencies(&records[0].depends, &records[0].version),
            ["linux-base-7.3.4+deb13-amd64", "linux-binary-7.3.4+deb13-amd64"]
        );
    }
}
