//! ep-core's error type: one enum for the crate, each variant saying what to do.

/// Result alias for ep-core.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in ep-core. Variants name the offending value and the fix.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    // ---- shapes and routing -------------------------------------------------------------
    /// A tensor has the wrong shape.
    #[error("{what}: expected {expected}, found {found}; pass tensors of the documented shape")]
    ShapeMismatch {
        /// Which tensor or relation.
        what: &'static str,
        /// The shape that was needed.
        expected: String,
        /// The shape that was given.
        found: String,
    },
    /// An expert id outside `[-1, num_experts)`.
    #[error(
        "rank {rank}: topk_idx[{token}][{slot}] = {expert} is outside [-1, {num_experts}); \
         use -1 for a masked slot and ids below num_experts otherwise"
    )]
    ExpertOutOfRange {
        /// Rank whose routing is wrong.
        rank: usize,
        /// Token row.
        token: usize,
        /// Top-k slot.
        slot: usize,
        /// The offending id.
        expert: i64,
        /// Number of experts the call was made with.
        num_experts: usize,
    },
    /// The inputs given to a multi-rank function disagree on the rank count.
    #[error("expected inputs for {expected} ranks, got {found}; pass one entry per rank")]
    RankCountMismatch {
        /// Ranks the call was configured for.
        expected: usize,
        /// Entries given.
        found: usize,
    },
    /// `num_experts` is not a multiple of the rank count.
    #[error(
        "num_experts {num_experts} is not a multiple of {num_ranks} ranks; every rank must hold the same number of experts"
    )]
    ExpertsNotDivisible {
        /// Experts.
        num_experts: usize,
        /// Ranks.
        num_ranks: usize,
    },
    /// A mode or option combination that is not supported.
    #[error("unsupported: {0}")]
    Unsupported(String),

    // ---- configuration (spec §1.1, §1.4, §4) ---------------------------------------------
    /// A configuration value is invalid.
    #[error("invalid {field} = {value}: {fix}")]
    InvalidConfig {
        /// The option's name, as in DeepEP.
        field: &'static str,
        /// The given value.
        value: String,
        /// What is required, and how to fix it.
        fix: String,
    },
}
