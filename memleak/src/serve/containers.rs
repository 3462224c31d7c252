//! `serve --container REFERENCE`: whatever container the reference names
//! now and later. A container removed and run again under the same name
//! (a redeploy) has another id and another cgroup: it is found again by
//! its name and followed there. One not running yet is waited for. A
//! container restarted keeps its cgroup's path, which the session
//! follows by itself.
//!
//! The followed cgroups are checked every `LOOK`: a `stat` each while
//! they are there. Only while one is missing is the cgroup tree listed,
//! and the runtime (`podman inspect`) asked only when the containers
//! listed have changed since it was last asked: a container waited for
//! long costs a directory walk a second, not a process.

use std::{path::Path, time::Duration};

use crate::{
    process::container::{self, ContainerCgroup, ContainerError},
    session::{Selector, Session},
    status,
    watch::Scope,
};

/// How often the containers followed are checked for.
pub const LOOK: Duration = Duration::from_secs(1);

/// The containers named by --container, each followed where it runs.
pub struct FollowedContainers {
    watched: Vec<Watched>,
    /// The ids of the containers running when the runtime was last asked
    /// for the missing ones: until they change, its answer would too.
    asked_among: Option<Vec<String>>,
}

/// One --container reference.
struct Watched {
    reference: String,
    /// The container followed: while `present`, the one running; after,
    /// the last one run, whose cgroup the session still holds.
    followed: Option<ContainerCgroup>,
    present: bool,
    /// The last failure to find it, said once.
    failure_said: Option<String>,
}

impl FollowedContainers {
    /// Finds each reference's container now: the selectors of those
    /// running, and one that waits for those not running yet (each said
    /// once). A reference that cannot name a container, one that names
    /// several, or a host with no cgroup v2 ends the start with the reason.
    pub fn start(references: &[String]) -> Result<(Self, Vec<Selector>), ContainerError> {
        let mut watched = Vec::new();
        let mut selectors = Vec::new();
        for reference in references {
            let mut one =
                Watched { reference: reference.clone(), followed: None, present: false, failure_said: None };
            match container::find(reference) {
                Ok(mut found) => {
                    found.path = canonical(&found.path);
                    one.say_following(&found);
                    selectors.push(Selector::Cgroup(found.path.clone()));
                    one.followed = Some(found);
                    one.present = true;
                }
                Err(ContainerError::NotFound(..)) => {
                    status::say(&format!(
                        "waiting for container {reference}: none of that name or id runs yet"
                    ));
                    if !selectors.contains(&Selector::CgroupToCome) {
                        selectors.push(Selector::CgroupToCome);
                    }
                }
                Err(error) => return Err(error),
            }
            watched.push(one);
        }
        Ok((Self { watched, asked_among: None }, selectors))
    }

    /// Whether any container is followed, and so looked for every `LOOK`.
    pub fn any(&self) -> bool {
        !self.watched.is_empty()
    }

    /// Notices the containers followed that are gone, and has the session
    /// follow those found again (or for the first time) from now on; the
    /// session takes their processes in at its next refresh. Nothing here
    /// ends the daemon: a container not found is looked for again.
    pub fn look(&mut self, follower: &mut dyn CgroupFollower) {
        for one in &mut self.watched {
            let gone = one.present && one.followed.as_ref().is_some_and(|followed| !followed.path.is_dir());
            if gone {
                one.present = false;
                let named = one
                    .followed
                    .as_ref()
                    .map_or_else(|| one.reference.clone(), |followed| one.named(followed));
                status::say(&format!(
                    "container {named} is gone: waiting for a container {} to run",
                    one.reference
                ));
            }
        }
        if self.watched.iter().all(|one| one.present) {
            return;
        }
        let running = container::running();
        let ids: Vec<String> = running.iter().map(|found| found.id.clone()).collect();
        if self.asked_among.as_ref() == Some(&ids) {
            return;
        }
        self.asked_among = Some(ids);
        for one in self.watched.iter_mut().filter(|one| !one.present) {
            let found = match container::find_among(&one.reference, &running) {
                Ok(Some(mut found)) => {
                    found.path = canonical(&found.path);
                    found
                }
                Ok(None) => continue,
                Err(error) => {
                    one.say_failure(&error.to_string());
                    continue;
                }
            };
            let instead_of = one.followed.as_ref().map(|followed| followed.path.as_path());
            match follower.follow_cgroup(&found.path, instead_of) {
                Ok(()) => {
                    one.say_following(&found);
                    one.followed = Some(found);
                    one.present = true;
                    one.failure_said = None;
                }
                Err(error) => {
                    // Gone again already, say: the next change of the
                    // containers running has it looked for again.
                    one.say_failure(&format!("cannot follow container {}: {error}", one.reference));
                }
            }
        }
    }
}

/// What a container found is given to: the session, which traces its
/// processes, or a watch (`serve --watch`), which watches them.
pub trait CgroupFollower {
    fn follow_cgroup(&mut self, path: &Path, instead_of: Option<&Path>) -> Result<(), String>;
}

impl CgroupFollower for Session {
    fn follow_cgroup(&mut self, path: &Path, instead_of: Option<&Path>) -> Result<(), String> {
        Session::follow_cgroup(self, path, instead_of).map_err(|error| error.to_string())
    }
}

impl CgroupFollower for Scope {
    fn follow_cgroup(&mut self, path: &Path, instead_of: Option<&Path>) -> Result<(), String> {
        Scope::follow_cgroup(self, path, instead_of);
        Ok(())
    }
}

impl Watched {
    /// The container as said: its short id, after the reference when
    /// that is a name.
    fn named(&self, found: &ContainerCgroup) -> String {
        let short = container::short_id(&found.id);
        if found.id.starts_with(&self.reference.to_ascii_lowercase()) {
            short.to_owned()
        } else {
            format!("{} ({short})", self.reference)
        }
    }

    fn say_following(&self, found: &ContainerCgroup) {
        status::say(&format!("following container {}: cgroup {}", self.named(found), found.path.display()));
    }

    fn say_failure(&mut self, message: &str) {
        if self.failure_said.as_deref() != Some(message) {
            log::warn!("{message}");
            self.failure_said = Some(message.to_owned());
        }
    }
}

/// The path as the kernel names it, as the session keeps cgroups: the one
/// to be replaced is found by it.
fn canonical(path: &Path) -> std::path::PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}
