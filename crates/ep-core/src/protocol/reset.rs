//! The reset phase (docs/protocol.md §7.2): every team rank zeroes its signal words of both
//! modes — the normal-mode control words and the low-latency signals of both halves — so that
//! nothing a failed call left behind survives, and the next low-latency operation can declare
//! them zero again.

use crate::transport::{AgentCtx, Phase, PhaseKind, SymAlloc};

/// The phase zeroing `words` (each allocation whole) on every rank of `team`.
pub(crate) fn reset_phase<'a>(
    words: &'a [&'a SymAlloc],
    call: u64,
    team: &'a [usize],
) -> Phase<'a> {
    let mut phase = Phase::new(PhaseKind::Clean, call);
    for &d in team {
        phase = phase.agent(d, 0, "reset", move |ctx: &mut dyn AgentCtx| {
            for a in words {
                let zeros = vec![0u8; a.region.len as usize];
                ctx.store(d, a.at(0), &zeros)?;
            }
            Ok(())
        });
    }
    phase
}
