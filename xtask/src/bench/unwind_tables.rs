//! What memleak's unwind tables take for real programs: Debian's python3
//! with a few extension modules loaded (about 14 objects), and an idle
//! redis-server. memleak builds a process's table from its objects'
//! `.eh_frame` when it attaches, so this is a start-up time and kernel
//! memory, paid once per process, not a cost per allocation. The numbers
//! are memleak's own --stats records, which time the table apart from the
//! verifier and the rest of the start.

use std::{
    io::{self, BufReader},
    net::TcpListener,
    path::Path,
    process::{Child, Command, Stdio},
    thread,
};

use anyhow::{bail, Context as _, Result};

use super::{
    process::{run_to_end, wait_for_line},
    stats::{Record, Started, UnwindTables},
};

/// Building a program's tables should take less than this, in ms: it
/// delays tracing a process memleak attaches to.
const BUILD_GOAL_MS: f64 = 500.0;

/// The programs measured.
#[derive(Clone, Copy)]
enum Program {
    Python,
    Redis,
}

const PROGRAMS: [Program; 2] = [Program::Python, Program::Redis];

/// Imports a few modules with C extensions, says so, then idles until its
/// stdin closes. Debian's own python3, by path: a python3 earlier in PATH
/// (pyenv's, say) would be another program.
const PYTHON_SCRIPT: &str =
    "import ctypes, json, sqlite3, ssl, sys; print('ready', flush=True); sys.stdin.read()";

impl Program {
    fn name(self) -> &'static str {
        match self {
            Program::Python => "python3",
            Program::Redis => "redis-server",
        }
    }

    /// Starts the program and waits until it has mapped what it will map
    /// and idles.
    fn start(self, scratch: &Path) -> Result<Running> {
        match self {
            Program::Python => {
                let mut command = Command::new("/usr/bin/python3");
                command.args(["-c", PYTHON_SCRIPT]).stdin(Stdio::piped());
                Running::start(command, "ready")
            }
            Program::Redis => RedisServer::start(scratch).map(|server| server.running),
        }
    }
}

/// A redis-server the bench started, on a port of its own, saving nothing.
pub struct RedisServer {
    running: Running,
    port: u16,
}

impl RedisServer {
    pub fn start(scratch: &Path) -> Result<Self> {
        let port = free_port()?;
        let mut command = Command::new("redis-server");
        command.args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]);
        // Where a redis-server would write its files, were it asked to.
        command.current_dir(scratch).stdin(Stdio::null());
        Ok(Self { running: Running::start(command, "Ready to accept connections")?, port })
    }

    pub fn pid(&self) -> u32 {
        self.running.pid()
    }

    pub fn port(&self) -> u16 {
        self.port
    }
}

/// A TCP port on 127.0.0.1 that nothing listened on a moment ago.
fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("cannot find a free port")?;
    Ok(listener.local_addr()?.port())
}

/// A program the bench started: killed and reaped when dropped, however
/// the measurement went, for none to outlive the bench.
struct Running(Child);

impl Running {
    /// Spawns `command` and waits for `ready` on its stdout, which is then
    /// drained, for the program never to block on a full pipe.
    fn start(mut command: Command, ready: &str) -> Result<Self> {
        command.stdout(Stdio::piped()).stderr(Stdio::null());
        let program = command.get_program().to_string_lossy().into_owned();
        let mut running = Self(command.spawn().with_context(|| format!("cannot run {program}"))?);
        let mut stdout = BufReader::new(running.0.stdout.take().context("no stdout")?);
        wait_for_line(&mut stdout, ready).with_context(|| format!("{program} did not start"))?;
        thread::spawn(move || io::copy(&mut stdout, &mut io::sink()));
        Ok(running)
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // Our own child: killing it cannot hit anything else.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One program's row: what memleak said as it attached, or why nothing.
pub struct Row {
    program: &'static str,
    measured: Result<Measured>,
}

struct Measured {
    started: Started,
    tables: UnwindTables,
}

/// Measures each program in turn; a failure is shown in its row, not
/// fatal, as the tables are informative.
pub fn measure_all(memleak: &Path, scratch: &Path) -> Vec<Row> {
    PROGRAMS
        .iter()
        .map(|&program| {
            eprintln!("bench: unwind tables of {}", program.name());
            Row { program: program.name(), measured: measure(memleak, scratch, program) }
        })
        .collect()
}

/// Starts `program`, attaches memleak to it for one report a second later,
/// and reads memleak's --stats records of its start.
fn measure(memleak: &Path, scratch: &Path, program: Program) -> Result<Measured> {
    let running = program.start(scratch)?;
    let pid = running.pid();
    let stats = scratch.join(format!("unwind-tables-{}.jsonl", program.name()));
    let mut command = Command::new(memleak);
    command.args(["-p", &pid.to_string(), "--stats"]).arg(&stats).args(["1", "1"]);
    run_to_end(&mut command)?;
    drop(running);
    let records = std::fs::read_to_string(&stats)
        .with_context(|| format!("cannot read memleak's --stats file {}", stats.display()))?;
    Measured::read(&records, pid)
}

impl Measured {
    /// The start record, and the unwind tables record of process `pid`.
    fn read(records: &str, pid: u32) -> Result<Self> {
        let (mut started, mut tables) = (None, None);
        for line in records.lines() {
            match Record::parse(line)? {
                Record::Started(record) => started = started.or(Some(record)),
                Record::UnwindTables(record) if record.pid == pid => tables = tables.or(Some(record)),
                _ => {}
            }
        }
        let (Some(started), Some(tables)) = (started, tables) else {
            bail!("memleak's --stats file has no started and unwind_tables records for pid {pid}")
        };
        Ok(Self { started, tables })
    }
}

pub fn print(rows: &[Row]) {
    println!();
    println!(
        "unwind tables of real programs, from memleak's --stats as it attached with -p (BPF memory: the \
         rows' share of memleak's row map, which --max-unwind-rows sizes and the kernel allocates whole; \
         start: until tracing began, tables included):"
    );
    println!();
    println!("| program | objects | rows | BPF memory | table build | memleak load | start |");
    println!("|---|---|---|---|---|---|---|");
    for row in rows {
        match &row.measured {
            Ok(Measured { started, tables }) => println!(
                "| {} | {} | {} | {} | {:.0} ms | {:.0} ms | {:.0} ms |",
                row.program,
                objects(tables),
                tables.rows_in_use,
                bytes(tables.row_bytes),
                tables.build_ms,
                started.load_ms,
                started.start_ms
            ),
            Err(error) => println!("| {} | failed: {error:#} | | | | | |", row.program),
        }
    }
    println!();
    print_goal(rows);
}

/// The objects, and those the table does not cover, if any.
fn objects(tables: &UnwindTables) -> String {
    let mut left_out = Vec::new();
    if tables.objects_without_rows > 0 {
        left_out.push(format!("{} without rows", tables.objects_without_rows));
    }
    if tables.objects_not_fitting > 0 {
        left_out.push(format!("{} not fitting", tables.objects_not_fitting));
    }
    if left_out.is_empty() {
        tables.objects.to_string()
    } else {
        format!("{} ({})", tables.objects, left_out.join(", "))
    }
}

fn bytes(bytes: u64) -> String {
    let kib = bytes as f64 / 1024.0;
    if kib >= 1024.0 {
        format!("{:.1} MiB", kib / 1024.0)
    } else {
        format!("{kib:.0} KiB")
    }
}

/// "building the tables under 500 ms each: met (python3 120 ms, ...)".
fn print_goal(rows: &[Row]) {
    let what = format!("building each program's unwind tables under {BUILD_GOAL_MS:.0} ms");
    let measured: Vec<(&str, f64)> = rows
        .iter()
        .filter_map(|row| Some((row.program, row.measured.as_ref().ok()?.tables.build_ms)))
        .collect();
    if measured.len() < rows.len() {
        println!("{what}: not measured for every program");
        return;
    }
    let met = measured.iter().all(|(_, build_ms)| *build_ms < BUILD_GOAL_MS);
    let times: Vec<String> =
        measured.iter().map(|(program, build_ms)| format!("{program} {build_ms:.0} ms")).collect();
    println!("{what}: {} ({})", if met { "met" } else { "missed" }, times.join(", "));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_records_of_the_traced_process() {
        let records = r#"{"event":"started","load_ms":800.0,"start_ms":1000.0}
{"event":"unwind_tables","pid":8,"objects":3,"new_objects":3,"new_rows":10,"build_ms":1.0,"rows_in_use":10,"row_bytes":80,"objects_without_rows":0,"objects_not_fitting":0}
{"event":"unwind_tables","pid":7,"objects":14,"new_objects":14,"new_rows":190000,"build_ms":120.0,"rows_in_use":190010,"row_bytes":1520080,"objects_without_rows":1,"objects_not_fitting":0}"#;
        let measured = Measured::read(records, 7).expect("both records");
        assert_eq!((measured.tables.objects, measured.tables.rows_in_use), (14, 190_010));
        assert_eq!(objects(&measured.tables), "14 (1 without rows)");
        assert_eq!(bytes(measured.tables.row_bytes), "1.4 MiB");
        assert_eq!(bytes(80), "0 KiB");
        assert!(Measured::read(records, 9).is_err(), "found records for a process not traced");
    }
}
