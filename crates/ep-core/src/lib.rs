//! # ep-core
//!
//! The pure-Rust heart of ep-rs: what Mixture-of-Experts dispatch and combine must produce
//! (DeepEP V1's data semantics, `../shared/spec/deepep-v1.md` §2), a reference oracle that
//! states the same thing as plainly as possible, the DeepEP-compatible configuration surface
//! (`Config`, size hints, `BufferConfig`), the NVSHMEM environment plan, seeded workloads, the
//! `Transport` trait both backends implement.
//!
//! No I/O happens here; everything builds and tests on any machine. The logic of `ep doctor`
//! (machine checks over a sysroot) is its own crate, `ep-setup`.
//!
//! Module map:
//! - [`tensor`], [`routing`]: host tensors and the per-rank inputs, routing validation;
//! - [`plan`]: layout and the outputs of every mode, computed the way the protocol will;
//! - [`oracle`]: the independent reference the plan and every backend are checked against;
//! - [`numerics`]: BF16 rounding, FP8 e4m3 casts and scales;
//! - [`config`]: `Config`, size hints, `BufferConfig` validation, the NVSHMEM environment plan;
//! - [`workload`]: seeded, portable generation of routings and activations;
//! - [`digest`]: canonical, backend-independent digests of every output;
//! - [`transport`]: the `Transport` trait (host face and protocol vocabulary);
//! - [`protocol`]: ep-rs's protocol (docs/protocol.md): agents, layouts, signal encodings;
//! - [`executor`]: the `Executor` of a `Buffer`'s phases, and the simulator's (every
//!   [`RunsAgents`] transport);
//! - [`buffer`]: `Buffer`, DeepEP's API over any `Executor`.

pub mod buffer;
pub mod config;
pub mod digest;
pub mod error;
pub mod executor;
pub mod numerics;
pub mod oracle;
pub mod plan;
pub mod protocol;
pub mod routing;
pub mod tensor;
pub mod transport;
pub mod workload;

pub use buffer::Buffer;
pub use error::{Error, Result};
pub use executor::{Executor, Host, RunsAgents, Tensors};
pub use routing::{Activations, ExpertIdx, RankInputs, validate_inputs, validate_routing};
pub use tensor::{Tensor2, Tensor3};
