//! Which pod and container a process runs in, with no Kubernetes API:
//! the kubelet names a container's cgroup after the pod's uid, its quality-of-service
//! class and the container's id (`placement_of`), and the runtime leaves
//! the names in files on the node (`Names::under`): the OCI bundle's
//! annotations of containerd and CRI-O, else the kubelet's log file
//! names. Outside Kubernetes, podman and docker give a container's name
//! through `inspect`.
//!
//! Every file read is below `--host-root` (`/`, or the host's root
//! mounted in memleak's own container), resolved inside it, bounded and
//! parsed as untrusted: the node's containers write some of them.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use serde::Deserialize;

use super::{
    container::{self, Runtime},
    files,
};
use crate::model::Workload;

/// The largest bundle config.json read: real ones are a few KiB.
const BUNDLE_LIMIT: u64 = 1 << 20;

/// Entries of a log directory looked through at most: a node runs a few
/// hundred containers.
const LOG_ENTRIES_LIMIT: usize = 100_000;

/// A pod's quality-of-service class, as the kubelet names its cgroups after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Qos {
    Guaranteed,
    Burstable,
    BestEffort,
}

/// Where a cgroup path puts a process: in which container (and which
/// runtime's) and pod, as far as the kubelet's and the runtimes' names
/// tell it. A process of a pod's own cgroup (the sandbox's, on some
/// setups) or of CRI-O's monitor (`crio-conmon-`) is in no container; the
/// pause container has a cgroup of its own, which its bundle says is the
/// sandbox (`Names::sandbox`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    pub runtime: Option<Runtime>,
    /// The container's full id.
    pub container_id: Option<String>,
    /// The pod's uid, with dashes.
    pub pod_uid: Option<String>,
    pub qos: Option<Qos>,
}

/// The placement `/proc/PID/cgroup`'s text gives: from the cgroup v2 line
/// if it names a container or pod, else from the first cgroup v1 line
/// that does (a v1 or hybrid node where the kubelet drives v1).
pub fn placement_in(proc_cgroup: &str) -> Placement {
    let mut found: Vec<(bool, &str)> = proc_cgroup
        .lines()
        .filter_map(|line| {
            let (hierarchy, rest) = line.split_once(':')?;
            let (_, path) = rest.split_once(':')?;
            Some((hierarchy == "0", path))
        })
        .collect();
    // The v2 line first.
    found.sort_by_key(|&(v2, _)| !v2);
    found
        .into_iter()
        .map(|(_, path)| placement_of(path))
        .find(|placement| placement.container_id.is_some() || placement.pod_uid.is_some())
        .unwrap_or_default()
}

/// The placement one cgroup path gives. The kubelet's layouts:
/// - systemd driver: `kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid with _>.slice/<runtime>-<id>.scope`,
///   with no quality-of-service slice for a Guaranteed pod;
/// - cgroupfs driver: `kubepods/<qos>/pod<uid>/<id>`, `kubepods/pod<uid>/<id>`;
/// - cgroup v1 containerd with the systemd driver:
///   `…/kubepods-<qos>-pod<uid>.slice:cri-containerd:<id>`.
pub fn placement_of(path: &str) -> Placement {
    let mut placement = Placement::default();
    let mut in_kubepods = false;
    let mut qos_directory = None;
    for component in path.split('/') {
        // systemd's `.mount` units under a container are not containers;
        // systemd names units in lowercase.
        if Path::new(component).extension().is_some_and(|extension| extension == "mount") {
            continue;
        }
        if component == "kubepods" || component == "kubepods.slice" {
            in_kubepods = true;
            continue;
        }
        // containerd on cgroup v1 with the systemd driver:
        // <pod slice>:cri-containerd:<id>, one component.
        let mut parts = component.split(':');
        if let (Some(slice), Some(kind), Some(id), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        {
            if let Some(runtime) = runtime_of_prefix(kind).filter(|_| container::is_full_id(id)) {
                if let Some((qos, uid)) = pod_of_directory(slice) {
                    placement.pod_uid = Some(uid);
                    placement.qos = qos;
                }
                placement.runtime = Some(runtime);
                placement.container_id = Some(id.to_owned());
            }
            continue;
        }
        if in_kubepods {
            // The cgroupfs driver's QoS directory, above its pods'.
            if let Some(qos) = qos_named(component) {
                qos_directory = Some(qos);
                continue;
            }
            if let Some((qos, uid)) = pod_of_directory(component) {
                placement.pod_uid = Some(uid);
                placement.qos = Some(qos.or(qos_directory).unwrap_or(Qos::Guaranteed));
                continue;
            }
        }
        if component == "docker" {
            // docker's cgroupfs layout: docker/<id>.
            placement.runtime = Some(Runtime::Docker);
            continue;
        }
        if let Some((runtime, id)) = container::runtime_and_id_in_directory_name(component) {
            placement.runtime = runtime.or(placement.runtime);
            placement.container_id = Some(id.to_owned());
        }
    }
    if placement.container_id.is_none() {
        placement.runtime = None;
    }
    placement
}

/// The runtime a cgroup v1 systemd name's middle part names.
fn runtime_of_prefix(kind: &str) -> Option<Runtime> {
    match kind {
        "cri-containerd" => Some(Runtime::Containerd),
        "crio" => Some(Runtime::Crio),
        "docker" => Some(Runtime::Docker),
        _ => None,
    }
}

/// The quality-of-service class and pod uid a pod's cgroup directory is named for:
/// `kubepods-<qos>-pod<uid_with_underscores>.slice`,
/// `kubepods-pod<uid>.slice` (Guaranteed), or `pod<uid>` (cgroupfs,
/// whose class is its parent directory's name, Guaranteed when that is
/// kubepods itself).
fn pod_of_directory(name: &str) -> Option<(Option<Qos>, String)> {
    let (qos, uid) = if let Some(slice) = name.strip_suffix(".slice") {
        let rest = slice.strip_prefix("kubepods-")?;
        let (qos, uid) = match rest.split_once("-pod") {
            Some((qos, uid)) => (qos_named(qos)?, uid),
            None => (Qos::Guaranteed, rest.strip_prefix("pod")?),
        };
        (Some(qos), uid.replace('_', "-"))
    } else {
        // cgroupfs: the class is the parent directory's.
        (None, name.strip_prefix("pod")?.to_owned())
    };
    is_uid(&uid).then_some((qos, uid))
}

fn qos_named(name: &str) -> Option<Qos> {
    match name {
        "burstable" => Some(Qos::Burstable),
        "besteffort" => Some(Qos::BestEffort),
        _ => None,
    }
}

/// A pod uid: a UUID, 36 characters of hex and dashes.
fn is_uid(uid: &str) -> bool {
    uid.len() == 36 && uid.bytes().all(|byte| byte.is_ascii_hexdigit() || byte == b'-')
}

/// The pod and container names the node's files give a container.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Names {
    pub namespace: Option<String>,
    pub pod: Option<String>,
    pub uid: Option<String>,
    pub container: Option<String>,
    /// Which runtime's bundle named it.
    pub runtime: Option<Runtime>,
    /// The pod's sandbox (pause) container: no workload of its own.
    pub sandbox: bool,
}

/// A bundle's config.json: only its annotations are read.
#[derive(Deserialize)]
struct Bundle {
    #[serde(default)]
    annotations: HashMap<String, String>,
}

impl Names {
    /// The names of container `id` (a full id) in the files below
    /// `host_root`: the bundle of `runtime` (either runtime's when not
    /// known), else the kubelet's log names.
    pub fn under(host_root: &Path, runtime: Option<Runtime>, id: &str, pod_uid: Option<&str>) -> Self {
        let mut names = Self::from_bundle(host_root, runtime, id).unwrap_or_default();
        if names.container.is_none() {
            if let Some((pod, namespace, container)) = log_names(host_root, id) {
                names.pod.get_or_insert(pod);
                names.namespace.get_or_insert(namespace);
                names.container = Some(container);
            }
        }
        let uid = names.uid.clone().or_else(|| pod_uid.map(str::to_owned));
        if names.uid.is_none() || names.pod.is_none() {
            if let Some((namespace, pod, uid)) =
                pod_log_directory(host_root, names.namespace.as_deref(), names.pod.as_deref(), uid.as_deref())
            {
                names.namespace.get_or_insert(namespace);
                names.pod.get_or_insert(pod);
                names.uid.get_or_insert(uid);
            }
        }
        names
    }

    fn from_bundle(host_root: &Path, runtime: Option<Runtime>, id: &str) -> Option<Self> {
        if !container::is_full_id(id) {
            return None;
        }
        let containerd = format!("run/containerd/io.containerd.runtime.v2.task/k8s.io/{id}/config.json");
        let crio = format!("run/containers/storage/overlay-containers/{id}/userdata/config.json");
        let candidates = [(Runtime::Containerd, containerd), (Runtime::Crio, crio)];
        candidates
            .into_iter()
            .filter(|(candidate, _)| runtime.is_none_or(|runtime| runtime == *candidate))
            .find_map(|(runtime, path)| {
                let annotations = read_annotations(host_root, Path::new(&path))?;
                Some(Self::from_annotations(runtime, &annotations))
            })
    }

    /// containerd's keys (`io.kubernetes.cri.*`), else CRI-O's
    /// (`io.kubernetes.pod.*`, `io.kubernetes.container.name`).
    fn from_annotations(runtime: Runtime, annotations: &HashMap<String, String>) -> Self {
        let value = |keys: &[&str]| {
            keys.iter().find_map(|key| annotations.get(*key).filter(|value| !value.is_empty()).cloned())
        };
        let kind = value(&["io.kubernetes.cri.container-type", "io.kubernetes.cri-o.ContainerType"]);
        Self {
            namespace: value(&["io.kubernetes.cri.sandbox-namespace", "io.kubernetes.pod.namespace"]),
            pod: value(&["io.kubernetes.cri.sandbox-name", "io.kubernetes.pod.name"]),
            uid: value(&["io.kubernetes.cri.sandbox-uid", "io.kubernetes.pod.uid"]),
            container: value(&["io.kubernetes.cri.container-name", "io.kubernetes.container.name"]),
            runtime: Some(runtime),
            sandbox: kind.as_deref() == Some("sandbox"),
        }
    }
}

/// The annotations of the bundle config.json at `path` below `host_root`,
/// if it is a regular file of at most `BUNDLE_LIMIT` bytes that parses.
fn read_annotations(host_root: &Path, path: &Path) -> Option<HashMap<String, String>> {
    let file = files::open_under(host_root, path).ok()?;
    let bytes = match files::read_limited(&file, BUNDLE_LIMIT) {
        Ok(bytes) => bytes,
        Err(error) => {
            log::warn!("not reading {} below {}: {error}", path.display(), host_root.display());
            return None;
        }
    };
    match serde_json::from_slice::<Bundle>(&bytes) {
        Ok(bundle) => Some(bundle.annotations),
        Err(error) => {
            log::warn!("cannot read {} below {}: {error}", path.display(), host_root.display());
            None
        }
    }
}

/// (pod, namespace, container) from the kubelet's
/// `var/log/containers/<pod>_<namespace>_<container>-<id>.log`. Pod and
/// namespace names have no `_`, so the split is unambiguous.
fn log_names(host_root: &Path, id: &str) -> Option<(String, String, String)> {
    let entries = files::list_under(host_root, Path::new("var/log/containers"), LOG_ENTRIES_LIMIT).ok()?;
    let suffix = format!("-{id}.log");
    entries.iter().filter_map(|name| name.to_str()).find_map(|name| {
        let mut parts = name.strip_suffix(&suffix)?.splitn(3, '_');
        let (pod, namespace, container) = (parts.next()?, parts.next()?, parts.next()?);
        (!pod.is_empty() && !namespace.is_empty() && !container.is_empty())
            .then(|| (pod.to_owned(), namespace.to_owned(), container.to_owned()))
    })
}

/// (namespace, pod, uid) from the kubelet's
/// `var/log/pods/<namespace>_<pod>_<uid>` directory that matches what is
/// known: the uid, or the namespace and pod.
fn pod_log_directory(
    host_root: &Path,
    namespace: Option<&str>,
    pod: Option<&str>,
    uid: Option<&str>,
) -> Option<(String, String, String)> {
    let entries = files::list_under(host_root, Path::new("var/log/pods"), LOG_ENTRIES_LIMIT).ok()?;
    entries.iter().filter_map(|name| name.to_str()).find_map(|name| {
        let mut parts = name.splitn(3, '_');
        let (entry_namespace, entry_pod, entry_uid) = (parts.next()?, parts.next()?, parts.next()?);
        let matches = match uid {
            Some(uid) => entry_uid == uid,
            None => namespace == Some(entry_namespace) && pod == Some(entry_pod),
        };
        (matches && is_uid(entry_uid))
            .then(|| (entry_namespace.to_owned(), entry_pod.to_owned(), entry_uid.to_owned()))
    })
}

/// Finds the workload of processes, each container's once.
pub struct Resolver {
    host_root: PathBuf,
    node: Option<String>,
    /// By container id: a container's processes share its names. `None`
    /// for a pod's sandbox.
    known: HashMap<String, Option<Workload>>,
}

impl Resolver {
    /// Files are read below `host_root`; the node is named by the
    /// `NODE_NAME` environment variable (the downward API's
    /// `spec.nodeName`), else the host name.
    pub fn new(host_root: PathBuf) -> Self {
        let node = std::env::var("NODE_NAME").ok().filter(|name| !name.is_empty()).or_else(host_name);
        Self { host_root, node, known: HashMap::new() }
    }

    /// The workload process `pid` is part of: `None` outside a container,
    /// and for a pod's sandbox.
    pub fn workload_of(&mut self, pid: u32) -> Option<Workload> {
        let path = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
        self.workload_in(&path)
    }

    /// `workload_of`, from /proc/PID/cgroup's text.
    fn workload_in(&mut self, proc_cgroup: &str) -> Option<Workload> {
        let placement = placement_in(proc_cgroup);
        let id = placement.container_id.clone()?;
        if let Some(known) = self.known.get(&id) {
            return known.clone();
        }
        let workload = self.resolve(&placement);
        self.known.insert(id, workload.clone());
        workload
    }

    fn resolve(&self, placement: &Placement) -> Option<Workload> {
        let id = placement.container_id.as_deref()?;
        let in_pod = placement.pod_uid.is_some();
        let names = match placement.runtime {
            // Podman and docker outside Kubernetes: their own name.
            Some(runtime @ (Runtime::Podman | Runtime::Docker)) if !in_pod => {
                Names { container: container::runtime_name_of(runtime, id), ..Names::default() }
            }
            runtime => Names::under(&self.host_root, runtime, id, placement.pod_uid.as_deref()),
        };
        if names.sandbox {
            return None;
        }
        let runtime = placement.runtime.or(names.runtime);
        Some(Workload {
            namespace: names.namespace,
            pod: names.pod,
            container: names.container,
            uid: names.uid.or_else(|| placement.pod_uid.clone()),
            container_id: Some(
                runtime.map_or_else(|| id.to_owned(), |runtime| format!("{}://{id}", runtime.scheme())),
            ),
            node: self.node.clone(),
        })
    }

    /// Forgets the containers `still_followed` does not name: those gone.
    pub fn keep_only(&mut self, still_followed: impl Fn(&str) -> bool) {
        self.known.retain(|id, _| still_followed(id));
    }
}

/// `serve --namespace`, `--pod` and `--container-name`: the processes of
/// the containers whose names match every filter given, those that start
/// later too. Each is as the command line gave it, `pod` a regular
/// expression matched against the whole name, as Prometheus matches.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkloadFilter {
    /// The pod's namespace is one of these, when any is given.
    pub namespaces: Vec<String>,
    pub pod: Option<String>,
    /// The container's name is one of these, when any is given.
    pub container_names: Vec<String>,
    /// Where the names are read (`--host-root`).
    pub host_root: PathBuf,
}

impl WorkloadFilter {
    /// `--pod`'s expression, anchored, or why it is no regular expression.
    pub fn pod_regex(pattern: &str) -> Result<regex::Regex, String> {
        regex::Regex::new(&format!("^(?:{pattern})$")).map_err(|error| {
            // regex's message spans lines, the pattern drawn with a caret:
            // its last line says what is wrong.
            let error = error.to_string();
            let why = error.lines().last().unwrap_or_default().trim().trim_start_matches("error: ");
            format!("--pod `{pattern}` is not a regular expression: {why}")
        })
    }
}

/// A `WorkloadFilter` at work: which processes it selects now.
pub struct Selection {
    filter: WorkloadFilter,
    pod: Option<regex::Regex>,
    resolver: Resolver,
}

impl Selection {
    pub fn new(filter: WorkloadFilter) -> Result<Self, String> {
        let pod = filter.pod.as_deref().map(WorkloadFilter::pod_regex).transpose()?;
        let resolver = Resolver::new(filter.host_root.clone());
        Ok(Self { filter, pod, resolver })
    }

    /// Whether process `pid` runs in a container the filter matches: never
    /// a pod's sandbox, nor a process outside every container.
    pub fn selects(&mut self, pid: u32) -> bool {
        self.resolver.workload_of(pid).is_some_and(|workload| self.matches(&workload))
    }

    fn matches(&self, workload: &Workload) -> bool {
        let among = |names: &[String], name: &Option<String>| {
            names.is_empty() || name.as_ref().is_some_and(|name| names.contains(name))
        };
        among(&self.filter.namespaces, &workload.namespace)
            && among(&self.filter.container_names, &workload.container)
            && self
                .pod
                .as_ref()
                .is_none_or(|pod| workload.pod.as_deref().is_some_and(|name| pod.is_match(name)))
    }

    /// The processes running now that the filter selects. The names of
    /// containers no process runs in any more are forgotten: the cache
    /// holds the node's containers of now.
    pub fn processes(&mut self) -> Vec<u32> {
        let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
        let mut containers_seen = std::collections::HashSet::new();
        let mut selected = Vec::new();
        for pid in entries.flatten().filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok()) {
            let Ok(proc_cgroup) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else { continue };
            let Some(id) = placement_in(&proc_cgroup).container_id else { continue };
            if self.resolver.workload_in(&proc_cgroup).is_some_and(|workload| self.matches(&workload)) {
                selected.push(pid);
            }
            containers_seen.insert(id);
        }
        self.resolver.keep_only(|id| containers_seen.contains(id));
        selected
    }
}

/// The host's name, as the kernel has it.
fn host_name() -> Option<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
    let name = name.trim();
    (!name.is_empty()).then(|| name.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "3f5e1c0a9b8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f";
    const UID: &str = "1f2e3d4c-5b6a-4789-8abc-def012345678";

    fn placement(runtime: Option<Runtime>, pod: bool, qos: Option<Qos>) -> Placement {
        Placement { runtime, container_id: Some(ID.to_owned()), pod_uid: pod.then(|| UID.to_owned()), qos }
    }

    #[test]
    fn every_layout_of_the_kubelet_and_the_runtimes_is_placed() {
        let underscored = UID.replace('-', "_");
        let cases = [
            // cgroup v2, systemd driver.
            (
                format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{underscored}.slice/cri-containerd-{ID}.scope"),
                placement(Some(Runtime::Containerd), true, Some(Qos::Burstable)),
            ),
            (
                format!("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{underscored}.slice/crio-{ID}.scope"),
                placement(Some(Runtime::Crio), true, Some(Qos::BestEffort)),
            ),
            (
                format!("0::/kubepods.slice/kubepods-pod{underscored}.slice/crio-{ID}.scope"),
                placement(Some(Runtime::Crio), true, Some(Qos::Guaranteed)),
            ),
            (
                format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{underscored}.slice/docker-{ID}.scope"),
                placement(Some(Runtime::Docker), true, Some(Qos::Burstable)),
            ),
            // cgroupfs driver, v2 and v1 (the runtime is not in the name).
            (format!("0::/kubepods/besteffort/pod{UID}/{ID}"), placement(None, true, Some(Qos::BestEffort))),
            (format!("0::/kubepods/burstable/pod{UID}/{ID}"), placement(None, true, Some(Qos::Burstable))),
            (format!("0::/kubepods/pod{UID}/{ID}"), placement(None, true, Some(Qos::Guaranteed))),
            (
                format!("12:pids:/kubepods/besteffort/pod{UID}/{ID}\n0::/\n"),
                placement(None, true, Some(Qos::BestEffort)),
            ),
            // cgroup v1, containerd with the systemd driver.
            (
                format!("4:memory:/system.slice/containerd.service/kubepods-besteffort-pod{underscored}.slice:cri-containerd:{ID}\n1:name=systemd:/system.slice/containerd.service\n"),
                placement(Some(Runtime::Containerd), true, Some(Qos::BestEffort)),
            ),
            // Outside Kubernetes: docker (systemd, and cgroupfs on v1), podman.
            (format!("0::/system.slice/docker-{ID}.scope"), placement(Some(Runtime::Docker), false, None)),
            (format!("3:cpu,cpuacct:/docker/{ID}\n0::/\n"), placement(Some(Runtime::Docker), false, None)),
            (format!("0::/machine.slice/libpod-{ID}.scope/container"), placement(Some(Runtime::Podman), false, None)),
            (format!("0::/libpod_parent/libpod-{ID}"), placement(Some(Runtime::Podman), false, None)),
        ];
        for (proc_cgroup, expected) in cases {
            assert_eq!(placement_in(&proc_cgroup), expected, "{proc_cgroup}");
            assert!(expected.container_id.is_some());
        }
    }

    #[test]
    fn conmon_the_pods_own_cgroup_and_mounts_are_no_container() {
        let underscored = UID.replace('-', "_");
        let pod_only =
            |qos| Placement { pod_uid: Some(UID.to_owned()), qos: Some(qos), ..Placement::default() };
        let cases = [
            (
                format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{underscored}.slice/crio-conmon-{ID}.scope"),
                pod_only(Qos::Burstable),
            ),
            // The sandbox when its process sits in the pod's cgroup.
            (format!("0::/kubepods/besteffort/pod{UID}"), pod_only(Qos::BestEffort)),
            (format!("0::/kubepods.slice/kubepods-pod{underscored}.slice"), pod_only(Qos::Guaranteed)),
            (format!("0::/system.slice/var-lib-docker-overlay2-{ID}-merged.mount"), Placement::default()),
            ("0::/user.slice/user-0.slice/session-3.scope".to_owned(), Placement::default()),
            // The QoS slices are no pod.
            ("0::/kubepods.slice/kubepods-burstable.slice".to_owned(), Placement::default()),
            ("0::/kubepods/besteffort".to_owned(), Placement::default()),
        ];
        for (proc_cgroup, expected) in cases {
            let found = placement_in(&proc_cgroup);
            assert_eq!(found, expected, "{proc_cgroup}");
        }
    }

    /// A host root of the test's own.
    fn host_root(name: &str) -> PathBuf {
        let root = std::env::temp_dir().join(format!("memleak-host-root-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        root
    }

    fn write(root: &Path, path: &str, contents: &str) {
        let path = root.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, contents).unwrap();
    }

    #[test]
    fn names_come_from_containerds_and_crios_annotations() {
        let root = host_root("bundles");
        write(
            &root,
            &format!("run/containerd/io.containerd.runtime.v2.task/k8s.io/{ID}/config.json"),
            &format!(
                r#"{{"ociVersion":"1.1.0","annotations":{{"io.kubernetes.cri.container-type":"container",
                "io.kubernetes.cri.sandbox-name":"web-7d4b9","io.kubernetes.cri.sandbox-namespace":"shop",
                "io.kubernetes.cri.sandbox-uid":"{UID}","io.kubernetes.cri.container-name":"nginx",
                "io.kubernetes.cri.image-name":"docker.io/library/nginx:1.27"}}}}"#
            ),
        );
        let expected = Names {
            namespace: Some("shop".to_owned()),
            pod: Some("web-7d4b9".to_owned()),
            uid: Some(UID.to_owned()),
            container: Some("nginx".to_owned()),
            runtime: Some(Runtime::Containerd),
            sandbox: false,
        };
        assert_eq!(Names::under(&root, Some(Runtime::Containerd), ID, None), expected);
        // The cgroupfs driver does not say the runtime: the bundle does.
        assert_eq!(Names::under(&root, None, ID, None), expected);
        // Nor is CRI-O's bundle looked for under containerd's name.
        let other = ID.replace('3', "4");
        write(
            &root,
            &format!("run/containers/storage/overlay-containers/{other}/userdata/config.json"),
            &format!(
                r#"{{"annotations":{{"io.kubernetes.pod.name":"db-0","io.kubernetes.pod.namespace":"data",
                "io.kubernetes.pod.uid":"{UID}","io.kubernetes.container.name":"postgres",
                "io.kubernetes.cri-o.ContainerType":"container"}}}}"#
            ),
        );
        let crio = Names::under(&root, Some(Runtime::Crio), &other, None);
        assert_eq!(
            (crio.namespace.as_deref(), crio.pod.as_deref(), crio.container.as_deref(), crio.runtime),
            (Some("data"), Some("db-0"), Some("postgres"), Some(Runtime::Crio))
        );
        assert_eq!(Names::under(&root, Some(Runtime::Containerd), &other, None), Names::default());
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn the_sandbox_is_no_workload_and_bad_bundles_are_refused() {
        let root = host_root("sandbox");
        let path = format!("run/containerd/io.containerd.runtime.v2.task/k8s.io/{ID}/config.json");
        write(
            &root,
            &path,
            r#"{"annotations":{"io.kubernetes.cri.container-type":"sandbox","io.kubernetes.cri.sandbox-name":"web"}}"#,
        );
        assert!(Names::under(&root, None, ID, None).sandbox);
        let proc_cgroup = format!(
            "0::/kubepods.slice/kubepods-pod{}.slice/cri-containerd-{ID}.scope",
            UID.replace('-', "_")
        );
        let mut resolver =
            Resolver { host_root: root.clone(), node: Some("node-a".to_owned()), known: HashMap::new() };
        assert_eq!(resolver.workload_in(&proc_cgroup), None, "the pause container");
        // Over 1 MiB: not read, whatever it holds.
        let padding = " ".repeat(usize::try_from(BUNDLE_LIMIT).unwrap());
        write(
            &root,
            &path,
            &format!(r#"{{"annotations":{{"io.kubernetes.cri.sandbox-name":"web"}}}}{padding}"#),
        );
        assert_eq!(Names::under(&root, None, ID, None), Names::default());
        write(&root, &path, "{\"annotations\": [1, 2");
        assert_eq!(Names::under(&root, None, ID, None), Names::default());
        // A link out of the host root leads nowhere outside it.
        std::fs::remove_file(root.join(&path)).unwrap();
        std::os::unix::fs::symlink("/proc/self/status", root.join(&path)).unwrap();
        assert_eq!(Names::under(&root, None, ID, None), Names::default());
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn without_a_bundle_the_kubelets_log_names_are_read() {
        let root = host_root("logs");
        write(&root, &format!("var/log/containers/web-7d4b9_shop_nginx-{ID}.log"), "");
        write(&root, &format!("var/log/pods/shop_web-7d4b9_{UID}/nginx/0.log"), "");
        write(&root, "var/log/pods/shop_other_00000000-0000-0000-0000-000000000000/x/0.log", "");
        let expected = Names {
            namespace: Some("shop".to_owned()),
            pod: Some("web-7d4b9".to_owned()),
            uid: Some(UID.to_owned()),
            container: Some("nginx".to_owned()),
            runtime: None,
            sandbox: false,
        };
        assert_eq!(Names::under(&root, None, ID, None), expected);
        // With only the uid (from the cgroup) and the pods' directories.
        std::fs::remove_dir_all(root.join("var/log/containers")).unwrap();
        let from_uid = Names::under(&root, None, ID, Some(UID));
        assert_eq!(
            (from_uid.namespace.as_deref(), from_uid.pod.as_deref()),
            (Some("shop"), Some("web-7d4b9"))
        );
        assert_eq!(from_uid.container, None, "a pod's directory does not say which container has the id");
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn a_selection_matches_every_filter_given_and_the_whole_pod_name() {
        let filter = WorkloadFilter {
            namespaces: vec!["shop".to_owned(), "data".to_owned()],
            pod: Some("web-[0-9a-z]+".to_owned()),
            container_names: Vec::new(),
            host_root: PathBuf::from("/"),
        };
        let selection = Selection::new(filter.clone()).unwrap();
        let workload = |namespace: &str, pod: &str| Workload {
            namespace: Some(namespace.to_owned()),
            pod: Some(pod.to_owned()),
            container: Some("nginx".to_owned()),
            ..Workload::default()
        };
        assert!(selection.matches(&workload("shop", "web-7d4b9")));
        assert!(selection.matches(&workload("data", "web-0")));
        assert!(!selection.matches(&workload("other", "web-7d4b9")), "another namespace");
        assert!(!selection.matches(&workload("shop", "my-web-7d4b9")), "the whole name, not a part");
        assert!(!selection.matches(&Workload { pod: None, ..workload("shop", "x") }), "a pod not named");
        let by_container = Selection::new(WorkloadFilter {
            container_names: vec!["nginx".to_owned()],
            ..WorkloadFilter::default()
        })
        .unwrap();
        assert!(by_container.matches(&workload("any", "thing")));
        assert!(!by_container
            .matches(&Workload { container: Some("sidecar".to_owned()), ..workload("any", "x") }));
        let refused = Selection::new(WorkloadFilter { pod: Some("web-(".to_owned()), ..filter }).err();
        assert_eq!(refused.as_deref(), Some("--pod `web-(` is not a regular expression: unclosed group"));
    }

    #[test]
    fn a_containers_labels_are_those_of_kube_state_metrics() {
        let root = host_root("labels");
        write(&root, &format!("var/log/containers/web-7d4b9_shop_nginx-{ID}.log"), "");
        let mut resolver =
            Resolver { host_root: root.clone(), node: Some("node-a".to_owned()), known: HashMap::new() };
        let underscored = UID.replace('-', "_");
        let proc_cgroup = format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{underscored}.slice/cri-containerd-{ID}.scope");
        let workload = resolver.workload_in(&proc_cgroup).unwrap();
        let labels: Vec<(&str, &str)> = workload.labels().collect();
        let container_id = format!("containerd://{ID}");
        assert_eq!(
            labels,
            [
                ("namespace", "shop"),
                ("pod", "web-7d4b9"),
                ("container", "nginx"),
                ("uid", UID),
                ("container_id", container_id.as_str()),
                ("node", "node-a")
            ]
        );
        assert_eq!(resolver.workload_in("0::/user.slice/user-0.slice/session-3.scope"), None);
        std::fs::remove_dir_all(root).unwrap();
    }
}
