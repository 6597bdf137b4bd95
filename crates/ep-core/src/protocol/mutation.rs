//! The planted protocol bugs of the mutation suite.

/// A bug planted in the real agents, for the mutation suite (docs/protocol.md §6). Public only
/// with ep-core's `test-support` feature (the workspace's tests enable it).
#[cfg_attr(
    not(feature = "test-support"),
    allow(unreachable_pub, reason = "public only with the test-support feature")
)]
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
    /// Normal dispatch: a sender reads the `head` words (its block start) without waiting for
    /// their call's values.
    SenderSkipsNotify,
    /// Normal dispatch: the receiver reads the count records' channel prefix part (its
    /// `recv_channel_prefix_matrix`) before acquiring the `done[s][c]` words that publish them.
    ReceiverReadsPrefixEarly,
    /// Normal combine: reducers pull without waiting for `y_ready`.
    CombineSkipYReady,
    /// Low-latency dispatch: the signal is posted with no fence after row puts on other QPs.
    LlSignalWithoutFence,
    /// Low-latency dispatch: one staging row reused for every message before `quiet`.
    LlStagingReuse,
    /// Low-latency dispatch hook: `begin(l, s)` one too large for `s > 0`.
    LlBeginOffByOne,
    /// Low-latency dispatch: a send group `b > 0` names a first slot one too large in its
    /// header copy (its messages land where the receiver does not look).
    LlGroupFirstOffByOne,
    /// `Buffer`: a low-latency send is allowed while a hook is pending.
    SkipHookCheck,
    /// `Buffer`: a low-latency operation is allowed on memory that needs a clean.
    SkipCleanCheck,
}
