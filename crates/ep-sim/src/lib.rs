//! # ep-sim
//!
//! The CPU simulator of the GPU fabric: agents on a deterministic executor, owner-applied
//! delivery, virtual time, QPs with depth, heap chunks, shadow memory and vector clocks. It
//! implements ep-core's `Transport`, so the protocol runs here unchanged.
