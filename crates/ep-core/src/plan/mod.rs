//! The plan: dispatch layout and the exact outputs of every mode (spec §1.7, §2), computed the
//! way the protocol computes them (counts, prefix sums, slots), so backends can share it.

pub mod combine;
pub mod internode;
pub mod intranode;
pub mod layout;
pub mod low_latency;
