//! Why a simulated phase failed: a typed [`Violation`] (defined in ep-core, so that it crosses
//! the Transport typed) or an ep-core error.

pub use ep_core::transport::{AgentRef, Violation, Waiting};

/// Why a simulated phase failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// The protocol broke a rule.
    #[error(transparent)]
    Violation(Box<Violation>),
    /// An agent or the host made an invalid request, or an agent failed.
    #[error(transparent)]
    Core(#[from] ep_core::Error),
}

impl SimError {
    /// The violation, if this is one.
    #[must_use]
    pub fn violation(&self) -> Option<&Violation> {
        match self {
            SimError::Violation(v) => Some(v),
            SimError::Core(_) => None,
        }
    }
}

impl From<Violation> for SimError {
    fn from(v: Violation) -> Self {
        SimError::Violation(Box::new(v))
    }
}

impl From<SimError> for ep_core::Error {
    fn from(e: SimError) -> Self {
        match e {
            SimError::Core(c) => c,
            SimError::Violation(v) => match *v {
                Violation::Deadlock { .. } => ep_core::Error::Deadlock {
                    detail: v.to_string(),
                },
                Violation::WaitTimeout { waiting, .. } => ep_core::Error::WaitTimeout {
                    rank: waiting.agent.rank,
                    agent: waiting.agent.to_string(),
                    what: if waiting.faults.is_empty() {
                        waiting.what.clone()
                    } else {
                        format!(
                            "{}; injected faults: {}",
                            waiting.what,
                            waiting.faults.join("; ")
                        )
                    },
                    word_rank: waiting.word.map_or(waiting.agent.rank, |w| w.0),
                    word: waiting.word.map_or(0, |w| w.1),
                    expected: waiting.what,
                    last_seen: waiting.last_seen.unwrap_or(0),
                },
                Violation::CompletionTimeout {
                    agent,
                    peer,
                    qp,
                    during,
                    outstanding,
                    oldest,
                    faults,
                    ..
                } => ep_core::Error::CompletionTimeout {
                    rank: agent.rank,
                    agent: agent.to_string(),
                    peer,
                    qp: qp.0,
                    during,
                    outstanding,
                    oldest: if faults.is_empty() {
                        oldest
                    } else {
                        format!("{oldest}; injected faults: {}", faults.join("; "))
                    },
                },
                other => ep_core::Error::ProtocolViolation {
                    rank: other.rank(),
                    violation: Box::new(other),
                },
            },
        }
    }
}
