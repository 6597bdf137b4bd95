//! ep-rs's protocol (docs/protocol.md): the agents of every phase, written against the
//! [`crate::transport`] vocabulary, and the offsets, slots and signal encodings they use.
//!
//! - [`layout`]: every offset, size and per-token rule (mirrored by `ep_protocol.cuh`);
//! - [`signal`]: epoch-coded signal values;
//! - `normal`: intranode count exchange, direct-placement dispatch, cached dispatch, pull combine;
//! - `low_latency`: one message per (token, destination rank), local fan-out, partial sums
//!   reduced on the expert's rank, two halves and the hook;
//! - `reset`: zeroing every signal word after a failure (`Buffer::reset`).
//!
//! [`crate::buffer::Buffer`] drives these phases through a [`crate::transport::Transport`].

pub(crate) mod bytes;
pub mod layout;
pub(crate) mod low_latency;
pub(crate) mod normal;
pub(crate) mod reset;
pub mod signal;

pub use low_latency::LlRoutes;

/// A bug planted in the real agents, for the mutation suite (docs/protocol.md §6). Test support:
/// never set it outside tests.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProtocolMutation {
    /// The real protocol.
    #[default]
    None,
    /// Normal dispatch: a sender stores its last row after releasing `done`.
    ReleaseBeforeLastRow,
    /// Normal dispatch: count records go to the other parity's slot.
    CountsWrongParity,
    /// Normal combine: reducers pull without waiting for `y_ready`.
    CombineSkipYReady,
    /// Low-latency dispatch: the signal is posted with no fence after row puts on other QPs.
    LlSignalWithoutFence,
    /// Low-latency dispatch: one staging row reused for every message before `quiet`.
    LlStagingReuse,
    /// Low-latency dispatch hook: `begin(l, s)` one too large for `s > 0`.
    LlBeginOffByOne,
    /// `Buffer`: a low-latency send is allowed while a hook is pending.
    SkipHookCheck,
    /// `Buffer`: a low-latency operation is allowed on memory that needs a clean.
    SkipCleanCheck,
}
