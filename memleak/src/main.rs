//! memleak: trace a process's outstanding allocations with eBPF uprobes
//! and report the call stacks that hold the most memory.
//!
//! The modules follow the data: `config` resolves the command line;
//! `process` and `attach` find what to probe; `bpf` loads the tracer and
//! reads its maps; `collect` turns them into snapshots; `symbolize` names
//! the frames; `report` and `output` write the reports. `session` holds a
//! run's state; `report_loop` drives it for the command line, `serve` for
//! the HTTP daemon, `top` for the live view.
//!
//! Exit codes: 0 when the run ended as asked (a closed stdout included),
//! 2 on any error, which is one line on stderr.

mod attach;
mod bpf;
mod cli;
mod clock;
mod collect;
mod config;
mod elf;
mod manuals;
mod model;
mod offline;
mod output;
mod process;
mod python;
mod report;
mod report_loop;
mod serve;
mod session;
mod stats;
mod status;
mod stop_signals;
mod symbolize;
mod top;
mod unwind;
mod watch;

use std::process::ExitCode;

use clap::Parser as _;

use config::Run;

fn main() -> ExitCode {
    // First of all: a stop signal during the start ends the run cleanly
    // once the tracer is loaded (see `stop_signals`).
    stop_signals::hold();
    // memleak's binary started again to outlive it: see `command_cgroup`.
    if let Some(exit) = process::command_cgroup::reaper_main() {
        return exit;
    }
    // memleak started by `cargo xtask dist` to write its man pages.
    if let Some(exit) = manuals::dist_files_main() {
        return exit;
    }
    let args = match cli::Args::try_parse() {
        Ok(args) => args,
        Err(error) if !error.use_stderr() => {
            // --help and --version: not errors.
            let _ = error.print();
            return ExitCode::SUCCESS;
        }
        Err(error) => {
            status::error(&cli::describe_error(&error));
            return ExitCode::from(2);
        }
    };
    let serving_verbosely = matches!(&args.action, Some(cli::Action::Serve(serve)) if serve.verbose);
    init_logging(args.verbose || serving_verbosely);
    let result = match config::resolve(args) {
        Ok(Run::Trace(config)) => trace(&config),
        Ok(Run::Report(config)) => {
            // Nothing to load: a signal ends it at once.
            stop_signals::release();
            offline::report(&config).map_err(anyhow::Error::from)
        }
        Ok(Run::Diff(config)) => {
            stop_signals::release();
            offline::diff(&config).map_err(anyhow::Error::from)
        }
        Ok(Run::Serve(config)) => serve(&config),
        Ok(Run::Top(config)) => top(&config),
        Err(message) => Err(anyhow::Error::msg(message)),
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

/// Logs are `memleak: LEVEL: message` lines on stderr: warnings, and with
/// -v memleak's own debug lines.
fn init_logging(verbose: bool) {
    env_logger::Builder::new()
        .filter_level(log::LevelFilter::Warn)
        .filter_module("memleak", if verbose { log::LevelFilter::Debug } else { log::LevelFilter::Warn })
        .format(|out, record| {
            use std::io::Write as _;
            let line = format!("memleak: {}: {}\n", record.level().as_str().to_lowercase(), record.args());
            out.write_all(line.as_bytes())
        })
        .init();
}

/// The runtime a command runs on: one thread, as the session is not
/// `Send`.
fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|error| anyhow::anyhow!("cannot start the runtime: {error}"))
}

fn trace(config: &config::TraceConfig) -> anyhow::Result<()> {
    Ok(runtime()?.block_on(report_loop::run(config))?)
}

fn top(config: &config::TopConfig) -> anyhow::Result<()> {
    Ok(runtime()?.block_on(top::run(config))?)
}

fn serve(config: &config::ServeConfig) -> anyhow::Result<()> {
    Ok(runtime()?.block_on(serve::run(config))?)
}
