//! The mutation idea applied to the real protocol (docs/protocol.md §6): each planted bug in the
//! real agents (or in `Buffer`'s checks) is caught — by a simulator violation, a deadlock or
//! timeout, a typed protocol error, or a difference from the plan — within a stated number of
//! seeds (policies rotate with the seed). The unmutated protocol passes the same scenarios.

mod protocol_support;

use ep_rs::core::buffer::LlCombineOptions;
use ep_rs::core::plan::combine::CombineArgs;
use ep_rs::core::plan::intranode::{intranode_combine, intranode_dispatch_all};
use ep_rs::core::plan::low_latency::{
    LlParams, PartialPrecision, combine_reduced_on_expert_rank, dispatch,
};
use ep_rs::core::protocol::ProtocolMutation;
use ep_rs::core::{Error, Tensor3};
use protocol_support::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// Seeds tried per mutation before declaring it missed.
const SEED_BOUND: u64 = 24;

/// How a run ended.
#[derive(Debug)]
enum Outcome {
    Correct,
    Wrong(String),
    Failed(String),
}

fn normal_scenario(m: ProtocolMutation, seed: u64) -> Outcome {
    let (r, l, k, h) = (4, 2, 2, 32);
    let g = Gen {
        num_ranks: r,
        max_tokens: 6,
        num_experts: r * l,
        num_topk: k,
        hidden: h,
        fp8: false,
        mask: 0.1,
        full: true,
    };
    let sim = sim(fabric(r, 4096, 2, 1), seed, policy(seed as u8));
    let mut buf = normal_buffer(sim, r, 6 * r, h, 2, k);
    buf.set_mutation_for_test(m);
    let (args, opts) = two_channel_dispatch();
    for call in 0..3u64 {
        let inputs = gen_inputs(&g, seed * 7 + call, false);
        let layouts = buf
            .get_dispatch_layout(
                &inputs
                    .iter()
                    .map(|i| i.topk_idx.clone())
                    .collect::<Vec<_>>(),
                g.num_experts,
            )
            .unwrap();
        let want = intranode_dispatch_all(&inputs, &layouts, g.num_experts, &opts).unwrap();
        let got = match buf.dispatch(&inputs, &layouts, g.num_experts, &args) {
            Ok(x) => x,
            Err(e) => return Outcome::Failed(e.to_string()),
        };
        if got != want {
            return Outcome::Wrong(format!("dispatch of call {call} differs from the plan"));
        }
        let handles: Vec<_> = got.iter().map(|o| o.handle.clone()).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ call);
        let ys: Vec<_> = handles
            .iter()
            .map(|h2| rand_bf16_tensor(&mut rng, h2.recv_src_idx.len(), h))
            .collect();
        let cargs: Vec<_> = ys
            .iter()
            .map(|y| CombineArgs {
                x: y,
                topk_weights: None,
                bias: &[],
            })
            .collect();
        let want_c = intranode_combine(&handles, &cargs).unwrap();
        match buf.combine(&handles, &cargs) {
            Ok(c) if c == want_c => {}
            Ok(_) => return Outcome::Wrong(format!("combine of call {call} differs")),
            Err(e) => return Outcome::Failed(e.to_string()),
        }
    }
    Outcome::Correct
}

fn ll_scenario(m: ProtocolMutation, seed: u64) -> Outcome {
    let (r, n, l, k, h) = (4, 8, 2, 3, 128);
    let g = Gen {
        num_ranks: r,
        max_tokens: n,
        num_experts: r * l,
        num_topk: k,
        hidden: h,
        fp8: false,
        mask: 0.2,
        full: true,
    };
    let sim = sim(fabric(r, 4096, 2, 3), seed, policy(seed as u8));
    let mut buf = ll_buffer(sim, n, h, r, g.num_experts, 3);
    buf.set_mutation_for_test(m);
    let p = LlParams::new(n, g.num_experts);
    for call in 0..2u64 {
        let inputs = gen_inputs(&g, seed * 5 + call, true);
        let want = dispatch(&inputs, &p).unwrap();
        let got = match buf.low_latency_dispatch(&inputs, &p) {
            Ok(x) => x,
            Err(e) => return Outcome::Failed(e.to_string()),
        };
        if got.outputs != want {
            return Outcome::Wrong(format!("dispatch of call {call} differs from the plan"));
        }
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xabc ^ call);
        let y: Vec<Option<Tensor3<half::bf16>>> = (0..r)
            .map(|_| Some(rand_bf16_tensor3(&mut rng, l, r * n, h)))
            .collect();
        let handles: Vec<_> = got
            .outputs
            .iter()
            .map(|o| o.as_ref().map(|o| o.handle.clone()))
            .collect();
        let want_c =
            combine_reduced_on_expert_rank(&inputs, &handles, &y, &p, PartialPrecision::Bf16)
                .unwrap();
        match buf.low_latency_combine(
            &got.routes,
            &y,
            &inputs,
            LlCombineOptions::default().with_zero_copy(call == 1),
        ) {
            Ok(c) if c == want_c => {}
            Ok(_) => return Outcome::Wrong(format!("combine of call {call} differs")),
            Err(e) => return Outcome::Failed(e.to_string()),
        }
    }
    Outcome::Correct
}

/// Hook contract bypassed: three sends before the first hook; the hook of the first reads
/// its half after the third rewrote it.
fn hook_scenario(m: ProtocolMutation, seed: u64) -> Outcome {
    let (r, n, l, k, h) = (2, 4, 2, 2, 128);
    let g = Gen {
        num_ranks: r,
        max_tokens: n,
        num_experts: r * l,
        num_topk: k,
        hidden: h,
        fp8: false,
        mask: 0.0,
        full: true,
    };
    let sim = sim(fabric(r, 1 << 20, 4, 1), seed, policy(seed as u8));
    let mut buf = ll_buffer(sim, n, h, r, g.num_experts, 1);
    buf.set_mutation_for_test(m);
    let p = LlParams::new(n, g.num_experts);
    let mut hooks = Vec::new();
    for call in 0..3u64 {
        let inputs = gen_inputs(&g, seed * 3 + call, true);
        match buf.low_latency_dispatch_send(&inputs, &p) {
            Ok(hk) => hooks.push((hk, inputs)),
            Err(e) => return Outcome::Failed(e.to_string()),
        }
    }
    for (hk, inputs) in hooks {
        match buf.low_latency_dispatch_recv(hk) {
            Ok(got) if got.outputs == dispatch(&inputs, &p).unwrap() => {}
            Ok(_) => return Outcome::Wrong("hook outputs differ".into()),
            Err(e) => return Outcome::Failed(e.to_string()),
        }
    }
    Outcome::Correct
}

/// Clean check bypassed after foreign use of the LL memory (spec case 20).
fn clean_scenario(m: ProtocolMutation, seed: u64) -> Outcome {
    let (r, n, l, k, h) = (2, 4, 2, 2, 128);
    let g = Gen {
        num_ranks: r,
        max_tokens: n,
        num_experts: r * l,
        num_topk: k,
        hidden: h,
        fp8: false,
        mask: 0.0,
        full: true,
    };
    let sim = sim(fabric(r, 1 << 20, 4, 1), seed, policy(seed as u8));
    let mut buf = ll_buffer(sim, n, h, r, g.num_experts, 1);
    buf.set_mutation_for_test(m);
    let p = LlParams::new(n, g.num_experts);
    let inputs = gen_inputs(&g, seed, true);
    buf.debug_foreign_use_of_low_latency_memory().unwrap();
    match buf.low_latency_dispatch(&inputs, &p) {
        Ok(got) if got.outputs == dispatch(&inputs, &p).unwrap() => Outcome::Correct,
        Ok(_) => Outcome::Wrong("dispatch after foreign use differs".into()),
        Err(e) => Outcome::Failed(e.to_string()),
    }
}

/// Runs `scenario` with `m` over seeds until caught; returns (seed, how).
fn first_catch(
    m: ProtocolMutation,
    scenario: fn(ProtocolMutation, u64) -> Outcome,
) -> (u64, String) {
    for seed in 0..SEED_BOUND {
        match scenario(m, seed) {
            Outcome::Correct => {}
            Outcome::Wrong(w) => return (seed, format!("oracle: {w}")),
            Outcome::Failed(f) => return (seed, f),
        }
    }
    panic!("{m:?} not caught within {SEED_BOUND} seeds");
}

#[test]
fn unmutated_protocol_passes_every_scenario() {
    for seed in 0..4 {
        for s in [normal_scenario, ll_scenario] {
            let o = s(ProtocolMutation::None, seed);
            assert!(matches!(o, Outcome::Correct), "seed {seed}: {o:?}");
        }
    }
}

/// (mutation, scenario, what must appear in the report: a violation name or "oracle").
/// A scenario run under a mutation and a seed.
type Scenario = fn(ProtocolMutation, u64) -> Outcome;
/// A row of the mutation table.
type Row = (ProtocolMutation, Scenario, &'static [&'static str]);

fn table() -> Vec<Row> {
    vec![
        (
            ProtocolMutation::ReleaseBeforeLastRow,
            normal_scenario,
            &[
                "store not published",
                "read of poison",
                "data race",
                "oracle",
            ],
        ),
        (
            ProtocolMutation::CountsWrongParity,
            normal_scenario,
            &[
                "read of poison",
                "data race",
                "oracle",
                "deadlock",
                "timeout",
            ],
        ),
        (
            ProtocolMutation::SenderSkipsNotify,
            normal_scenario,
            &["read of poison", "data race", "oracle"],
        ),
        (
            ProtocolMutation::ReceiverReadsPrefixEarly,
            normal_scenario,
            &["read of poison", "data race", "oracle"],
        ),
        (
            ProtocolMutation::CombineSkipYReady,
            normal_scenario,
            &["read of poison", "data race", "store not published"],
        ),
        (
            ProtocolMutation::LlSignalWithoutFence,
            ll_scenario,
            &["signal before data"],
        ),
        (
            ProtocolMutation::LlStagingReuse,
            ll_scenario,
            &["source written before completion"],
        ),
        (
            ProtocolMutation::LlBeginOffByOne,
            ll_scenario,
            &["oracle", "invalid low-latency layout"],
        ),
        (
            ProtocolMutation::LlGroupFirstOffByOne,
            ll_scenario,
            &["invalid low-latency layout"],
        ),
        (
            ProtocolMutation::SkipHookCheck,
            hook_scenario,
            &["hook after next call", "carries call"],
        ),
        (
            ProtocolMutation::SkipCleanCheck,
            clean_scenario,
            &["non-zero at call start"],
        ),
    ]
}

#[test]
fn every_planted_bug_is_caught() {
    let mut report = Vec::new();
    for (m, scenario, expect) in table() {
        let (seed, how) = first_catch(m, scenario);
        assert!(
            expect.iter().any(|e| how.contains(e)),
            "{m:?} caught at seed {seed} but not as expected {expect:?}: {how}"
        );
        report.push(format!(
            "{m:?}: seed {seed}: {}",
            &how[..how.len().min(160)]
        ));
    }
    println!("{}", report.join("\n"));
}

#[test]
fn buffer_enforces_hook_and_clean_contracts() {
    let (r, n, l, h) = (2, 4, 2, 128);
    let g = Gen {
        num_ranks: r,
        max_tokens: n,
        num_experts: r * l,
        num_topk: 2,
        hidden: h,
        fp8: false,
        mask: 0.0,
        full: true,
    };
    let mut buf = ll_buffer(
        sim(fabric(r, 1 << 20, 4, 1), 1, policy(0)),
        n,
        h,
        r,
        g.num_experts,
        1,
    );
    let p = LlParams::new(n, g.num_experts);
    let inputs = gen_inputs(&g, 3, true);
    let hk = buf.low_latency_dispatch_send(&inputs, &p).unwrap();
    let call = hk.call();
    assert_eq!(
        buf.low_latency_dispatch_send(&inputs, &p).unwrap_err(),
        Error::LowLatencyHookPending { pending_call: call }
    );
    assert_eq!(
        buf.clean_low_latency_buffer().unwrap_err(),
        Error::LowLatencyHookPending { pending_call: call }
    );
    buf.low_latency_dispatch_recv(hk).unwrap();
    buf.debug_foreign_use_of_low_latency_memory().unwrap();
    assert_eq!(
        buf.low_latency_dispatch(&inputs, &p).unwrap_err(),
        Error::LowLatencyNeedsClean
    );
    buf.clean_low_latency_buffer().unwrap();
    let got = buf.low_latency_dispatch(&inputs, &p).unwrap();
    assert_eq!(got.outputs, dispatch(&inputs, &p).unwrap());
}
