//! The connections `memleak serve` holds, and which one gives way when it
//! holds as many as it may. Prometheus must always get its scrape, so a
//! client that sends nothing never holds a place a scraper needs:
//!
//! - A connection is either waiting for a request's head (just accepted,
//!   sending a head slowly, or kept alive between requests) or busy with
//!   a request whose head has arrived, until its response is sent.
//! - A head must arrive within `HEAD_DEADLINE` of the wait's start, or the
//!   connection is closed: a slowloris sending a byte now and then is
//!   dropped as one sending nothing.
//! - When every place is taken, the connection that has waited longest
//!   is closed for the newcomer at once; admission never waits. One
//!   whose request has arrived but was not read yet (bytes wait in its
//!   socket) is not closed: a burst of newcomers cannot push out a
//!   scraper before its request is read. Only if no connection can give
//!   way is the newcomer closed: busy connections are few and short, as
//!   each endpoint answers at once or refuses (a report's query, a
//!   window; see `reports`).
//! - How many places there are follows the descriptor limit
//!   (`RLIMIT_NOFILE`), leaving half of what is free to the tracer.

use std::{
    collections::{BTreeSet, HashMap},
    os::fd::RawFd,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use tokio::{sync::Notify, time::Instant};

use super::query;

/// How long a connection may wait for a request's head: from its accept,
/// or from the end of its last response when kept alive. A client sends
/// a head in one packet; a scraper kept alive between scrapes is closed
/// and comes back on a new connection, as HTTP clients do.
pub const HEAD_DEADLINE: Duration = Duration::from_secs(5);

/// How long a request may take once its head has arrived: the longest
/// `?seconds=N` window, and its report.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(query::MAX_WINDOW.as_secs() + 30);

/// Connections held at most, however many descriptors there are: each
/// holds a read buffer of up to 8 KiB.
const MOST_CONNECTIONS: usize = 1024;

/// Connections held at least, however few descriptors seem free.
const FEWEST_CONNECTIONS: usize = 8;

/// How many connections may be held with the descriptor limit as it is:
/// half the descriptors that the soft `RLIMIT_NOFILE` leaves free now,
/// the other half for the tracer's links and maps of processes to come.
pub fn limit_from_descriptors() -> usize {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct passed, alive for the call.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut limit) } == 0 {
        usize::try_from(limit.rlim_cur).unwrap_or(usize::MAX)
    } else {
        1024
    };
    let open = std::fs::read_dir("/proc/self/fd").map_or(0, Iterator::count);
    limit_for(soft, open)
}

/// Connections held at most with a soft descriptor limit of `soft`, of
/// which `open` are open.
fn limit_for(soft: usize, open: usize) -> usize {
    (soft.saturating_sub(open) / 2).clamp(FEWEST_CONNECTIONS, MOST_CONNECTIONS)
}

/// What a connection is doing, and since when.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Waiting for a request's head.
    Waiting { since: Instant },
    /// Answering a request.
    Busy { since: Instant },
}

/// How long a connection may stay in each state.
#[derive(Clone, Copy, Debug)]
pub struct Deadlines {
    /// For a request's head to arrive (`HEAD_DEADLINE`).
    pub head: Duration,
    /// For a request to be answered (`REQUEST_DEADLINE`).
    pub request: Duration,
}

impl Deadlines {
    pub const SERVED: Deadlines = Deadlines { head: HEAD_DEADLINE, request: REQUEST_DEADLINE };

    fn of(self, state: State) -> Instant {
        match state {
            State::Waiting { since } => since + self.head,
            State::Busy { since } => since + self.request,
        }
    }
}

struct Slot {
    state: State,
    /// The connection's socket, to see whether a request waits in it.
    socket: RawFd,
    /// Wakes the connection's task to look at its slot again: changed,
    /// or gone (the connection was closed for a newcomer).
    wake: Arc<Notify>,
}

struct Table {
    slots: HashMap<u64, Slot>,
    /// The connections waiting for a request, longest waiting first: a
    /// newcomer makes room without a look at every connection held.
    waiting: BTreeSet<(Instant, u64)>,
    next_id: u64,
    limit: usize,
    deadlines: Deadlines,
}

impl Table {
    fn insert(&mut self, id: u64, slot: Slot) {
        if let State::Waiting { since } = slot.state {
            self.waiting.insert((since, id));
        }
        self.slots.insert(id, slot);
    }

    fn remove(&mut self, id: u64) -> Option<Slot> {
        let slot = self.slots.remove(&id)?;
        if let State::Waiting { since } = slot.state {
            self.waiting.remove(&(since, id));
        }
        Some(slot)
    }

    fn set_state(&mut self, id: u64, state: State) {
        if let Some(mut slot) = self.remove(id) {
            slot.state = state;
            slot.wake.notify_one();
            self.insert(id, slot);
        }
    }

    /// Closes the connection that has waited longest for a request and
    /// has none waiting to be read: its slot goes, and its task is woken
    /// to drop it.
    fn evict_longest_waiting(&mut self) -> bool {
        let slots = &self.slots;
        let unread = |id: &u64| slots.get(id).is_some_and(|slot| has_unread_bytes(slot.socket));
        let Some(id) = self.waiting.iter().map(|&(_, id)| id).find(|id| !unread(id)) else {
            return false;
        };
        let Some(slot) = self.remove(id) else { return false };
        slot.wake.notify_one();
        true
    }
}

/// The connections held, shared by the accept loop and every
/// connection's task.
#[derive(Clone)]
pub struct Connections {
    table: Arc<Mutex<Table>>,
}

impl Connections {
    pub fn new(limit: usize, deadlines: Deadlines) -> Self {
        let table = Table { slots: HashMap::new(), waiting: BTreeSet::new(), next_id: 0, limit, deadlines };
        Self { table: Arc::new(Mutex::new(table)) }
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        // Nothing panics while holding the lock; were it poisoned, the
        // table is still whole (each change is one map operation).
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes in a connection just accepted, waiting for its first
    /// request: into a free place, else into that of the connection that
    /// has waited longest, which is closed. `None` when every connection
    /// held is answering a request.
    pub fn admit(&self, socket: RawFd) -> Option<Admitted> {
        let mut table = self.table();
        if table.slots.len() >= table.limit && !table.evict_longest_waiting() {
            return None;
        }
        let id = table.next_id;
        table.next_id += 1;
        let wake = Arc::new(Notify::new());
        let state = State::Waiting { since: Instant::now() };
        table.insert(id, Slot { state, socket, wake: wake.clone() });
        Some(Admitted { handle: Handle { id, wake, connections: self.clone() } })
    }

    /// Closes the connection that has waited longest for a request, if
    /// any: a descriptor for a newcomer when there were none left.
    pub fn evict_longest_waiting(&self) -> bool {
        self.table().evict_longest_waiting()
    }

    /// The connection's state and when it ends, if it is still held.
    fn state(&self, id: u64) -> Option<(State, Instant)> {
        let table = self.table();
        table.slots.get(&id).map(|slot| (slot.state, table.deadlines.of(slot.state)))
    }

    fn set_state(&self, id: u64, state: State) {
        self.table().set_state(id, state);
    }

    fn remove(&self, id: u64) {
        self.table().remove(id);
    }

    #[cfg(test)]
    fn held(&self) -> usize {
        self.table().slots.len()
    }
}

/// Whether bytes sent by the peer wait in `socket`, unread: a request's
/// head, or part of one. The descriptor belongs to a connection in the
/// table, open for as long as its slot is.
fn has_unread_bytes(socket: RawFd) -> bool {
    let mut unread: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int, to a local alive for the call.
    let result = unsafe { libc::ioctl(socket, libc::FIONREAD, &raw mut unread) };
    result == 0 && unread > 0
}

/// What names a connection's slot, for the requests it serves.
#[derive(Clone)]
pub struct Handle {
    id: u64,
    wake: Arc<Notify>,
    connections: Connections,
}

impl Handle {
    /// Marks the connection busy with a request until the mark is
    /// dropped (with the response's body, once sent): meanwhile it is not
    /// closed for a newcomer.
    pub fn busy(&self) -> Busy {
        self.connections.set_state(self.id, State::Busy { since: Instant::now() });
        Busy { handle: self.clone() }
    }
}

/// A connection answering a request; dropped, it waits for the next one.
pub struct Busy {
    handle: Handle,
}

impl Drop for Busy {
    fn drop(&mut self) {
        let Handle { id, connections, .. } = &self.handle;
        connections.set_state(*id, State::Waiting { since: Instant::now() });
    }
}

/// Why a connection is closed by memleak.
#[derive(Debug, PartialEq, Eq)]
pub enum Closing {
    /// It waited for a request's head longer than `HEAD_DEADLINE`.
    NoRequest,
    /// A request took longer than any is given.
    RequestTooLong,
    /// Every place was taken, and it had waited longest.
    MadeRoom,
}

/// A connection admitted; its slot goes with it.
pub struct Admitted {
    handle: Handle,
}

impl Admitted {
    pub fn handle(&self) -> Handle {
        self.handle.clone()
    }

    /// Resolves when the connection is to be closed, and says why.
    pub async fn closing(&self) -> Closing {
        let Handle { id, wake, connections } = &self.handle;
        loop {
            let Some((state, deadline)) = connections.state(*id) else { return Closing::MadeRoom };
            if deadline <= Instant::now() {
                return match state {
                    State::Waiting { .. } => Closing::NoRequest,
                    State::Busy { .. } => Closing::RequestTooLong,
                };
            }
            // A wake stored before this wait is not lost: Notify keeps one.
            tokio::select! {
                () = wake.notified() => {}
                () = tokio::time::sleep_until(deadline) => {}
            }
        }
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.handle.connections.remove(self.handle.id);
    }
}

#[cfg(test)]
mod tests {
    use std::{
        io::Write as _,
        os::{fd::AsRawFd as _, unix::net::UnixStream},
    };

    use super::*;

    /// Deadlines short enough for a test; waits are checked to last at
    /// least as long, never at most.
    const SHORT: Deadlines =
        Deadlines { head: Duration::from_millis(50), request: Duration::from_millis(200) };

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_time().build().expect("a runtime")
    }

    /// A connected socket, and its peer (the client).
    fn socket() -> (UnixStream, UnixStream) {
        UnixStream::pair().expect("a socket pair")
    }

    #[test]
    fn a_newcomer_takes_the_place_of_the_connection_that_waited_longest() {
        runtime().block_on(async {
            let sockets: Vec<_> = (0..4).map(|_| socket()).collect();
            let connections = Connections::new(2, Deadlines::SERVED);
            let oldest = connections.admit(sockets[0].0.as_raw_fd()).expect("a free place");
            tokio::time::sleep(Duration::from_millis(2)).await;
            let younger = connections.admit(sockets[1].0.as_raw_fd()).expect("a free place");
            let newcomer = connections.admit(sockets[2].0.as_raw_fd()).expect("the oldest makes room");
            assert_eq!(oldest.closing().await, Closing::MadeRoom);
            assert_eq!(connections.held(), 2);
            // Busy connections are not closed for newcomers.
            let _busy = (younger.handle().busy(), newcomer.handle().busy());
            assert!(connections.admit(sockets[3].0.as_raw_fd()).is_none(), "every connection held is busy");
            drop(oldest);
            assert_eq!(connections.held(), 2, "an evicted connection's slot went with its eviction");
        });
    }

    #[test]
    fn the_limit_is_half_the_free_descriptors_within_bounds() {
        // The usual soft limit, with a daemon's ~90 descriptors open.
        assert_eq!(limit_for(1024, 90), 467);
        assert_eq!(limit_for(1 << 20, 90), MOST_CONNECTIONS);
        assert_eq!(limit_for(100, 95), FEWEST_CONNECTIONS);
    }

    #[test]
    fn a_connection_kept_alive_waits_from_its_last_response() {
        runtime().block_on(async {
            let sockets: Vec<_> = (0..3).map(|_| socket()).collect();
            let connections = Connections::new(2, Deadlines::SERVED);
            let first = connections.admit(sockets[0].0.as_raw_fd()).expect("a free place");
            tokio::time::sleep(Duration::from_millis(2)).await;
            let second = connections.admit(sockets[1].0.as_raw_fd()).expect("a free place");
            tokio::time::sleep(Duration::from_millis(2)).await;
            // The first answers a request: its wait starts again after.
            drop(first.handle().busy());
            let _newcomer = connections.admit(sockets[2].0.as_raw_fd()).expect("the second makes room");
            assert_eq!(second.closing().await, Closing::MadeRoom);
            let state = connections.state(first.handle.id).map(|(state, _)| state);
            assert!(matches!(state, Some(State::Waiting { .. })), "the first is held: {state:?}");
        });
    }

    #[test]
    fn a_connection_whose_request_waits_unread_is_not_closed_for_a_newcomer() {
        runtime().block_on(async {
            let (scraper_socket, mut scraper) = socket();
            let (idle, _idle_client) = socket();
            let (newcomer, _newcomer_client) = socket();
            let connections = Connections::new(2, Deadlines::SERVED);
            let held = connections.admit(scraper_socket.as_raw_fd()).expect("a free place");
            tokio::time::sleep(Duration::from_millis(2)).await;
            let silent = connections.admit(idle.as_raw_fd()).expect("a free place");
            scraper.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").expect("a request sent");
            let _newcomer = connections.admit(newcomer.as_raw_fd()).expect("the silent one makes room");
            assert_eq!(silent.closing().await, Closing::MadeRoom);
            let state = connections.state(held.handle.id).map(|(state, _)| state);
            assert!(
                matches!(state, Some(State::Waiting { .. })),
                "the scraper's connection is held: {state:?}"
            );
        });
    }

    #[test]
    fn a_connection_waits_for_a_head_only_so_long_and_again_after_each_response() {
        runtime().block_on(async {
            let (socket, _client) = socket();
            let connections = Connections::new(4, SHORT);
            let admitted = connections.admit(socket.as_raw_fd()).expect("a free place");
            let start = Instant::now();
            assert_eq!(admitted.closing().await, Closing::NoRequest);
            assert!(start.elapsed() >= SHORT.head);

            let admitted = connections.admit(socket.as_raw_fd()).expect("a free place");
            let busy = admitted.handle().busy();
            tokio::time::sleep(SHORT.head * 2).await;
            // Kept alive: the wait for the next head starts with the
            // response's end, not with the connection.
            drop(busy);
            let kept_alive = Instant::now();
            assert_eq!(admitted.closing().await, Closing::NoRequest);
            assert!(kept_alive.elapsed() >= SHORT.head);
        });
    }

    #[test]
    fn a_request_is_given_its_deadline_and_no_more() {
        runtime().block_on(async {
            let (socket, _client) = socket();
            let connections = Connections::new(1, SHORT);
            let admitted = connections.admit(socket.as_raw_fd()).expect("a free place");
            let _busy = admitted.handle().busy();
            let start = Instant::now();
            assert_eq!(admitted.closing().await, Closing::RequestTooLong);
            assert!(start.elapsed() >= SHORT.request);
        });
    }
}
