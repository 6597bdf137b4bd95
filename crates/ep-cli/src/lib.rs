//! The library half of the `ep` command: reusable pieces that `ep layout` and `ep bench` share
//! and that integration tests call directly.
//!
//! - [`io`]: NumPy `.npy` inputs (`read_inputs`, `write_inputs`) and output dumps with a
//!   `manifest.json` (`dump_outputs`).

pub mod io;
