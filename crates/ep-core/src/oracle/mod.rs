//! The reference oracle: given every rank's inputs, what every rank must receive and get back.
//!
//! Written as plainly as possible and independently of [`crate::plan`] (no shared helpers), so
//! that the two check each other; every backend is compared against it.

pub mod internode;
pub mod low_latency;
pub mod normal;
