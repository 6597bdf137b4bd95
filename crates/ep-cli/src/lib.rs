//! The library half of the `ep` command: reusable pieces that `ep layout` and `ep bench` share
//! and that integration tests call directly.
//!
//! - [`workload`]: the options both commands take (mode, generated or replayed workload, dumps)
//!   and their one loader.
//! - [`io`]: NumPy `.npy` inputs (`read_inputs`, `write_inputs`) and output dumps with a
//!   `manifest.json` (`dump_outputs`).
//! - [`bench`](mod@bench): `ep bench`, dispatch and combine on a backend, verified against the oracle and
//!   timed, with DeepEP's byte counts and the cost model's prediction.
//! - [`args`]: value parsers that turn impossible option values into usage errors.
//! - [`interrupt`]: SIGINT/SIGTERM stop a run at its next step, cleanly.
//! - [`preflight`]: the checks before any work (usage limits, memory, output paths).
//! - `ep_sim::alloc`: the caching allocator the `ep` binary installs.

pub mod args;
pub mod bench;
pub mod interrupt;
pub mod io;
pub mod preflight;
pub mod workload;

mod ranks;
