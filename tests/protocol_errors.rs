//! Errors of a `Buffer` say the truth: an agent that produced nothing is named with its own rank,
//! a mode whose arena was never allocated says so (not "too small"), a combine bias of the wrong
//! hidden width is refused on every combine path, a handle of another call's shape is refused
//! before any phase (the buffer stays usable), and a simulator finding stays a typed
//! [`Violation`] when it crosses the Transport.

mod protocol_support;

use ep_rs::core::buffer::{LlCombineOptions, NormalDispatchArgs};
use ep_rs::core::config::{BufferConfig, Config};
use ep_rs::core::plan::combine::CombineArgs;
use ep_rs::core::plan::intranode::IntranodeHandle;
use ep_rs::core::plan::layout::DispatchLayout;
use ep_rs::core::plan::low_latency::LlParams;
use ep_rs::core::protocol::ProtocolMutation;
use ep_rs::core::transport::{
    AllocRequest, FabricParams, Phase, PhaseReport, Reach, SymAddr, SymAlloc, Team, Transport,
    Violation,
};
use ep_rs::core::{Buffer, Error, Executor, Host, RankInputs, Result, Tensor2};
use ep_rs::sim::Sim;
use protocol_support::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

const R: usize = 3;
const H: usize = 16;
const K: usize = 2;

/// A transport that runs every phase on `inner` without the agents of role `role` on `rank`: as
/// if that agent had ended without leaving its result.
struct Without {
    inner: Sim,
    rank: usize,
    role: &'static str,
}

impl ep_rs::core::RunsAgents for Without {}

impl Transport for Without {
    fn fabric(&self) -> &FabricParams {
        self.inner.fabric()
    }
    fn reach(&self, from: usize, to: usize) -> Reach {
        self.inner.reach(from, to)
    }
    fn alloc(&mut self, req: AllocRequest) -> Result<SymAlloc> {
        self.inner.alloc(req)
    }
    fn barrier(&mut self, team: &Team) -> Result<()> {
        self.inner.barrier(team)
    }
    fn recover(&mut self, team: &Team) -> Result<()> {
        self.inner.recover(team)
    }
    fn read_local(&self, rank: usize, addr: SymAddr, out: &mut [u8]) -> Result<()> {
        self.inner.read_local(rank, addr, out)
    }
    fn write_local(&mut self, rank: usize, addr: SymAddr, bytes: &[u8]) -> Result<()> {
        self.inner.write_local(rank, addr, bytes)
    }
    fn run_phase(&mut self, mut phase: Phase<'_>) -> Result<PhaseReport> {
        phase
            .agents
            .retain(|a| !(a.rank == self.rank && a.role == self.role));
        self.inner.run_phase(phase)
    }
}

fn case_gen() -> Gen {
    Gen {
        num_ranks: R,
        max_tokens: 5,
        num_experts: 2 * R,
        num_topk: K,
        hidden: H,
        fp8: false,
        mask: 0.1,
        full: true,
    }
}

fn args() -> NormalDispatchArgs {
    NormalDispatchArgs::new(Config::new(4, 1, 2, 1, 2).expect("a valid config"))
}

fn layouts<T: Executor<T = Host>>(
    buf: &mut Buffer<T>,
    inputs: &[RankInputs],
) -> Vec<DispatchLayout> {
    let idx: Vec<_> = inputs.iter().map(|i| i.topk_idx.clone()).collect();
    buf.get_dispatch_layout(&idx, case_gen().num_experts)
        .expect("layout")
}

fn normal_config() -> BufferConfig {
    let mut cfg = BufferConfig::new(R);
    cfg.num_nvl_bytes = Buffer::<Sim>::normal_size_hint(R, 5 * R, H, 2, K).div_ceil(128) * 128;
    cfg
}

/// A normal-mode buffer (simulator seed `seed`) whose rank `rank` runs no receiver agent.
fn without_receiver(seed: u64, rank: usize) -> Buffer<Without> {
    let t = Without {
        inner: sim(fabric(R, 4096, 4, 1), seed, policy(seed as u8)),
        rank,
        role: "receiver",
    };
    Buffer::new(t, normal_config()).expect("buffer")
}

#[test]
fn a_dispatch_receiver_that_left_nothing_is_named_by_its_rank() {
    let mut buf = without_receiver(1, 1);
    let inputs = gen_inputs(&case_gen(), 3, false);
    let lay = layouts(&mut buf, &inputs);
    let err = buf
        .dispatch(&inputs, &lay, case_gen().num_experts, &args())
        .expect_err("rank 1's receiver did not run");
    assert!(
        matches!(err, Error::AgentFailed { rank: 1, ref agent, .. } if agent == "receiver"),
        "{err:?}"
    );
}

#[test]
fn a_cached_dispatch_receiver_that_left_nothing_is_named_by_its_rank() {
    let inputs = gen_inputs(&case_gen(), 4, false);
    let mut plain =
        Buffer::new(sim(fabric(R, 4096, 4, 1), 2, policy(2)), normal_config()).expect("buffer");
    let lay = layouts(&mut plain, &inputs);
    let handles: Vec<IntranodeHandle> = plain
        .dispatch(&inputs, &lay, case_gen().num_experts, &args())
        .expect("dispatch")
        .into_iter()
        .map(|d| d.handle)
        .collect();
    let mut buf = without_receiver(2, 2);
    let xs: Vec<_> = inputs.iter().map(|i| &i.x).collect();
    let err = buf
        .dispatch_cached(&xs, &handles)
        .expect_err("rank 2's receiver did not run");
    assert!(
        matches!(err, Error::AgentFailed { rank: 2, ref agent, .. } if agent == "receiver"),
        "{err:?}"
    );
}

#[test]
fn a_missing_arena_is_reported_missing_not_too_small() {
    let inputs = gen_inputs(&case_gen(), 5, false);
    // No normal arena.
    let mut buf = Buffer::new(
        sim(fabric(R, 4096, 4, 1), 3, policy(2)),
        BufferConfig::new(R),
    )
    .expect("buf");
    let lay = layouts(&mut buf, &inputs);
    let err = buf
        .dispatch(&inputs, &lay, case_gen().num_experts, &args())
        .expect_err("no normal arena");
    assert!(
        matches!(err, Error::ArenaMissing { what, .. } if what.contains("normal")),
        "{err:?}"
    );
    // Low-latency mode without a low-latency buffer.
    let mut cfg = BufferConfig::new(R);
    cfg.low_latency_mode = true;
    let mut buf = Buffer::new(sim(fabric(R, 4096, 4, 1), 3, policy(2)), cfg).expect("buf");
    let params = LlParams::new(8, case_gen().num_experts);
    let ll_inputs = gen_inputs(
        &Gen {
            hidden: 128,
            ..case_gen()
        },
        5,
        false,
    );
    let err = buf
        .low_latency_dispatch(&ll_inputs, &params)
        .expect_err("no low-latency buffer");
    assert!(
        matches!(err, Error::ArenaMissing { what, .. } if what.contains("low-latency")),
        "{err:?}"
    );
}

/// A buffer after an in-place dispatch, its handles, expert outputs, and per rank one bias of
/// `H + 1` columns (rows right).
type WrongWidthCase = (
    Buffer<Sim>,
    Vec<IntranodeHandle>,
    Vec<Tensor2<half::bf16>>,
    Vec<Vec<Tensor2<half::bf16>>>,
);

fn wrong_width_case() -> WrongWidthCase {
    let inputs = gen_inputs(&case_gen(), 6, false);
    let mut buf =
        Buffer::new(sim(fabric(R, 4096, 4, 1), 4, policy(0)), normal_config()).expect("buffer");
    let lay = layouts(&mut buf, &inputs);
    let handles: Vec<IntranodeHandle> = buf
        .dispatch_in_place(&inputs, &lay, case_gen().num_experts, &args())
        .expect("dispatch")
        .into_iter()
        .map(|d| d.handle)
        .collect();
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let ys = handles
        .iter()
        .map(|h| rand_bf16_tensor(&mut rng, h.recv_src_idx.len(), H))
        .collect();
    let bias = inputs
        .iter()
        .map(|i| vec![rand_bf16_tensor(&mut rng, i.num_tokens(), H + 1)])
        .collect();
    (buf, handles, ys, bias)
}

fn is_bias_mismatch(e: &Error) -> bool {
    matches!(e, Error::ShapeMismatch { what, .. } if what.contains("bias"))
}

#[test]
fn a_combine_bias_of_the_wrong_hidden_width_is_refused() {
    let (mut buf, handles, ys, bias) = wrong_width_case();
    let cargs: Vec<_> = ys
        .iter()
        .zip(&bias)
        .map(|(y, b)| CombineArgs {
            x: y,
            topk_weights: None,
            bias: b,
        })
        .collect();
    let e = ep_rs::core::plan::intranode::intranode_combine(&handles, &cargs)
        .expect_err("plan: bias of H + 1 columns");
    assert!(is_bias_mismatch(&e), "{e:?}");
    let e = buf
        .combine(&handles, &cargs)
        .expect_err("Buffer::combine: bias of H + 1 columns");
    assert!(is_bias_mismatch(&e), "{e:?}");
    let b: Vec<&[_]> = bias.iter().map(Vec::as_slice).collect();
    let e = buf
        .combine_in_place(&handles, &b)
        .expect_err("combine_in_place: bias of H + 1 columns");
    assert!(is_bias_mismatch(&e), "{e:?}");
    let e = buf
        .combine_from_rows(&handles, &b, false)
        .expect_err("combine_from_rows: bias of H + 1 columns");
    assert!(is_bias_mismatch(&e), "{e:?}");
}

#[test]
fn a_simulator_finding_crosses_the_transport_typed() {
    // A sender that stores its last row after releasing `done` is caught within a few seeds;
    // the error a `Buffer` returns carries the simulator's typed finding, not its text.
    let found = (0..24u64).find_map(|seed| {
        let mut buf = Buffer::new(
            sim(fabric(R, 4096, 4, 1), seed, policy(seed as u8)),
            normal_config(),
        )
        .expect("buffer");
        buf.set_mutation_for_test(ProtocolMutation::ReleaseBeforeLastRow);
        let inputs = gen_inputs(&case_gen(), seed, false);
        let lay = layouts(&mut buf, &inputs);
        buf.dispatch(&inputs, &lay, case_gen().num_experts, &args())
            .err()
            .filter(|e| e.violation().is_some())
    });
    let e = found.expect("the planted bug is caught as a violation within 24 seeds");
    assert!(
        matches!(
            e,
            Error::ProtocolViolation { ref violation, rank }
                if rank == violation.rank() && matches!(
                    **violation,
                    Violation::StoreNotPublished { .. }
                        | Violation::ReadOfPoison { .. }
                        | Violation::DataRace { .. }
                )
        ),
        "{e:?}"
    );
}

/// Cached dispatch and combine refuse a handle of another call's shape with the handle error of
/// the rank it belongs to (`buffer::check::normal_handle`, the rules the GPU shares), before any
/// phase: the buffer stays usable and the next calls with the right handles equal the plan.
#[test]
fn a_handle_of_another_shape_is_refused_and_the_buffer_stays_usable() {
    let inputs = gen_inputs(&case_gen(), 7, false);
    let mut buf =
        Buffer::new(sim(fabric(R, 4096, 4, 1), 7, policy(1)), normal_config()).expect("buffer");
    let lay = layouts(&mut buf, &inputs);
    let handles: Vec<IntranodeHandle> = buf
        .dispatch(&inputs, &lay, case_gen().num_experts, &args())
        .expect("dispatch")
        .into_iter()
        .map(|d| d.handle)
        .collect();
    let xs: Vec<_> = inputs.iter().map(|i| &i.x).collect();
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let ys: Vec<_> = handles
        .iter()
        .map(|h| rand_bf16_tensor(&mut rng, h.recv_src_idx.len(), H))
        .collect();
    fn cargs(ys: &[Tensor2<half::bf16>]) -> Vec<CombineArgs<'_>> {
        ys.iter()
            .map(|y| CombineArgs {
                x: y,
                topk_weights: None,
                bias: &[],
            })
            .collect()
    }
    let c = handles[1].channel_prefix_matrix.cols();
    let t = handles[1].send_head.rows();
    type Edit = fn(&mut IntranodeHandle, usize, usize);
    // (the edit, what the combine's error names, what the cached dispatch's names): a combine
    // takes its token count from send_head, a cached dispatch from x.
    let edits: [(Edit, &str, &str); 4] = [
        (
            |h, _, _| h.rank_prefix_matrix = Tensor2::filled(R, R - 1, 0),
            "rank_prefix_matrix",
            "rank_prefix_matrix",
        ),
        (
            |h, c, _| h.recv_channel_prefix_matrix = Tensor2::filled(R, c + 1, 0),
            "recv_channel_prefix_matrix",
            "recv_channel_prefix_matrix",
        ),
        (
            |h, _, t| h.send_head = Tensor2::filled(t + 1, R, -1),
            "is_token_in_rank",
            "send_head",
        ),
        (
            |h, _, _| h.num_recv_tokens = h.recv_src_idx.len() + 1,
            "received rows",
            "received rows",
        ),
    ];
    for (edit, in_combine, in_cached) in edits {
        let mut bad = handles.clone();
        edit(&mut bad[1], c, t);
        let names = |e: &Error, what: &str| matches!(e, Error::LayoutMismatch { rank: 1, field: "handle", detail } if detail.contains(what));
        let e = buf.combine(&bad, &cargs(&ys)).expect_err(in_combine);
        assert!(names(&e, in_combine), "combine, {in_combine}: {e:?}");
        let e = buf.dispatch_cached(&xs, &bad).expect_err(in_cached);
        assert!(names(&e, in_cached), "cached dispatch, {in_cached}: {e:?}");
    }
    // Still usable: the right handles give the plan's outputs.
    let want: Vec<_> = (0..R)
        .map(|d| ep_rs::core::plan::intranode::intranode_dispatch_cached(&xs, &handles, d))
        .collect::<Result<_>>()
        .expect("plan: cached dispatch");
    assert_eq!(
        buf.dispatch_cached(&xs, &handles).expect("cached dispatch"),
        want
    );
    let want = ep_rs::core::plan::intranode::intranode_combine(&handles, &cargs(&ys))
        .expect("plan: combine");
    assert_eq!(buf.combine(&handles, &cargs(&ys)).expect("combine"), want);
}

/// The executor's per-token input checks (`Executor::check_*`) run before the call number is
/// taken: a bad routing, a layout that is not the routing's, too few worst-token rows, or a
/// low-latency combine whose routing changed is a typed error, and the buffer stays usable
/// (not poisoned, no call taken); the next valid call runs.
#[test]
fn per_token_input_errors_take_no_call_and_leave_the_buffer_usable() {
    let g = case_gen();
    let inputs = gen_inputs(&g, 7, false);
    let mut buf =
        Buffer::new(sim(fabric(R, 4096, 4, 1), 7, policy(1)), normal_config()).expect("buffer");
    let lay = layouts(&mut buf, &inputs);
    let refused = |buf: &Buffer<Sim>, err: Error, before: u64| {
        assert!(buf.poisoned().is_none(), "{err:?} poisoned the buffer");
        assert_eq!(buf.last_call(), before, "{err:?} took a call number");
        err
    };

    let mut bad = inputs.clone();
    bad[1].topk_idx.set(0, 0, g.num_experts as i64);
    let err = buf
        .dispatch(&bad, &lay, g.num_experts, &args())
        .expect_err("expert id out of range");
    let err = refused(&buf, err, 0);
    assert!(
        matches!(
            err,
            Error::ExpertOutOfRange {
                rank: 1,
                token: 0,
                slot: 0,
                ..
            }
        ),
        "{err:?}"
    );

    let mut off = lay.clone();
    off[2].num_tokens_per_rank[0] += 1;
    let err = buf
        .dispatch_in_place(&inputs, &off, g.num_experts, &args())
        .expect_err("a layout that is not the routing's");
    let err = refused(&buf, err, 0);
    assert!(
        matches!(err, Error::LayoutMismatch { rank: 2, .. }),
        "{err:?}"
    );

    let worst = NormalDispatchArgs {
        num_worst_tokens: 1,
        ..args()
    };
    let err = buf
        .dispatch(&inputs, &lay, g.num_experts, &worst)
        .expect_err("one worst-token row for several received");
    let err = refused(&buf, err, 0);
    assert!(
        matches!(
            err,
            Error::WorstTokensTooSmall {
                num_worst_tokens: 1,
                ..
            }
        ),
        "{err:?}"
    );

    buf.dispatch(&inputs, &lay, g.num_experts, &args())
        .expect("the valid dispatch runs");
    assert_eq!(buf.last_call(), 1);

    // Low latency: a combine whose weights differ from its dispatch's.
    let ll_g = Gen { hidden: 128, ..g };
    let ll_inputs = gen_inputs(&ll_g, 8, false);
    let (n, e) = (8, ll_g.num_experts);
    let mut ll = ll_buffer(sim(fabric(R, 1 << 20, 8, 2), 8, policy(0)), n, 128, R, e, 2);
    let got = ll
        .low_latency_dispatch(&ll_inputs, &LlParams::new(n, e))
        .expect("dispatch");
    let y = ll_identity_outputs(&got.outputs);
    let mut changed = ll_inputs.clone();
    let w = changed[0].topk_weights.get(0, 0);
    changed[0].topk_weights.set(0, 0, w + 1.0);
    let before = ll.last_call();
    let err = ll
        .low_latency_combine(&got.routes, &y, &changed, LlCombineOptions::default())
        .expect_err("routing changed since dispatch");
    let err = refused(&ll, err, before);
    assert!(
        matches!(err, Error::LowLatencyRoutingChanged { rank: 0 }),
        "{err:?}"
    );
    ll.low_latency_combine(&got.routes, &y, &ll_inputs, LlCombineOptions::default())
        .expect("the valid combine runs");
    assert_eq!(ll.last_call(), before + 1);
}
