//! The shape-level checks of the `Buffer`'s calls that every backend runs before any transfer:
//! host logic that reads no tensor contents, so it applies to host and device tensors alike
//! (docs/buffer-api.md, step 1). The GPU groups call these too.

use crate::error::{Error, Result};
use crate::plan::intranode::{DispatchOptions, check_dispatch_options};
use crate::plan::layout::local_experts;
use crate::protocol::layout::{MAX_CHANNELS, MAX_LOCAL_EXPERTS};

/// A normal dispatch over `num_ranks` ranks and `num_experts` experts with `opts`: `E >= 1`,
/// `E % R == 0`, the options (spec §1.8), and the protocol's limits on channels and local
/// experts (docs/protocol.md §2.1). Returns `L = E / R`.
pub fn normal_dispatch(
    num_ranks: usize,
    num_experts: usize,
    opts: &DispatchOptions,
) -> Result<usize> {
    let num_local_experts = local_experts(num_experts, num_ranks)?;
    check_dispatch_options(opts)?;
    if opts.num_channels > MAX_CHANNELS {
        return Err(Error::ProtocolLimit {
            what: "channels (num_sms / 2)",
            value: opts.num_channels,
            max: MAX_CHANNELS,
            fix: "use at most 128 SMs for normal mode",
        });
    }
    if num_local_experts > MAX_LOCAL_EXPERTS {
        return Err(Error::ProtocolLimit {
            what: "local experts",
            value: num_local_experts,
            max: MAX_LOCAL_EXPERTS,
            fix: "use more ranks or fewer experts",
        });
    }
    Ok(num_local_experts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> DispatchOptions {
        DispatchOptions {
            num_channels: 12,
            expert_alignment: 1,
            num_worst_tokens: 0,
            with_topk: true,
        }
    }

    #[test]
    fn each_rule_is_a_typed_error() {
        assert_eq!(normal_dispatch(4, 256, &opts()).unwrap(), 64);
        assert!(matches!(
            normal_dispatch(0, 8, &opts()),
            Err(Error::InvalidRankCount { .. })
        ));
        assert!(matches!(
            normal_dispatch(4, 0, &opts()),
            Err(Error::InvalidConfig {
                field: "num_experts",
                ..
            })
        ));
        assert!(matches!(
            normal_dispatch(3, 8, &opts()),
            Err(Error::ExpertsNotDivisible { .. })
        ));
        let mut o = opts();
        o.expert_alignment = 0;
        assert!(matches!(
            normal_dispatch(2, 8, &o),
            Err(Error::InvalidConfig {
                field: "expert_alignment",
                ..
            })
        ));
        let mut o = opts();
        o.num_worst_tokens = 9;
        o.with_topk = false;
        assert!(matches!(
            normal_dispatch(2, 8, &o),
            Err(Error::InvalidConfig {
                field: "num_worst_tokens",
                ..
            })
        ));
        let mut o = opts();
        o.num_channels = MAX_CHANNELS + 1;
        assert!(matches!(
            normal_dispatch(2, 8, &o),
            Err(Error::ProtocolLimit {
                what: "channels (num_sms / 2)",
                ..
            })
        ));
        assert!(matches!(
            normal_dispatch(1, MAX_LOCAL_EXPERTS + 1, &opts()),
            Err(Error::ProtocolLimit {
                what: "local experts",
                ..
            })
        ));
    }
}
