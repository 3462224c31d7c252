//! The processes memleak traces, seen from outside: their address space
//! (`maps`, `address_space`), their life (`lifecycle`), a command memleak
//! starts itself (`command`) and all that it starts (`command_cgroup`),
//! cgroups of them (`cgroup`), the container and pod they run in
//! (`container`, `kubernetes`), and those it must leave alone
//! (`feedback`); which process a pid names (`identity`), the dynamic
//! linker's hook a started command stops at (`link_map`); and opening the
//! files they control (`files`).

pub mod address_space;
pub mod cgroup;
pub mod command;
pub mod command_cgroup;
pub mod container;
pub mod feedback;
pub mod files;
pub mod identity;
pub mod kubernetes;
pub mod lifecycle;
pub mod link_map;
pub mod maps;
pub mod resident;

pub use address_space::AddressSpace;
pub use lifecycle::TargetEvent;
