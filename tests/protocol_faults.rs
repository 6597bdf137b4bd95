//! Faults on a `Buffer` (docs/protocol.md §7): each injected fault (dead rank, stalled rank, QP in
//! error state, dropped completion) in each mode (normal dispatch and combine, low-latency
//! dispatch and combine) ends in bounded virtual time in a typed error naming the right rank (and
//! QP), poisons the buffer, and after the fault is cleared and `Buffer::reset()` runs, fresh calls
//! equal the plan exactly. Shrink mode: a dead rank during low-latency dispatch or combine gives
//! the plan's result with that rank masked, `query_mask` reports it, later calls skip it. Threads
//! mode: the same for one fault, in wall-clock time.

mod protocol_support;

use std::time::Duration;

use ep_rs::core::buffer::{LlCombineOptions, NormalDispatchArgs};
use ep_rs::core::config::{BufferConfig, Config};
use ep_rs::core::plan::combine::CombineArgs;
use ep_rs::core::plan::intranode::{intranode_combine, intranode_dispatch_all};
use ep_rs::core::plan::low_latency::{
    LlParams, PartialPrecision, combine_reduced_on_expert_rank, dispatch,
};
use ep_rs::core::transport::{FabricParams, QpIndex, fault_rank, is_fault};
use ep_rs::core::{Buffer, Error, Executor, Host, RankInputs, Tensor2, Tensor3};
use ep_rs::sim::{Fault, Sim, SimConfig, ThreadSim, Trigger};
use half::bf16;
use protocol_support::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const R: usize = 4;
const N: usize = 4;
const L: usize = 2;
const K: usize = 3;
const H: usize = 128;
/// Wait bound, in virtual ticks: small, so a fault costs little virtual time.
const BOUND: u64 = 3_000;
/// The rank the faults hit, and the rank whose QP towards it fails.
const X: usize = 2;
const A: usize = 1;

fn config(normal: bool, shrink: bool) -> BufferConfig {
    let mut cfg = BufferConfig::new(R);
    if normal {
        cfg.num_nvl_bytes = Buffer::<Sim>::normal_size_hint(R, R * N, H, 2, K).div_ceil(128) * 128;
    } else {
        cfg.low_latency_mode = true;
        cfg.enable_shrink = shrink;
        cfg.num_qps_per_rank = 2;
        cfg.num_rdma_bytes =
            Buffer::<Sim>::low_latency_size_hint(N, H, R, R * L).div_ceil(128) * 128;
    }
    cfg
}

/// Normal mode: one node (NVLink); low-latency: one rank per node (RDMA), QP depth 2.
fn fab(normal: bool) -> FabricParams {
    let mut f = fabric(R, 1 << 20, 2, 2);
    if !normal {
        f.ranks_per_node = 1;
    }
    f
}

fn buffer(normal: bool, shrink: bool, seed: u64) -> Buffer<Sim> {
    let s = Sim::new(
        SimConfig::new(fab(normal), seed)
            .policy(policy(seed as u8))
            .wait_timeout(BOUND),
    );
    Buffer::new(s, config(normal, shrink)).unwrap()
}

fn inputs_of(rng: &mut ChaCha8Rng, distinct: bool) -> Vec<RankInputs> {
    let g = Gen {
        num_ranks: R,
        max_tokens: N,
        num_experts: R * L,
        num_topk: K,
        hidden: H,
        fp8: false,
        mask: 0.1,
        full: true,
    };
    gen_inputs(&g, rng.random(), distinct)
}

// ---- normal mode ------------------------------------------------------------------------------

struct NormalDone {
    handles: Vec<ep_rs::core::plan::intranode::IntranodeHandle>,
}

fn normal_dispatch<T: Executor<T = Host>>(
    buf: &mut Buffer<T>,
    inputs: &[RankInputs],
) -> Result<NormalDone, Error> {
    let topk: Vec<_> = inputs.iter().map(|i| i.topk_idx.clone()).collect();
    let layouts = buf.get_dispatch_layout(&topk, R * L).unwrap();
    let (args, opts) = two_channel_dispatch();
    let got = buf.dispatch(inputs, &layouts, R * L, &args)?;
    assert_eq!(
        got,
        intranode_dispatch_all(inputs, &layouts, R * L, &opts).unwrap()
    );
    Ok(NormalDone {
        handles: got.iter().map(|o| o.handle.clone()).collect(),
    })
}

fn normal_combine<T: Executor<T = Host>>(
    buf: &mut Buffer<T>,
    done: &NormalDone,
    rng: &mut ChaCha8Rng,
) -> Result<(), Error> {
    let ys: Vec<_> = done
        .handles
        .iter()
        .map(|h| rand_bf16_tensor(rng, h.recv_src_idx.len(), H))
        .collect();
    let args: Vec<_> = ys
        .iter()
        .map(|x| CombineArgs {
            x,
            topk_weights: None,
            bias: &[],
        })
        .collect();
    let got = buf.combine(&done.handles, &args)?;
    assert_eq!(got, intranode_combine(&done.handles, &args).unwrap());
    Ok(())
}

fn normal_round<T: Executor<T = Host>>(
    buf: &mut Buffer<T>,
    rng: &mut ChaCha8Rng,
) -> Result<(), Error> {
    let inputs = inputs_of(rng, false);
    let d = normal_dispatch(buf, &inputs)?;
    normal_combine(buf, &d, rng)
}

// ---- low-latency mode -------------------------------------------------------------------------

struct LlDone {
    inputs: Vec<RankInputs>,
    got: ep_rs::core::buffer::LlDispatched,
    params: LlParams,
}

/// Low-latency dispatch; the outputs must equal the plan under the buffer's mask *after* the
/// call (ranks masked by the call included).
fn ll_dispatch<T: Executor<T = Host>>(
    buf: &mut Buffer<T>,
    inputs: Vec<RankInputs>,
) -> Result<LlDone, Error> {
    let p = LlParams::new(N, R * L).with_masked_ranks(buf.masked_ranks().to_vec());
    let got = buf.low_latency_dispatch(&inputs, &p)?;
    let params = LlParams::new(N, R * L).with_masked_ranks(buf.masked_ranks().to_vec());
    assert_eq!(got.outputs, dispatch(&inputs, &params).unwrap());
    Ok(LlDone {
        inputs,
        got,
        params,
    })
}

/// Low-latency combine of a dispatch; equal to the plan under the mask after the call.
fn ll_combine<T: Executor<T = Host>>(
    buf: &mut Buffer<T>,
    d: &LlDone,
    rng: &mut ChaCha8Rng,
    zero_copy: bool,
) -> Result<(), Error> {
    let y: Vec<Option<Tensor3<bf16>>> = (0..R)
        .map(|r| {
            d.got.outputs[r]
                .is_some()
                .then(|| rand_bf16_tensor3(rng, L, R * N, H))
        })
        .collect();
    let out = buf.low_latency_combine(
        &d.got.routes,
        &y,
        &d.inputs,
        LlCombineOptions::default().with_zero_copy(zero_copy),
    )?;
    let handles: Vec<_> = d
        .got
        .outputs
        .iter()
        .map(|o| o.as_ref().map(|o| o.handle.clone()))
        .collect();
    let p = d
        .params
        .clone()
        .with_masked_ranks(buf.masked_ranks().to_vec());
    let want = combine_reduced_on_expert_rank(&d.inputs, &handles, &y, &p, PartialPrecision::Bf16)
        .unwrap();
    assert_eq!(out, want);
    Ok(())
}

fn ll_round<T: Executor<T = Host>>(buf: &mut Buffer<T>, rng: &mut ChaCha8Rng) -> Result<(), Error> {
    let d = ll_dispatch(buf, inputs_of(rng, true))?;
    let zc = rng.random_bool(0.5);
    ll_combine(buf, &d, rng, zc)
}

// ---- the matrix -------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Dead,
    Stalled,
    QpError,
    DroppedCompletion,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    NormalDispatch,
    NormalCombine,
    LlDispatch,
    LlCombine,
}

impl Mode {
    fn normal(self) -> bool {
        matches!(self, Mode::NormalDispatch | Mode::NormalCombine)
    }
}

/// The fault, armed to strike from now on.
fn fault(kind: Kind, sim: &Sim) -> Fault {
    match kind {
        Kind::Dead => Fault::DeadRank {
            rank: X,
            at: Trigger::AfterOps(0),
        },
        Kind::Stalled => Fault::StalledRank {
            rank: X,
            at: Trigger::AfterOps(0),
            ticks: 20 * BOUND,
        },
        Kind::QpError => Fault::QpError {
            src: A,
            dst: X,
            qp: QpIndex(0),
            after_wrs: 0,
        },
        Kind::DroppedCompletion => Fault::DroppedCompletion {
            src: A,
            dst: X,
            qp: QpIndex(0),
            nth: sim.qp_posted(A, X, QpIndex(0)) + 1,
        },
    }
}

/// Whether the fault can touch the mode: normal intranode mode posts no work requests (QP faults
/// never strike), and no low-latency phase waits on a stalled rank's agents (the simulator runs
/// a phase until every agent finished: a stall is slowness there, not a timeout).
fn fails(kind: Kind, mode: Mode) -> bool {
    match kind {
        Kind::Dead => true,
        Kind::Stalled => mode.normal(),
        Kind::QpError | Kind::DroppedCompletion => !mode.normal(),
    }
}

/// The typed error names rank `X` (and the QP `A -> X` where relevant).
fn check_names_the_rank(kind: Kind, e: &Error) {
    assert!(is_fault(e), "{kind:?}: not a fault: {e}");
    match (kind, e) {
        (Kind::QpError, Error::QpError { rank, peer, qp, .. }) => {
            assert_eq!((*rank, *peer, *qp), (A, X, 0), "{e}");
        }
        (Kind::DroppedCompletion, Error::CompletionTimeout { rank, peer, qp, .. }) => {
            assert_eq!((*rank, *peer, *qp), (A, X, 0), "{e}");
        }
        (Kind::Dead | Kind::Stalled, Error::WaitTimeout { rank, what, .. }) => {
            assert_ne!(*rank, X, "{e}");
            assert!(what.contains(&format!("rank {X}")), "{e}");
        }
        (Kind::Dead, Error::CompletionTimeout { peer, .. }) => assert_eq!(*peer, X, "{e}"),
        (Kind::Dead, Error::RankFailed { rank, .. }) => assert_eq!(*rank, X, "{e}"),
        _ => panic!("{kind:?}: unexpected error {e}"),
    }
    let s = e.to_string();
    assert!(s.contains(&format!("rank {X}")), "{s}");
}

fn matrix_case(kind: Kind, mode: Mode, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xfa17);
    let mut buf = buffer(mode.normal(), false, seed);
    // A clean call first, so the fault strikes mid-sequence.
    if mode.normal() {
        normal_round(&mut buf, &mut rng).unwrap();
    } else {
        ll_round(&mut buf, &mut rng).unwrap();
    }
    let t0 = buf.transport().now();
    let arm = |buf: &mut Buffer<Sim>| {
        let f = fault(kind, buf.transport());
        buf.transport_mut().set_faults(vec![f]);
    };
    let res = match mode {
        Mode::NormalDispatch => {
            arm(&mut buf);
            normal_round(&mut buf, &mut rng)
        }
        Mode::NormalCombine => {
            let d = normal_dispatch(&mut buf, &inputs_of(&mut rng, false)).unwrap();
            arm(&mut buf);
            normal_combine(&mut buf, &d, &mut rng)
        }
        Mode::LlDispatch => {
            arm(&mut buf);
            ll_round(&mut buf, &mut rng)
        }
        Mode::LlCombine => {
            let d = ll_dispatch(&mut buf, inputs_of(&mut rng, true)).unwrap();
            arm(&mut buf);
            ll_combine(&mut buf, &d, &mut rng, seed.is_multiple_of(2))
        }
    };
    if !fails(kind, mode) {
        res.unwrap_or_else(|e| panic!("{kind:?} x {mode:?}: legal here, got {e}"));
        assert!(buf.poisoned().is_none());
        return;
    }
    let e = res.expect_err("the fault must fail the call");
    check_names_the_rank(kind, &e);
    let elapsed = buf.transport().now() - t0;
    assert!(
        elapsed <= 30 * BOUND,
        "{kind:?} x {mode:?}: {elapsed} ticks"
    );
    if seed == 0 {
        eprintln!("{kind:?} x {mode:?}: {e}");
    }
    // Poisoned: every call refuses, naming the failure and the rank.
    let poisoned = buf.poisoned().expect("poisoned");
    assert!(
        matches!(&poisoned, Error::BufferPoisoned { failed_rank: Some(X), cause, .. } if **cause == e),
        "{poisoned}"
    );
    assert_eq!(fault_rank(&poisoned), Some(X));
    let next = if mode.normal() {
        normal_round(&mut buf, &mut rng)
    } else {
        ll_round(&mut buf, &mut rng)
    };
    assert_eq!(next.unwrap_err(), poisoned);
    if seed == 0 {
        eprintln!("next call: {poisoned}");
    }
    // Repair, reset, exact again (both rounds of the mode, twice).
    buf.transport_mut().clear_faults();
    buf.reset().unwrap();
    assert!(buf.poisoned().is_none());
    for _ in 0..2 {
        if mode.normal() {
            normal_round(&mut buf, &mut rng).unwrap();
        } else {
            ll_round(&mut buf, &mut rng).unwrap();
        }
    }
}

macro_rules! matrix {
    ($($name:ident: $kind:expr, $mode:expr;)*) => {$(
        #[test]
        fn $name() {
            for seed in 0..3 {
                matrix_case($kind, $mode, seed);
            }
        }
    )*};
}

matrix! {
    dead_rank_normal_dispatch: Kind::Dead, Mode::NormalDispatch;
    dead_rank_normal_combine: Kind::Dead, Mode::NormalCombine;
    dead_rank_ll_dispatch: Kind::Dead, Mode::LlDispatch;
    dead_rank_ll_combine: Kind::Dead, Mode::LlCombine;
    stalled_rank_normal_dispatch: Kind::Stalled, Mode::NormalDispatch;
    stalled_rank_normal_combine: Kind::Stalled, Mode::NormalCombine;
    stalled_rank_ll_dispatch_is_legal_slowness: Kind::Stalled, Mode::LlDispatch;
    stalled_rank_ll_combine_is_legal_slowness: Kind::Stalled, Mode::LlCombine;
    qp_error_normal_dispatch_posts_nothing: Kind::QpError, Mode::NormalDispatch;
    qp_error_normal_combine_posts_nothing: Kind::QpError, Mode::NormalCombine;
    qp_error_ll_dispatch: Kind::QpError, Mode::LlDispatch;
    qp_error_ll_combine: Kind::QpError, Mode::LlCombine;
    dropped_completion_normal_dispatch_posts_nothing: Kind::DroppedCompletion, Mode::NormalDispatch;
    dropped_completion_normal_combine_posts_nothing: Kind::DroppedCompletion, Mode::NormalCombine;
    dropped_completion_ll_dispatch: Kind::DroppedCompletion, Mode::LlDispatch;
    dropped_completion_ll_combine: Kind::DroppedCompletion, Mode::LlCombine;
}

/// A reset while the dead rank is still dead fails, naming it; the buffer stays poisoned.
#[test]
fn reset_needs_every_rank_alive() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let mut buf = buffer(true, false, 3);
    buf.transport_mut().set_faults(vec![Fault::DeadRank {
        rank: X,
        at: Trigger::AfterOps(0),
    }]);
    normal_round(&mut buf, &mut rng).unwrap_err();
    let e = buf.reset().unwrap_err();
    assert!(matches!(e, Error::ResetNeedsRank { rank: X, .. }), "{e}");
    eprintln!("reset with rank {X} dead: {e}");
    assert!(buf.poisoned().is_some());
    buf.transport_mut().clear_faults();
    buf.reset().unwrap();
    normal_round(&mut buf, &mut rng).unwrap();
}

// ---- shrink -----------------------------------------------------------------------------------

/// A dead rank during low-latency dispatch (at its start, or part-way through) or combine: the
/// call returns the plan's result with it masked; `query_mask` reports it; later calls skip it
/// without waiting; after repair, `clean_mask` and `reset`, every rank takes part again.
#[test]
fn shrink_masks_a_dead_rank_exactly() {
    for seed in 0..6u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut buf = buffer(false, true, seed);
        ll_round(&mut buf, &mut rng).unwrap();
        let in_combine = seed % 3 == 2;
        let at = match seed % 3 {
            0 => Trigger::AfterOps(0),
            // Part-way through the dispatch's send half: some messages left, others not.
            1 => Trigger::AtTick(buf.transport().now() + 40),
            _ => Trigger::AfterOps(0),
        };
        let dead = Fault::DeadRank { rank: X, at };
        let t0 = buf.transport().now();
        if in_combine {
            let d = ll_dispatch(&mut buf, inputs_of(&mut rng, true)).unwrap();
            buf.transport_mut().set_faults(vec![dead]);
            ll_combine(&mut buf, &d, &mut rng, seed.is_multiple_of(2)).unwrap();
        } else {
            buf.transport_mut().set_faults(vec![dead]);
            ll_round(&mut buf, &mut rng).unwrap();
        }
        let mut want = vec![0; R];
        want[X] = 1;
        assert_eq!(buf.query_mask().unwrap(), want, "seed {seed}");
        assert!(buf.poisoned().is_none());
        assert!(buf.transport().now() - t0 <= 20 * BOUND);
        // Later calls skip it: no wait expires any more.
        let t1 = buf.transport().now();
        for _ in 0..2 {
            ll_round(&mut buf, &mut rng).unwrap();
        }
        assert!(
            buf.transport().now() - t1 < BOUND,
            "later calls waited for the masked rank"
        );
        // Repair and rejoin.
        buf.transport_mut().clear_faults();
        buf.clean_mask().unwrap();
        buf.reset().unwrap();
        ll_round(&mut buf, &mut rng).unwrap();
        assert_eq!(buf.query_mask().unwrap(), vec![0; R]);
    }
}

/// A QP error or a dropped completion towards a rank in shrink mode masks that rank (it is
/// unreachable from a peer), with the plan's masked result.
#[test]
fn shrink_masks_an_unreachable_rank() {
    for (i, kind) in [Kind::QpError, Kind::DroppedCompletion]
        .into_iter()
        .enumerate()
    {
        let mut rng = ChaCha8Rng::seed_from_u64(40 + i as u64);
        let mut buf = buffer(false, true, 40 + i as u64);
        ll_round(&mut buf, &mut rng).unwrap();
        let f = fault(kind, buf.transport());
        buf.transport_mut().set_faults(vec![f]);
        ll_round(&mut buf, &mut rng).unwrap();
        assert!(buf.masked_ranks()[X], "{kind:?}");
        assert_eq!(buf.masked_ranks().iter().filter(|&&m| m).count(), 1);
        ll_round(&mut buf, &mut rng).unwrap();
    }
}

/// Normal mode never masks: with shrink enabled, a dead rank still poisons.
#[test]
fn shrink_does_not_apply_to_normal_mode() {
    let mut cfg = config(true, false);
    cfg.low_latency_mode = true;
    cfg.enable_shrink = true;
    cfg.num_rdma_bytes = Buffer::<Sim>::low_latency_size_hint(N, H, R, R * L).div_ceil(128) * 128;
    let s = Sim::new(SimConfig::new(fab(true), 8).wait_timeout(BOUND));
    let mut buf = Buffer::new(s, cfg).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    buf.transport_mut().set_faults(vec![Fault::DeadRank {
        rank: X,
        at: Trigger::AfterOps(0),
    }]);
    normal_round(&mut buf, &mut rng).unwrap_err();
    assert!(buf.poisoned().is_some());
    assert_eq!(buf.query_mask().unwrap(), vec![0; R]);
}

// ---- threads mode -----------------------------------------------------------------------------

/// Threads mode, wall-clock bound (1 s): a dead rank in normal dispatch fails naming it and poisons;
/// after repair and reset the calls are exact. In shrink mode, a dead rank during low-latency
/// dispatch is masked with the plan's result.
#[test]
fn threads_mode_poison_reset_and_shrink() {
    // Generous for healthy waits on a loaded 2-core CI machine (many agent threads per core).
    let bound = Duration::from_millis(1000);
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let mut buf = Buffer::new(ThreadSim::new(fab(true), bound), config(true, false)).unwrap();
    normal_round(&mut buf, &mut rng).unwrap();
    buf.transport_mut().set_faults(vec![Fault::DeadRank {
        rank: X,
        at: Trigger::AfterOps(0),
    }]);
    let e = normal_round(&mut buf, &mut rng).unwrap_err();
    assert!(is_fault(&e), "{e}");
    assert!(
        matches!(
            buf.poisoned(),
            Some(Error::BufferPoisoned {
                failed_rank: Some(X),
                ..
            })
        ),
        "{e}"
    );
    assert!(matches!(
        normal_round(&mut buf, &mut rng),
        Err(Error::BufferPoisoned { .. })
    ));
    buf.transport_mut().clear_faults();
    buf.reset().unwrap();
    normal_round(&mut buf, &mut rng).unwrap();

    let mut buf = Buffer::new(ThreadSim::new(fab(false), bound), config(false, true)).unwrap();
    ll_round(&mut buf, &mut rng).unwrap();
    buf.transport_mut().set_faults(vec![Fault::DeadRank {
        rank: X,
        at: Trigger::AfterOps(0),
    }]);
    ll_round(&mut buf, &mut rng).unwrap();
    assert!(buf.masked_ranks()[X]);
    ll_round(&mut buf, &mut rng).unwrap();
}

// ---- rows left in place -----------------------------------------------------------------------

/// The in-place calls (docs/protocol.md §2.6) under a dead rank: the dispatch, the expert phase
/// and the combine each fail naming the rank and poison the buffer (host reads of the rows too);
/// after repair and reset the rows are gone (a typed error says to dispatch again) and a fresh
/// in-place dispatch and combine equal the plan.
#[test]
fn in_place_calls_poison_and_reset() {
    for step in 0..3 {
        let mut rng = ChaCha8Rng::seed_from_u64(40 + step);
        let mut buf = buffer(true, false, 40 + step);
        let inputs = inputs_of(&mut rng, false);
        let topk: Vec<_> = inputs.iter().map(|i| i.topk_idx.clone()).collect();
        let layouts = buf.get_dispatch_layout(&topk, R * L).unwrap();
        let args = NormalDispatchArgs::new(Config::new(4, 1, 2, 1, 2).unwrap());
        let dead = vec![Fault::DeadRank {
            rank: X,
            at: Trigger::AfterOps(0),
        }];
        let no_bias: Vec<&[Tensor2<bf16>]> = vec![&[]; R];
        if step == 0 {
            buf.transport_mut().set_faults(dead.clone());
        }
        let got = buf.dispatch_in_place(&inputs, &layouts, R * L, &args);
        let e = match (step, got) {
            (0, Err(e)) => e,
            (0, Ok(_)) => panic!("the dispatch survived a dead rank"),
            (_, got) => {
                let handles: Vec<_> = got.unwrap().iter().map(|d| d.handle.clone()).collect();
                buf.transport_mut().set_faults(dead.clone());
                if step == 1 {
                    buf.apply_expert(&|_, _, _, _| Ok(())).unwrap_err()
                } else {
                    buf.combine_in_place(&handles, &no_bias).unwrap_err()
                }
            }
        };
        check_names_the_rank(Kind::Dead, &e);
        assert!(buf.poisoned().is_some(), "step {step}");
        let mut x = ep_rs::core::Activations::Bf16(Tensor2::zeros(1, H));
        assert!(matches!(
            buf.read_recv_x(0, 0, &mut x),
            Err(Error::BufferPoisoned { .. })
        ));
        buf.transport_mut().clear_faults();
        buf.reset().unwrap();
        assert!(matches!(
            buf.read_recv_x(0, 0, &mut x),
            Err(Error::Unsupported(_))
        ));
        let got = buf
            .dispatch_in_place(&inputs, &layouts, R * L, &args)
            .unwrap();
        let opts = two_channel_dispatch().1;
        let want = intranode_dispatch_all(&inputs, &layouts, R * L, &opts).unwrap();
        let handles: Vec<_> = got.iter().map(|d| d.handle.clone()).collect();
        let combined = buf.combine_in_place(&handles, &no_bias).unwrap();
        let cargs: Vec<_> = want
            .iter()
            .map(|w| CombineArgs {
                x: match &w.recv_x {
                    ep_rs::core::Activations::Bf16(x) => x,
                    _ => unreachable!("BF16 inputs"),
                },
                topk_weights: w.recv_topk_weights.as_ref(),
                bias: &[],
            })
            .collect();
        assert_eq!(
            combined,
            intranode_combine(&handles, &cargs).unwrap(),
            "step {step}"
        );
    }
}
