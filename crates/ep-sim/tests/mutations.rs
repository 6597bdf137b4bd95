//! The mutation suite: small protocols written in the vocabulary (`common`), each in a correct
//! form and with planted bugs. Every correct form passes under many seeds and all three
//! policies; every broken form is caught by the violation that names its bug.
//!
//! Seeds `s` use policy `s % 3` (uniform, PCT depth 3, latest-legal). **Bound**: every window of
//! [`WINDOW`] = 12 consecutive seeds in `0..48` contains a seed that catches each mutation, and
//! every seed either catches it with the named violation or runs to the correct result (a legal
//! schedule that did not expose the bug). Measured over seeds `0..300` (ignored test `scan`):
//!
//! | protocol | mutation | violation | caught in | longest miss run |
//! |---|---|---|---|---|
//! | ring (RDMA) | tail on another QP than its data | `SignalBeforeData` | 300/300 | 0 |
//! | ring (RDMA) | overflow by one (`i - head <= cap`) | `RingOverrun` | 237/300 | 5 |
//! | ring (RDMA) | consumer reads before waiting for the tail | `ReadPastTail` | 300/300 | 0 |
//! | count-then-data (NVLink) | missing fence before the releasing store | `StoreNotPublished` | 300/300 | 0 |
//! | count-then-data (NVLink) | counter not reset between calls | `NonZeroAtCallStart` | 300/300 | 0 |
//! | double buffer + hook (RDMA) | hook of call k after call k+2 | `HookAfterNextCall` | 300/300 | 0 |
//! | double buffer + hook (RDMA) | source reused before quiet | `SourceWrittenBeforeCompletion` | 235/300 | 2 |
//! | credit stream (RDMA, unchecked QP) | chunk-straddling put counted as one WR | `QpDepthExceeded` | 241/300 | 2 |

mod common;

use common::*;
use ep_sim::{SimError, Violation};

/// Every window of this many consecutive seeds catches every mutation.
const WINDOW: u64 = 12;
/// Seeds the broken forms are run under.
const SEEDS: u64 = 48;
/// Seeds the correct forms are run under.
const CORRECT_SEEDS: u64 = 60;

fn run(m: Mutation, seed: u64) -> Result<(), SimError> {
    let pol = policy_for(seed);
    match m {
        Mutation::None => unreachable!(),
        Mutation::SignalOnOtherQp | Mutation::RingOverflowByOne | Mutation::ReadBeforeTail => {
            ring(m, RingParams::default(), seed, pol).map(|_| ())
        }
        Mutation::MissingFence | Mutation::CounterNotReset => {
            count_then_data(m, CountParams::default(), seed, pol).map(|_| ())
        }
        Mutation::HookAfterNextCall | Mutation::SourceReusedBeforeQuiet => {
            double_buffer(m, DoubleParams::default(), seed, pol).map(|_| ())
        }
        Mutation::StraddleUncounted => {
            credit_stream(m, CreditParams::default(), seed, pol).map(|_| ())
        }
    }
}

/// Runs `m` over `SEEDS` seeds; checks every failure is `expect` (and `check` holds for it), and
/// that every window of `WINDOW` seeds has one.
fn caught(m: Mutation, expect: &str, check: impl Fn(&Violation) -> bool) {
    let mut hits = Vec::new();
    for seed in 0..SEEDS {
        match run(m, seed) {
            Ok(()) => {}
            Err(e) => {
                let v = e
                    .violation()
                    .unwrap_or_else(|| panic!("{m:?} seed {seed}: not a violation: {e}"));
                assert_eq!(v.name(), expect, "{m:?} seed {seed}: {v}");
                assert!(
                    check(v),
                    "{m:?} seed {seed}: violation lacks the expected details: {v}"
                );
                hits.push(seed);
            }
        }
    }
    for start in 0..=SEEDS - WINDOW {
        assert!(
            hits.iter().any(|&h| (start..start + WINDOW).contains(&h)),
            "{m:?} not caught in seeds {start}..{}; caught at {hits:?}",
            start + WINDOW
        );
    }
}

#[test]
fn correct_forms_pass_under_many_seeds_and_all_policies() {
    for seed in 0..CORRECT_SEEDS {
        let pol = policy_for(seed);
        ring(Mutation::None, RingParams::default(), seed, pol).unwrap();
        count_then_data(Mutation::None, CountParams::default(), seed, pol).unwrap();
        double_buffer(Mutation::None, DoubleParams::default(), seed, pol).unwrap();
        credit_stream(Mutation::None, CreditParams::default(), seed, pol).unwrap();
    }
}

#[test]
fn correct_forms_pass_at_larger_sizes() {
    for seed in 0..12 {
        let pol = policy_for(seed);
        let rp = RingParams {
            ranks: 3,
            capacity: 3,
            entries: 10,
            slot_bytes: 48,
            staging: 3,
            qp_depth: 3,
        };
        ring(Mutation::None, rp, seed, pol).unwrap();
        let cp = CountParams {
            ranks: 4,
            max_rows: 4,
            row_bytes: 32,
            calls: 3,
        };
        count_then_data(Mutation::None, cp, seed, pol).unwrap();
        let dp = DoubleParams {
            ranks: 3,
            rows: 3,
            row_bytes: 48,
            calls: 5,
            qp_depth: 4,
        };
        double_buffer(Mutation::None, dp, seed, pol).unwrap();
        let sp = CreditParams {
            messages: 20,
            qp_depth: 4,
            granularity: 192,
        };
        credit_stream(Mutation::None, sp, seed, pol).unwrap();
    }
}

#[test]
fn qp_depth_one_and_two_give_correct_results() {
    for depth in [1, 2] {
        for seed in 0..15 {
            let pol = policy_for(seed);
            let s = ring(
                Mutation::None,
                RingParams {
                    qp_depth: depth,
                    ..RingParams::default()
                },
                seed,
                pol,
            )
            .unwrap();
            assert!(s.stats().max_outstanding <= depth);
            assert!(
                s.stats().qp_full_waits > 0,
                "depth {depth}: posts should have waited for completions"
            );
            let s = double_buffer(
                Mutation::None,
                DoubleParams {
                    qp_depth: depth,
                    ..DoubleParams::default()
                },
                seed,
                pol,
            )
            .unwrap();
            assert!(s.stats().max_outstanding <= depth);
            let cp = CreditParams {
                qp_depth: depth.max(2),
                ..CreditParams::default()
            };
            credit_stream(Mutation::None, cp, seed, pol).unwrap();
        }
    }
}

#[test]
fn ring_signal_on_another_qp_is_signal_before_data() {
    caught(
        Mutation::SignalOnOtherQp,
        "SignalBeforeData",
        |v| matches!(v, Violation::SignalBeforeData { put_qp, signal_qp, .. } if put_qp != signal_qp),
    );
}

#[test]
fn ring_overflow_by_one_is_ring_overrun() {
    caught(
        Mutation::RingOverflowByOne,
        "RingOverrun",
        |v| matches!(v, Violation::RingOverrun { head, tail, capacity, .. } if tail - head >= 1 && *capacity == 2),
    );
}

#[test]
fn ring_read_before_tail_is_read_past_tail() {
    caught(Mutation::ReadBeforeTail, "ReadPastTail", |_| true);
}

#[test]
fn count_then_data_missing_fence_is_store_not_published() {
    caught(
        Mutation::MissingFence,
        "StoreNotPublished",
        |v| matches!(v, Violation::StoreNotPublished { writer, reader, .. } if writer.role == "sender" && reader.role == "receiver"),
    );
}

#[test]
fn count_then_data_counter_not_reset_is_non_zero_at_call_start() {
    caught(Mutation::CounterNotReset, "NonZeroAtCallStart", |v| {
        matches!(
            v,
            Violation::NonZeroAtCallStart {
                call: 2,
                written_in_call: 1,
                ..
            }
        )
    });
}

#[test]
fn double_buffer_hook_after_next_call_is_named() {
    caught(
        Mutation::HookAfterNextCall,
        "HookAfterNextCall",
        |v| matches!(v, Violation::HookAfterNextCall { hook_call, written_in_call, .. } if *written_in_call == hook_call + 2),
    );
}

#[test]
fn double_buffer_source_reused_before_quiet_is_named() {
    caught(
        Mutation::SourceReusedBeforeQuiet,
        "SourceWrittenBeforeCompletion",
        |_| true,
    );
}

#[test]
fn credit_stream_uncounted_straddle_is_qp_depth_exceeded() {
    caught(
        Mutation::StraddleUncounted,
        "QpDepthExceeded",
        |v| matches!(v, Violation::QpDepthExceeded { split_ops, .. } if !split_ops.is_empty()),
    );
}

/// Development scan behind the table above: `cargo test -p ep-sim --test mutations -- --ignored`.
#[test]
#[ignore = "slow scan that produced the table in the module docs"]
fn scan() {
    for m in [
        Mutation::SignalOnOtherQp,
        Mutation::RingOverflowByOne,
        Mutation::ReadBeforeTail,
        Mutation::MissingFence,
        Mutation::CounterNotReset,
        Mutation::HookAfterNextCall,
        Mutation::SourceReusedBeforeQuiet,
        Mutation::StraddleUncounted,
    ] {
        let (mut hits, mut run_len, mut longest) = (0, 0, 0);
        for seed in 0..300 {
            if run(m, seed).is_err() {
                hits += 1;
                run_len = 0;
            } else {
                run_len += 1;
                longest = longest.max(run_len);
            }
        }
        println!("{m:?}: caught {hits}/300, longest miss run {longest}");
    }
}
