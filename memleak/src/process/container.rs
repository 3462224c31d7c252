//! --container: a container's cgroup, found from the names container
//! runtimes give cgroups (`docker-<id>.scope`, `libpod-<id>.scope` and
//! `libpod-<id>`, `cri-containerd-<id>.scope`, `crio-<id>.scope`, or a
//! plain `<id>` directory), by id or a prefix of it; by name through
//! `podman inspect` or `docker inspect` when they are on the PATH, a name
//! before an id prefix as those runtimes resolve them. The same names
//! tell which container a process runs in.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

#[derive(Debug, thiserror::Error)]
pub enum ContainerError {
    #[error("no cgroup v2 hierarchy is mounted (see /proc/self/mountinfo): --container needs one")]
    NoCgroup2,
    #[error(
        "no container {0}: no cgroup named for it under {1}, and neither `podman inspect` nor \
         `docker inspect` knows that name"
    )]
    NotFound(String, PathBuf),
    #[error("container id prefix {prefix} is ambiguous: it starts {ids}; give more of the id")]
    Ambiguous { prefix: String, ids: String },
    #[error(
        "`{0}` is not a container id or name (letters, digits, `_`, `.` and `-`, not starting with `-`)"
    )]
    BadReference(String),
}

/// Hex digits in a full container id (a SHA-256).
const FULL_ID_LENGTH: usize = 64;

/// The runtime that made a container, as its cgroup's name tells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Runtime {
    Containerd,
    Crio,
    Docker,
    Podman,
}

impl Runtime {
    /// The scheme of kube-state-metrics' `container_id` (`containerd://<id>`).
    pub fn scheme(self) -> &'static str {
        match self {
            Self::Containerd => "containerd",
            Self::Crio => "cri-o",
            Self::Docker => "docker",
            Self::Podman => "podman",
        }
    }
}

/// What cgroup directories of a container are named: a prefix and a
/// suffix around its full id, and the runtime that names them so.
const RUNTIME_NAMING: [(&str, &str, Option<Runtime>); 6] = [
    ("docker-", ".scope", Some(Runtime::Docker)),
    ("libpod-", ".scope", Some(Runtime::Podman)),
    ("cri-containerd-", ".scope", Some(Runtime::Containerd)),
    ("crio-", ".scope", Some(Runtime::Crio)),
    // podman with --cgroup-manager cgroupfs: libpod_parent/libpod-<id>.
    ("libpod-", "", Some(Runtime::Podman)),
    // The cgroupfs driver's kubepods/<qos>/pod<uid>/<id>, and docker's
    // docker/<id>: the runtime is not in the name.
    ("", "", None),
];

/// A container and the cgroup that holds its processes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerCgroup {
    /// Its full id, in hex.
    pub id: String,
    pub path: PathBuf,
}

/// The full container id a cgroup directory's name carries, if it is
/// named as a runtime names a container's.
pub fn id_in_directory_name(name: &str) -> Option<&str> {
    runtime_and_id_in_directory_name(name).map(|(_, id)| id)
}

/// `id_in_directory_name`, with the runtime the name tells, if it does.
pub fn runtime_and_id_in_directory_name(name: &str) -> Option<(Option<Runtime>, &str)> {
    RUNTIME_NAMING.iter().find_map(|&(prefix, suffix, runtime)| {
        let id = name.strip_prefix(prefix)?.strip_suffix(suffix)?;
        is_full_id(id).then_some((runtime, id))
    })
}

/// The first 12 hex digits of an id, as `docker ps` and `podman ps` show
/// it.
pub fn short_id(id: &str) -> &str {
    id.get(..12).unwrap_or(id)
}

pub fn is_full_id(id: &str) -> bool {
    id.len() == FULL_ID_LENGTH
        && id.bytes().all(|byte| byte.is_ascii_digit() || (b'a'..=b'f').contains(&byte))
}

/// The container a cgroup path (as /proc/PID/cgroup gives it) belongs
/// to: its innermost directory named for a container.
pub fn id_in_cgroup_path(path: &str) -> Option<String> {
    path.rsplit('/').find_map(id_in_directory_name).map(str::to_owned)
}

/// The container process `pid` runs in, if its cgroup v2 path names one.
pub fn container_of(pid: u32) -> Option<String> {
    id_in_cgroup_path(&cgroup2_path(pid)?)
}

/// The cgroup v2 path of `process` (a pid, or `self`), as /proc gives it:
/// from the hierarchy's root, which `cgroup2_mount` says where to find.
pub fn cgroup2_path(process: impl std::fmt::Display) -> Option<String> {
    let cgroups = fs::read_to_string(format!("/proc/{process}/cgroup")).ok()?;
    cgroups.lines().find_map(|line| line.strip_prefix("0::")).map(str::to_owned)
}

/// Where the cgroup v2 hierarchy is mounted: /sys/fs/cgroup on a pure v2
/// host, /sys/fs/cgroup/unified on a hybrid one.
pub fn cgroup2_mount() -> Option<PathBuf> {
    let mounts = fs::read_to_string("/proc/self/mountinfo").ok()?;
    mounts.lines().find_map(|line| {
        let (fields, filesystem) = line.split_once(" - ")?;
        (filesystem.split_whitespace().next() == Some("cgroup2"))
            .then(|| fields.split_whitespace().nth(4).map(PathBuf::from))
            .flatten()
    })
}

/// The cgroup of the container `reference` names: a full id, a name the
/// runtime on the PATH knows, or a prefix of an id.
pub fn find(reference: &str) -> Result<ContainerCgroup, ContainerError> {
    check_reference(reference)?;
    let root = cgroup2_mount().ok_or(ContainerError::NoCgroup2)?;
    let containers = containers_under(&root);
    resolve(reference, &containers, runtime_id_of)?
        .ok_or(ContainerError::NotFound(reference.to_owned(), root))
}

/// Every container's cgroup under the cgroup v2 hierarchy now, sorted by
/// id; none without a hierarchy.
pub fn running() -> Vec<ContainerCgroup> {
    let mut containers = cgroup2_mount().map(|root| containers_under(&root)).unwrap_or_default();
    containers.sort_by(|one, other| (&one.id, &one.path).cmp(&(&other.id, &other.path)));
    containers
}

/// Which of `containers` (from `running`) `reference` names now, as
/// `find` resolves it; `None` while none does.
pub fn find_among(
    reference: &str,
    containers: &[ContainerCgroup],
) -> Result<Option<ContainerCgroup>, ContainerError> {
    check_reference(reference)?;
    resolve(reference, containers, runtime_id_of)
}

/// Which of `containers` `reference` names, in the order podman and
/// docker resolve one: a full id; else the container the runtime knows by
/// that name (`runtime_id_of` gives its id); else an id prefix. A name
/// comes before a prefix because names may be hex too: `--container db`
/// means the container called db, not one whose id happens to start so.
/// A name the runtime knows is final, so a stopped container is never
/// taken for a running one whose id starts with its name.
fn resolve(
    reference: &str,
    containers: &[ContainerCgroup],
    runtime_id_of: impl FnOnce(&str) -> Option<String>,
) -> Result<Option<ContainerCgroup>, ContainerError> {
    if is_full_id(&reference.to_ascii_lowercase()) {
        return by_id_prefix(containers, reference);
    }
    match runtime_id_of(reference) {
        Some(full_id) => by_id_prefix(containers, &full_id),
        None => by_id_prefix(containers, reference),
    }
}

/// A reference goes on a runtime's command line: it must be a name or an
/// id, never something the runtime would take for an option.
fn check_reference(reference: &str) -> Result<(), ContainerError> {
    let allowed = |byte: u8| byte.is_ascii_alphanumeric() || matches!(byte, b'_' | b'.' | b'-');
    if reference.is_empty() || reference.starts_with('-') || !reference.bytes().all(allowed) {
        return Err(ContainerError::BadReference(reference.to_owned()));
    }
    Ok(())
}

/// The one container whose id starts with `prefix`, if any. A container
/// may have nested cgroups named for it (podman's `libpod-<id>` holds a
/// `container` directory on some setups): the shallowest is its own.
fn by_id_prefix(
    containers: &[ContainerCgroup],
    prefix: &str,
) -> Result<Option<ContainerCgroup>, ContainerError> {
    let prefix = prefix.to_ascii_lowercase();
    let mut matching: Vec<&ContainerCgroup> =
        containers.iter().filter(|container| container.id.starts_with(&prefix)).collect();
    matching.sort_by_key(|container| container.path.components().count());
    let mut ids: Vec<&str> = matching.iter().map(|container| container.id.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    if ids.len() > 1 {
        let ids = ids.iter().map(|id| short_id(id)).collect::<Vec<_>>().join(", ");
        return Err(ContainerError::Ambiguous { prefix, ids });
    }
    Ok(matching.first().map(|&container| container.clone()))
}

/// Every cgroup under `root` named for a container.
fn containers_under(root: &Path) -> Vec<ContainerCgroup> {
    let mut found = Vec::new();
    let mut directories = vec![root.to_path_buf()];
    while let Some(directory) = directories.pop() {
        let Ok(entries) = fs::read_dir(&directory) else { continue };
        for entry in entries.flatten() {
            if !entry.file_type().is_ok_and(|kind| kind.is_dir()) {
                continue;
            }
            let path = entry.path();
            if let Some(id) = entry.file_name().to_str().and_then(id_in_directory_name) {
                found.push(ContainerCgroup { id: id.to_owned(), path: path.clone() });
            }
            directories.push(path);
        }
    }
    found
}

/// The full id of container `name` as podman, else docker, knows it.
/// Each runs with a fixed argument list, no shell, and its answer must be
/// a full id: anything else means it does not know the name.
fn runtime_id_of(name: &str) -> Option<String> {
    ["podman", "docker"].into_iter().filter_map(on_path).find_map(|runtime| {
        let output = Command::new(&runtime)
            .args(["inspect", "--type", "container", "--format", "{{.Id}}", "--", name])
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .ok()?;
        let id = String::from_utf8_lossy(&output.stdout).trim().to_owned();
        (output.status.success() && is_full_id(&id)).then_some(id)
    })
}

/// The name `runtime` (podman or docker, when on the PATH) gives the
/// container whose full id is `id`, without docker's leading `/`.
pub fn runtime_name_of(runtime: Runtime, id: &str) -> Option<String> {
    let program = match runtime {
        Runtime::Podman => "podman",
        Runtime::Docker => "docker",
        Runtime::Containerd | Runtime::Crio => return None,
    };
    if !is_full_id(id) {
        return None;
    }
    let output = Command::new(on_path(program)?)
        .args(["inspect", "--type", "container", "--format", "{{.Name}}", "--", id])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let name = String::from_utf8_lossy(&output.stdout).trim().trim_start_matches('/').to_owned();
    (output.status.success() && !name.is_empty()).then_some(name)
}

/// The path of `program` in a directory of the PATH, if it is there.
fn on_path(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|directory| directory.join(program))
        .find(|candidate| candidate.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "3f5e1c0a9b8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f";

    #[test]
    fn runtimes_name_a_containers_cgroup_after_its_id() {
        for name in [
            format!("docker-{ID}.scope"),
            format!("libpod-{ID}.scope"),
            format!("libpod-{ID}"),
            format!("cri-containerd-{ID}.scope"),
            format!("crio-{ID}.scope"),
            ID.to_owned(),
        ] {
            assert_eq!(id_in_directory_name(&name), Some(ID), "{name}");
        }
        for name in [
            format!("libpod-conmon-{ID}.scope"),
            format!("docker-{}.scope", &ID[..12]),
            "system.slice".to_owned(),
            format!("docker-{}.scope", ID.to_uppercase()),
        ] {
            assert_eq!(id_in_directory_name(&name), None, "{name}");
        }
    }

    #[test]
    fn a_process_is_in_its_innermost_container() {
        let path = format!("/machine.slice/libpod-{ID}.scope/container");
        assert_eq!(id_in_cgroup_path(&path).as_deref(), Some(ID));
        assert_eq!(id_in_cgroup_path(&format!("/libpod_parent/libpod-{ID}")).as_deref(), Some(ID));
        assert_eq!(id_in_cgroup_path("/user.slice/user-0.slice/session-3.scope"), None);
    }

    #[test]
    fn an_id_prefix_names_one_container_or_is_refused_as_ambiguous() {
        let other = format!("3f5e{}", &ID[4..].replace('a', "b"));
        let containers = vec![
            ContainerCgroup { id: ID.to_owned(), path: PathBuf::from(format!("/c/libpod-{ID}/container")) },
            ContainerCgroup { id: ID.to_owned(), path: PathBuf::from(format!("/c/libpod-{ID}")) },
            ContainerCgroup { id: other.clone(), path: PathBuf::from(format!("/c/{other}")) },
        ];
        let found = by_id_prefix(&containers, &ID[..12].to_uppercase()).unwrap();
        assert_eq!(found.map(|found| found.path), Some(PathBuf::from(format!("/c/libpod-{ID}"))));
        assert!(matches!(by_id_prefix(&containers, "3f5e"), Err(ContainerError::Ambiguous { .. })));
        assert_eq!(by_id_prefix(&containers, "0000").unwrap(), None);
    }

    #[test]
    fn a_name_the_runtime_knows_comes_before_an_id_prefix() {
        // Seen with podman: `--container 77` followed the container whose
        // id starts 77, not the one podman calls 77.
        let named = "1ca996f164297786566a09b665a121cdc6dfc4542636c62198f5fa115fcf89d0";
        let containers = vec![
            ContainerCgroup { id: ID.to_owned(), path: PathBuf::from(format!("/c/libpod-{ID}")) },
            ContainerCgroup { id: named.to_owned(), path: PathBuf::from(format!("/c/libpod-{named}")) },
        ];
        let runtime = |name: &str| (name == "3f5e").then(|| named.to_owned());
        let found = resolve("3f5e", &containers, runtime).unwrap();
        assert_eq!(found.map(|found| found.id), Some(named.to_owned()), "the container called 3f5e");
        // Unknown to the runtime, it is an id prefix.
        let found = resolve("3f5e1c", &containers, runtime).unwrap();
        assert_eq!(found.map(|found| found.id), Some(ID.to_owned()));
        // A full id is that container, whatever the runtime says.
        let found = resolve(ID, &containers, |_| Some(named.to_owned())).unwrap();
        assert_eq!(found.map(|found| found.id), Some(ID.to_owned()));
        // Known by name but without a cgroup (stopped): not a prefix match.
        let stopped = "3f5e000000000000000000000000000000000000000000000000000000000000";
        assert_eq!(resolve("3f5e", &containers, |_| Some(stopped.to_owned())).unwrap(), None);
    }

    #[test]
    fn a_reference_that_a_runtime_would_read_as_an_option_is_refused() {
        for bad in ["", "-h", "--format=x", "a b", "a/b", "$(x)"] {
            assert!(matches!(check_reference(bad), Err(ContainerError::BadReference(_))), "{bad:?}");
        }
        assert!(check_reference("web-1.blue_2").is_ok());
    }
}
