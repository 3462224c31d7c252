//! The files a package installs besides the binary, made from the clap
//! definitions of `cli` by the binary itself: man pages (`clap_mangen`)
//! and shell completions (`clap_complete`). `cargo xtask dist` runs
//! `memleak __dist-files DIR`, so they describe exactly the binary they
//! ship with.
//!
//! An entry point of its own, read before clap (as the reaper's is), and
//! not a hidden subcommand: `clap_complete`'s bash and fish scripts would
//! offer a hidden subcommand to Tab.

use std::{
    fs,
    io::{self, Write as _},
    path::Path,
    process::ExitCode,
};

use clap::CommandFactory as _;
use clap_complete::Shell;

use crate::cli::Args;

/// The first argument that starts memleak as this generator.
const DIST_FILES: &str = "__dist-files";

/// Writes the man pages and completions, if memleak was started as
/// `memleak __dist-files DIR`; `None` otherwise.
pub fn dist_files_main() -> Option<ExitCode> {
    let mut args = std::env::args_os().skip(1);
    if args.next().as_deref() != Some(DIST_FILES.as_ref()) {
        return None;
    }
    let Some(directory) = args.next() else {
        crate::status::error(&format!("usage: memleak {DIST_FILES} DIRECTORY"));
        return Some(ExitCode::from(2));
    };
    match write_dist_files(Path::new(&directory)) {
        Ok(()) => Some(ExitCode::SUCCESS),
        Err(error) => {
            crate::status::error(&format!("cannot write the man pages and completions: {error}"));
            Some(ExitCode::from(2))
        }
    }
}

/// DIR/man/memleak.1 and one page per subcommand (memleak-serve.1...);
/// DIR/completions/memleak.bash, _memleak (zsh) and memleak.fish.
fn write_dist_files(directory: &Path) -> io::Result<()> {
    let man = directory.join("man");
    fs::create_dir_all(&man)?;
    // The manual is of the release; the commit and the BPF object's hash
    // are each build's (and a 64-digit word cannot be broken to fit).
    let mut command = Args::command().version(env!("CARGO_PKG_VERSION")).disable_help_subcommand(true);
    // Named memleak-serve and so on, as their pages are.
    command.build();
    for subcommand in command.get_subcommands() {
        write_man_page(subcommand.clone(), &man)?;
    }
    write_man_page(command, &man)?;
    let completions = directory.join("completions");
    fs::create_dir_all(&completions)?;
    for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
        let mut script = Vec::new();
        clap_complete::generate(shell, &mut Args::command(), "memleak", &mut script);
        let name = match shell {
            Shell::Zsh => "_memleak".to_owned(),
            _ => format!("memleak.{shell}"),
        };
        fs::File::create(completions.join(name))?.write_all(&script)?;
    }
    Ok(())
}

/// The page of `command`, as `clap_mangen` renders it but for the examples
/// of `after_help`: a section of their own, lines kept as written (as
/// after-help text they would be filled into a paragraph).
fn write_man_page(command: clap::Command, directory: &Path) -> io::Result<()> {
    let examples = command.get_after_help().map(ToString::to_string);
    let has_subcommands = command.has_subcommands();
    // Only memleak's own page: its subcommands take no --version.
    let has_version = command.get_version().is_some();
    let man = clap_mangen::Man::new(command.after_help(None::<&str>));
    let mut page = Vec::new();
    man.render_title(&mut page)?;
    man.render_name_section(&mut page)?;
    man.render_synopsis_section(&mut page)?;
    man.render_description_section(&mut page)?;
    man.render_options_section(&mut page)?;
    if has_subcommands {
        man.render_subcommands_section(&mut page)?;
    }
    if let Some(examples) = examples {
        writeln!(page, ".SH EXAMPLES\n.nf")?;
        for line in examples.lines().filter(|line| *line != "Examples:") {
            writeln!(page, "{}", roff_text(line))?;
        }
        writeln!(page, ".fi")?;
    }
    if has_version {
        man.render_version_section(&mut page)?;
    }
    fs::write(directory.join(man.get_filename()), page)
}

/// A line of text as roff prints it: backslashes and hyphens escaped, and
/// a leading dot or quote not taken for a request.
fn roff_text(line: &str) -> String {
    let escaped = line.replace('\\', "\\e").replace('-', "\\-").replace('\'', "\\(aq");
    if escaped.starts_with('.') {
        format!("\\&{escaped}")
    } else {
        escaped
    }
}
