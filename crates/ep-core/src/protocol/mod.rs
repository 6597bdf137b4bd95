//! ep-rs's protocol (docs/protocol.md): the agents of every phase, written against the
//! [`crate::transport`] vocabulary, and the offsets, slots and signal encodings they use.
//!
//! - [`layout`]: every offset, size and per-token rule (mirrored by `ep_protocol.cuh`);
//! - [`signal`]: epoch-coded signal values;
//! - `normal`: intranode count exchange, direct-placement dispatch, cached dispatch, pull combine;
//! - `low_latency`: one message per (token, destination rank), local fan-out, partial sums
//!   reduced on the expert's rank, two halves and the hook;
//! - `logfmt_slot`: LogFMT-10 combine partials in their slots (`use_logfmt`, §3.12);
//! - `reset`: zeroing every signal word after a failure (`Buffer::reset`).
//!
//! [`crate::buffer::Buffer`] drives these phases through a [`crate::transport::Transport`].

pub(crate) mod bytes;
pub mod layout;
pub(crate) mod logfmt_slot;
pub(crate) mod low_latency;
pub(crate) mod normal;
pub(crate) mod reset;
pub mod signal;

pub use low_latency::{LlArena, LlRoutes};
pub use normal::NormalArena;

mod mutation;

// Test support (the mutation suite) is public only with the `test-support` feature.
#[cfg(feature = "test-support")]
pub use mutation::ProtocolMutation;
#[cfg(not(feature = "test-support"))]
pub(crate) use mutation::ProtocolMutation;
