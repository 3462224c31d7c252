//! memleak: trace a process's outstanding allocations with eBPF uprobes
//! and report the call stacks that hold the most memory.

mod allocator;
mod cgroup;
mod cli;
mod collector;
mod events;
mod kernel_btf;
mod mappings;
mod model;
mod offline;
mod probe_placement;
mod report;
mod session;
mod status;
mod symbolize;
mod target;
mod tracer;
mod trend;

use std::process::ExitCode;

use clap::Parser as _;

fn main() -> ExitCode {
    let mut args = match cli::Args::try_parse() {
        Ok(args) => args,
        Err(error) if !error.use_stderr() => {
            // --help and --version: not errors.
            let _ = error.print();
            return ExitCode::SUCCESS;
        }
        Err(error) => {
            // clap says what is wrong before its first blank line (sometimes
            // over two lines); the usage hint after it is noise.
            let rendered = error.render().to_string();
            let message: Vec<&str> =
                rendered.lines().take_while(|line| !line.trim().is_empty()).map(str::trim).collect();
            status::error(&message.join(" ").trim_start_matches("error: ").replace('\'', "`"));
            return ExitCode::from(2);
        }
    };
    env_logger::Builder::new()
        .filter_level(log::LevelFilter::Warn)
        .filter_module("memleak", if args.verbose { log::LevelFilter::Debug } else { log::LevelFilter::Warn })
        .format(|out, record| {
            use std::io::Write as _;
            let line = format!("memleak: {}: {}\n", record.level().as_str().to_lowercase(), record.args());
            out.write_all(line.as_bytes())
        })
        .init();
    let result = match args.offline.take() {
        Some(offline) => offline::run(offline),
        None => trace(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // Every error names its own cause, so the chain is not repeated.
            status::error(&error.to_string());
            ExitCode::from(2)
        }
    }
}

fn trace(args: cli::Args) -> anyhow::Result<()> {
    args.validate().map_err(anyhow::Error::msg)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|error| anyhow::anyhow!("cannot start the runtime: {error}"))?;
    runtime.block_on(session::run(args))
}
