//! Status lines on stderr. Each goes out in one write: stderr is shared
//! with a -c command, and a line written piecemeal (as `eprintln!` does)
//! can be cut in two by the command's own output.

use std::io::Write as _;

/// `memleak: MESSAGE`
pub fn say(message: &str) {
    write_line(&format!("memleak: {message}\n"));
}

/// `memleak: error: MESSAGE`
pub fn error(message: &str) {
    write_line(&format!("memleak: error: {}\n", message.trim()));
}

fn write_line(line: &str) {
    // Nothing sensible is left to do if stderr is gone.
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// An OS error as a person reads it: "Cannot allocate memory", without
/// Rust's " (os error 12)".
pub fn os_reason(error: &std::io::Error) -> String {
    let text = error.to_string();
    match text.rfind(" (os error ") {
        Some(end) => text[..end].to_owned(),
        None => text,
    }
}

/// Bytes as a person reads them: `1.5 GiB`, `16.0 MiB`, `512 bytes`.
pub fn readable_bytes(bytes: u64) -> String {
    const UNITS: [(&str, u32); 4] = [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)];
    for (unit, shift) in UNITS {
        if bytes >= 1 << shift {
            let tenths = (u128::from(bytes) * 10 + (1 << (shift - 1))) >> shift;
            return format!("{}.{} {unit}", tenths / 10, tenths % 10);
        }
    }
    format!("{bytes} bytes")
}
