//! One JSON object per report, one per line.

use std::io::{self, Write};

use super::{diff::Diff, CgroupTotal, Report};

pub fn render(report: &Report, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    serde_json::to_writer(&mut *out, report)?;
    writeln!(out)
}

pub fn render_diff(diff: &Diff, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    serde_json::to_writer(&mut *out, diff)?;
    writeln!(out)
}

pub fn render_cgroup_total(total: &CgroupTotal, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    serde_json::to_writer(&mut *out, total)?;
    writeln!(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::sample_report;

    #[test]
    fn json_has_the_documented_keys() {
        let mut out = Vec::new();
        render(&sample_report(10), &mut out).unwrap();
        assert!(out.ends_with(b"\n") && !out[..out.len() - 1].contains(&b'\n'), "one line");
        let value: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(value["pid"], 4242);
        assert_eq!(value["total_bytes"], 24_840);
        assert_eq!(value["total_allocations"], 7);
        let top = &value["stacks"][0];
        assert_eq!((top["bytes"].as_u64(), top["allocations"].as_u64()), (Some(24_576), Some(3)));
        let frame = &top["frames"][0];
        assert_eq!(frame["function"], "fibonacci");
        assert_eq!(frame["address"], "0x401009");
        assert_eq!(frame["offset"], 31);
        assert_eq!(frame["file"], "/src/leaker.c");
        assert_eq!(frame["line"], 9);
        assert_eq!(frame["inlined"], false);
        assert_eq!(frame["module"], "/app/leaker");
        assert_eq!(value["health"]["stacks_lost"], 1);
        assert_eq!(value["sample_rate"], 1);
        assert_eq!((top["delta_bytes"].as_i64(), top["growing_reports"].as_u64()), (Some(8192), Some(3)));
        assert_eq!(top["growth_per_report"].as_i64(), Some(8192));
        assert_eq!(value["stacks"][2]["delta_bytes"], serde_json::Value::Null, "a stack with no trend yet");
    }
}
