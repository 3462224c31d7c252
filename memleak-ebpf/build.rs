//! Declares the `bpf_target_arch` cfg that memleak's build script sets
//! from the machine memleak is built for: the registers a probe reads
//! differ between x86-64 and arm64 (see `registers`).

fn main() {
    println!("cargo::rustc-check-cfg=cfg(bpf_target_arch, values(\"x86_64\", \"aarch64\"))");
}
