//! The shape-level checks of the `Buffer`'s calls that every backend runs before any transfer:
//! host logic that reads no tensor contents, so it applies to host and device tensors alike
//! (docs/buffer-api.md, step 1). The GPU groups call these too.

use crate::error::{Error, Result};
use crate::plan::intranode::{DispatchOptions, check_dispatch_options, handle_mismatch};
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

/// The shapes `(rows, cols)` of a normal-mode handle's tensors (spec §2.2), whatever holds them
/// (host tensors on the simulator, device tensors on the GPU).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HandleShapes {
    /// `rank_prefix_matrix`: `[R, R]`.
    pub rank_prefix_matrix: (usize, usize),
    /// `channel_prefix_matrix`: `[R, C]`.
    pub channel_prefix_matrix: (usize, usize),
    /// `recv_channel_prefix_matrix`: `[R, C]`.
    pub recv_channel_prefix_matrix: (usize, usize),
    /// `send_head`: `[T, R]`.
    pub send_head: (usize, usize),
    /// `is_token_in_rank`: `[T, R]`.
    pub is_token_in_rank: (usize, usize),
    /// Rows the dispatch delivered (`recv_src_idx`'s length, or the worst-token rows).
    pub num_rows: usize,
    /// Rows actually received, when known (`None`: worst-token mode on the GPU).
    pub num_recv: Option<usize>,
}

/// The handle of rank `rank` of `num_ranks`, given to a cached dispatch or a combine: every
/// matrix shaped for `R` ranks, one channel count `C` in `1..=MAX_CHANNELS` (equal to
/// `num_channels` when the backend's is fixed), `T` tokens in `send_head` and `is_token_in_rank`
/// (equal to `num_tokens` when the caller's tensors give it), and no more received rows than
/// delivered. Returns `C`. A handle from another call shape is a typed error, never a bad read.
pub fn normal_handle(
    rank: usize,
    num_ranks: usize,
    num_tokens: Option<usize>,
    num_channels: Option<usize>,
    h: &HandleShapes,
) -> Result<usize> {
    let r = num_ranks;
    let (_, c) = h.channel_prefix_matrix;
    let t = h.send_head.0;
    let bad = |what: &str, found: (usize, usize), want: String| {
        Err(handle_mismatch(
            rank,
            format!("{what} is {}x{}, expected {want}", found.0, found.1),
        ))
    };
    if h.rank_prefix_matrix != (r, r) {
        return bad(
            "rank_prefix_matrix",
            h.rank_prefix_matrix,
            format!("{r}x{r}"),
        );
    }
    if c == 0 || c > MAX_CHANNELS || num_channels.is_some_and(|n| n != c) {
        let want = num_channels.map_or(format!("{r}x(1..={MAX_CHANNELS})"), |n| format!("{r}x{n}"));
        return bad("channel_prefix_matrix", h.channel_prefix_matrix, want);
    }
    for (what, found) in [
        ("channel_prefix_matrix", h.channel_prefix_matrix),
        ("recv_channel_prefix_matrix", h.recv_channel_prefix_matrix),
    ] {
        if found != (r, c) {
            return bad(what, found, format!("{r}x{c}"));
        }
    }
    if num_tokens.is_some_and(|n| n != t) {
        let n = num_tokens.unwrap_or(t);
        return bad(
            "send_head",
            h.send_head,
            format!("{n}x{r} (the call's tokens)"),
        );
    }
    for (what, found) in [
        ("send_head", h.send_head),
        ("is_token_in_rank", h.is_token_in_rank),
    ] {
        if found != (t, r) {
            return bad(what, found, format!("{t}x{r}"));
        }
    }
    if let Some(n) = h.num_recv
        && n > h.num_rows
    {
        return Err(handle_mismatch(
            rank,
            format!("{n} received rows but {} delivered", h.num_rows),
        ));
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle(r: usize, c: usize, t: usize) -> HandleShapes {
        HandleShapes {
            rank_prefix_matrix: (r, r),
            channel_prefix_matrix: (r, c),
            recv_channel_prefix_matrix: (r, c),
            send_head: (t, r),
            is_token_in_rank: (t, r),
            num_rows: 40,
            num_recv: Some(40),
        }
    }

    #[test]
    fn a_handle_of_another_shape_is_a_typed_error() {
        let ok = handle(4, 12, 100);
        assert_eq!(normal_handle(1, 4, Some(100), Some(12), &ok).unwrap(), 12);
        assert_eq!(normal_handle(1, 4, None, None, &ok).unwrap(), 12);
        let wrong: [(HandleShapes, &str); 8] = [
            (
                HandleShapes {
                    rank_prefix_matrix: (4, 3),
                    ..ok
                },
                "rank_prefix_matrix",
            ),
            (
                HandleShapes {
                    channel_prefix_matrix: (4, 0),
                    ..ok
                },
                "channel_prefix_matrix",
            ),
            (handle(4, MAX_CHANNELS + 1, 100), "channel_prefix_matrix"),
            (
                HandleShapes {
                    channel_prefix_matrix: (3, 12),
                    ..ok
                },
                "channel_prefix_matrix",
            ),
            (
                HandleShapes {
                    recv_channel_prefix_matrix: (4, 11),
                    ..ok
                },
                "recv_channel_prefix_matrix",
            ),
            (
                HandleShapes {
                    send_head: (100, 3),
                    ..ok
                },
                "send_head",
            ),
            (
                HandleShapes {
                    is_token_in_rank: (99, 4),
                    ..ok
                },
                "is_token_in_rank",
            ),
            (
                HandleShapes {
                    num_recv: Some(41),
                    ..ok
                },
                "received rows",
            ),
        ];
        for (h, what) in wrong {
            match normal_handle(2, 4, None, None, &h) {
                Err(Error::LayoutMismatch {
                    rank: 2,
                    field: "handle",
                    detail,
                }) => assert!(detail.contains(what), "{what}: {detail}"),
                other => panic!("{what}: {other:?}"),
            }
        }
        // The backend's fixed channel count and the caller's token count.
        assert!(normal_handle(0, 4, None, Some(8), &ok).is_err());
        assert!(normal_handle(0, 4, Some(99), None, &ok).is_err());
        assert!(
            normal_handle(
                0,
                4,
                None,
                None,
                &HandleShapes {
                    num_recv: None,
                    ..ok
                }
            )
            .is_ok()
        );
    }

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
