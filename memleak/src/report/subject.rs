//! Whom a report is about, as every title names it (the text header, a
//! flame graph's title, a diff's header, `memleak serve`'s page): the
//! process by its pid and its program, then the allocator probed in it,
//! `pid 4242 (/app/server) through /usr/lib/x86_64-linux-gnu/libc.so.6`;
//! or `the kernel`. The program comes first because it is what a reader
//! knows the process by: the allocator alone (libc, most of the time)
//! tells one process from another no better than the pid does.
//!
//! Names are escaped (`printable`): a program names itself.

use super::{diff::Side, printable, Report};

/// `pid P (PROGRAM) through ALLOCATOR`, or `the kernel`.
pub fn of(report: &Report) -> String {
    describe(report.pid, report.namespace_pid, &report.program, &report.allocator)
}

/// The same of one side of a diff.
pub fn of_side(side: &Side) -> String {
    describe(side.pid, side.namespace_pid, &side.program, &side.allocator)
}

/// `pid P (PROGRAM)`, or `the kernel`: for where the allocator is said
/// apart or not known.
pub fn process(pid: u32, namespace_pid: Option<u32>, program: &str) -> String {
    if pid == memleak_common::KERNEL_TGID {
        return "the kernel".to_owned();
    }
    // `pid N` is what a process whose executable could not be read is
    // called (`process::lifecycle::program`): no name to add.
    let unknown = program.is_empty() || program == format!("pid {pid}");
    let program = printable(program);
    match (unknown, namespace_pid) {
        (false, Some(inner)) => format!("pid {pid} ({program}, pid {inner} in its namespace)"),
        (false, None) => format!("pid {pid} ({program})"),
        (true, Some(inner)) => format!("pid {pid} (pid {inner} in its namespace)"),
        (true, None) => format!("pid {pid}"),
    }
}

fn describe(pid: u32, namespace_pid: Option<u32>, program: &str, allocator: &str) -> String {
    let process = process(pid, namespace_pid, program);
    if pid == memleak_common::KERNEL_TGID || allocator.is_empty() {
        process
    } else {
        format!("{process} through {}", printable(allocator))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::sample_report;

    #[test]
    fn a_process_is_named_by_pid_and_program_then_allocator() {
        let report = sample_report(1);
        assert_eq!(of(&report), "pid 4242 (/app/leaker) through /usr/lib/libc.so.6");
    }

    #[test]
    fn a_container_process_gives_its_pid_inside_too() {
        let mut report = sample_report(1);
        report.namespace_pid = Some(1);
        assert_eq!(of(&report), "pid 4242 (/app/leaker, pid 1 in its namespace) through /usr/lib/libc.so.6");
    }

    #[test]
    fn the_kernel_is_the_kernel() {
        let mut report = sample_report(1);
        report.pid = memleak_common::KERNEL_TGID;
        report.program = "kernel".to_owned();
        assert_eq!(of(&report), "the kernel");
    }

    #[test]
    fn a_program_that_could_not_be_read_is_not_named() {
        let mut report = sample_report(1);
        report.program = "pid 4242".to_owned();
        assert_eq!(of(&report), "pid 4242 through /usr/lib/libc.so.6");
    }

    #[test]
    fn names_are_escaped() {
        let mut report = sample_report(1);
        report.program = "/app/\x1b]0;x\x07".to_owned();
        report.allocator = "/lib/\nlibc.so".to_owned();
        assert_eq!(of(&report), "pid 4242 (/app/\\x1b]0;x\\x07) through /lib/\\nlibc.so");
    }
}
