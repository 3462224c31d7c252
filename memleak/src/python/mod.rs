//! Python frames in allocation stacks (issue 23): what a frame record of
//! the interpreter (code object address, instruction) says, read from the
//! live process: `code` reads code objects and caches them per process,
//! `line_table` turns an instruction into its line.

// Wired into the tracer in the next step of issue 23; until then nothing
// in the binary calls it.
#![allow(dead_code, reason = "wired into the tracer in the next step of issue 23")]

pub mod code;
#[cfg(test)]
mod interpreter_tests;
pub mod line_table;
