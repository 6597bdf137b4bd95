//! Small protocols written in the vocabulary, each with planted bugs (mutations), shared by the
//! mutation suite, the replay tests and the property tests.

#![allow(dead_code, unreachable_pub, reason = "each test target uses a subset")]

use ep_core::transport::{
    AgentCtx, AllocRequest, Cmp, FabricParams, Init, Phase, PhaseKind, QpFullPolicy, QpIndex,
    Region, RingDecl, SignalOp, SymAddr, SymAlloc, Transport, WaitUntil,
};
use ep_sim::{Policy, Sim, SimConfig, SimError};

/// A planted bug.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutation {
    /// The correct protocol.
    None,
    /// Ring: the tail update goes on another QP than the data it publishes.
    SignalOnOtherQp,
    /// Ring: the producer waits for `i - head <= cap` instead of `< cap`.
    RingOverflowByOne,
    /// Count-then-data: no fence between the rows and the count that publishes them.
    MissingFence,
    /// Count-then-data: the receiver does not reset its counters for the next call.
    CounterNotReset,
    /// Double buffer: the hook of call k runs after call k + 2 (the next call on its buffer).
    HookAfterNextCall,
    /// Double buffer: the send half does not quiet, so the next call overwrites live sources.
    SourceReusedBeforeQuiet,
    /// Credit stream: a chunk-straddling put is counted as one work request.
    StraddleUncounted,
    /// Ring: the consumer reads an entry before waiting for its tail.
    ReadBeforeTail,
}

/// Deterministic test bytes for (a, b, c).
pub fn pattern(a: u64, b: u64, c: u64, len: usize) -> Vec<u8> {
    let mut x = a.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ b.wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        ^ c.wrapping_add(0x1656_67B1);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

pub fn alloc(t: &mut impl Transport, name: &str, bytes: u64, init: Init) -> SymAlloc {
    t.alloc(AllocRequest {
        name: name.into(),
        bytes,
        align: 128,
        init,
    })
    .expect("alloc")
}

fn until(rank: usize, word: SymAddr, cmp: Cmp, value: u64, what: String) -> WaitUntil {
    WaitUntil {
        rank,
        word,
        cmp,
        value,
        what,
    }
}

pub fn sim(fabric: FabricParams, seed: u64, policy: Policy) -> Sim {
    Sim::new(SimConfig::new(fabric, seed).policy(policy))
}

/// The policy for a seed: cycles through uniform, PCT and latest-legal.
pub fn policy_for(seed: u64) -> Policy {
    match seed % 3 {
        0 => Policy::Uniform,
        1 => Policy::Pct {
            depth: 3,
            horizon: 400,
        },
        _ => Policy::LatestLegal,
    }
}

fn custom(name: &str, call: u64) -> Phase<'static> {
    Phase::new(PhaseKind::Custom(name.into()), call)
}

// ---- ring with head/tail over RDMA --------------------------------------------------------

/// Ring parameters.
#[derive(Debug, Clone, Copy)]
pub struct RingParams {
    pub ranks: usize,
    pub capacity: u64,
    pub entries: u64,
    pub slot_bytes: u64,
    pub staging: u64,
    pub qp_depth: u32,
}

impl Default for RingParams {
    fn default() -> Self {
        RingParams {
            ranks: 2,
            capacity: 2,
            entries: 6,
            slot_bytes: 32,
            staging: 2,
            qp_depth: 4,
        }
    }
}

/// Each rank r produces `entries` entries into the ring on rank (r + 1) % n over RDMA (data put
/// on QP 0, then tail `amo_add` on QP 0; the consumer returns credits with `amo_add` on the
/// producer's head word over QP 1). The producer stages each entry in one of `staging` local
/// slots and quiets before reusing one. Returns the sim for inspection.
pub fn ring(mutation: Mutation, p: RingParams, seed: u64, policy: Policy) -> Result<Sim, SimError> {
    let mut f = FabricParams::single_node(p.ranks);
    f.ranks_per_node = 1; // every peer over RDMA
    f.rc_per_pe = 2;
    f.qp_depth = p.qp_depth;
    let mut s = sim(f, seed, policy);
    let slots = alloc(
        &mut s,
        "ring slots",
        p.capacity * p.slot_bytes,
        Init::Poison,
    );
    let tail = alloc(&mut s, "ring tail", 16, Init::Zero);
    let head = alloc(&mut s, "ring head", 16, Init::Zero);
    let staging = alloc(&mut s, "staging", p.staging * p.slot_bytes, Init::Poison);
    let out = alloc(&mut s, "out", p.entries * p.slot_bytes, Init::Poison);
    let n = p.ranks;
    let mut phase = custom("ring", 1);
    for r in 0..n {
        let peer = (r + 1) % n;
        let from = (r + n - 1) % n;
        phase = phase.ring(RingDecl {
            name: format!("ring {from}->{r}"),
            rank: r,
            slots: slots.at(0),
            slot_bytes: p.slot_bytes,
            capacity: p.capacity,
            tail: tail.at(0),
            head_rank: from,
            head: head.at(0),
        });
        let (slots, tail, head, staging, out) = (
            slots.clone(),
            tail.clone(),
            head.clone(),
            staging.clone(),
            out.clone(),
        );
        let (slots2, tail2, head2) = (slots.clone(), tail.clone(), head.clone());
        phase = phase.agent(r, 0, "producer", move |c: &mut dyn AgentCtx| {
            let tail_qp = if mutation == Mutation::SignalOnOtherQp {
                QpIndex(1)
            } else {
                QpIndex(0)
            };
            for i in 0..p.entries {
                let need = if mutation == Mutation::RingOverflowByOne {
                    i.saturating_sub(p.capacity)
                } else {
                    (i + 1).saturating_sub(p.capacity)
                };
                if need > 0 {
                    c.wait(&until(
                        r,
                        head.at(0),
                        Cmp::Ge,
                        need,
                        format!("head of ring {r}->{peer} >= {need}"),
                    ))?;
                }
                if i % p.staging == 0 && i > 0 && mutation != Mutation::SourceReusedBeforeQuiet {
                    c.quiet()?;
                }
                let st = staging.at((i % p.staging) * p.slot_bytes);
                c.store(r, st, &pattern(r as u64, i, 1, p.slot_bytes as usize))?;
                c.put(
                    peer,
                    QpIndex(0),
                    slots.at((i % p.capacity) * p.slot_bytes),
                    st,
                    p.slot_bytes,
                )?;
                c.amo_add(peer, tail_qp, tail.at(0), 1)?;
            }
            c.quiet()
        });
        phase = phase.agent(r, 1, "consumer", move |c: &mut dyn AgentCtx| {
            let mut buf = vec![0u8; p.slot_bytes as usize];
            for i in 0..p.entries {
                if mutation != Mutation::ReadBeforeTail {
                    c.wait(&until(
                        r,
                        tail2.at(0),
                        Cmp::Gt,
                        i,
                        format!("tail of ring {from}->{r} > {i}"),
                    ))?;
                }
                c.load(r, slots2.at((i % p.capacity) * p.slot_bytes), &mut buf)?;
                if mutation == Mutation::ReadBeforeTail {
                    c.wait(&until(
                        r,
                        tail2.at(0),
                        Cmp::Gt,
                        i,
                        format!("tail of ring {from}->{r} > {i}"),
                    ))?;
                }
                c.store(r, out.at(i * p.slot_bytes), &buf)?;
                c.amo_add(from, QpIndex(1), head2.at(0), 1)?;
            }
            c.quiet()
        });
    }
    s.run(phase)?;
    for r in 0..n {
        let from = (r + n - 1) % n;
        for i in 0..p.entries {
            let got = s
                .host_read(r, out.at(i * p.slot_bytes), p.slot_bytes)
                .expect("read");
            assert_eq!(
                got,
                pattern(from as u64, i, 1, p.slot_bytes as usize),
                "rank {r} entry {i}"
            );
        }
    }
    Ok(s)
}

// ---- count-then-data over NVLink (load/store class) ----------------------------------------

/// Count-then-data parameters.
#[derive(Debug, Clone, Copy)]
pub struct CountParams {
    pub ranks: usize,
    pub max_rows: u64,
    pub row_bytes: u64,
    pub calls: u64,
}

impl Default for CountParams {
    fn default() -> Self {
        CountParams {
            ranks: 3,
            max_rows: 3,
            row_bytes: 16,
            calls: 3,
        }
    }
}

/// For each call, every rank stores a random number of rows into each peer's receive region
/// (NVLink stores), fences, and stores `count + 1` into the peer's count word for it (a relaxed
/// store after a fence: the release). Receivers wait for each count, read the rows, and reset
/// the count to zero for the next call (the phase assumes the counts zero at its start).
pub fn count_then_data(
    mutation: Mutation,
    p: CountParams,
    seed: u64,
    policy: Policy,
) -> Result<Sim, SimError> {
    let n = p.ranks;
    let f = FabricParams::single_node(n);
    let mut s = sim(f, seed, policy);
    let rows = alloc(
        &mut s,
        "recv rows",
        n as u64 * p.max_rows * p.row_bytes,
        Init::Scratch,
    );
    let counts = alloc(&mut s, "counts", n as u64 * 16, Init::Zero);
    let out = alloc(
        &mut s,
        "out",
        n as u64 * p.max_rows * p.row_bytes,
        Init::Poison,
    );
    for call in 1..=p.calls {
        let count = |src: usize, dst: usize| {
            1 + (pattern(call, src as u64, dst as u64, 1)[0] as u64) % p.max_rows
        };
        let mut phase = custom("count-then-data", call);
        for r in 0..n {
            phase = phase.assume_zero(r, counts.region);
            let (rows, counts, out) = (rows.clone(), counts.clone(), out.clone());
            let (rows2, counts2) = (rows.clone(), counts.clone());
            phase = phase.agent(r, 0, "sender", move |c: &mut dyn AgentCtx| {
                for k in 0..n {
                    let dst = (r + k) % n;
                    let cnt = count(r, dst);
                    for j in 0..cnt {
                        let at = rows.at((r as u64 * p.max_rows + j) * p.row_bytes);
                        c.store(
                            dst,
                            at,
                            &pattern(call, r as u64 * 1000 + dst as u64, j, p.row_bytes as usize),
                        )?;
                    }
                    if mutation != Mutation::MissingFence {
                        c.fence()?;
                    }
                    c.store_u64(dst, counts.at(r as u64 * 16), cnt + 1)?;
                }
                Ok(())
            });
            phase = phase.agent(r, 1, "receiver", move |c: &mut dyn AgentCtx| {
                for k in 0..n {
                    let src = (r + n - k) % n;
                    let word = counts2.at(src as u64 * 16);
                    let v = c.wait(&until(
                        r,
                        word,
                        Cmp::Ne,
                        0,
                        format!("count from rank {src}"),
                    ))?;
                    let cnt = v - 1;
                    let mut buf = vec![0u8; (cnt * p.row_bytes) as usize];
                    c.load(r, rows2.at(src as u64 * p.max_rows * p.row_bytes), &mut buf)?;
                    c.store(r, out.at(src as u64 * p.max_rows * p.row_bytes), &buf)?;
                    if mutation != Mutation::CounterNotReset {
                        c.store_u64(r, word, 0)?;
                    }
                }
                Ok(())
            });
        }
        s.run(phase)?;
        for r in 0..n {
            for src in 0..n {
                let cnt = count(src, r);
                for j in 0..cnt {
                    let got = s
                        .host_read(
                            r,
                            out.at((src as u64 * p.max_rows + j) * p.row_bytes),
                            p.row_bytes,
                        )
                        .expect("read");
                    assert_eq!(
                        got,
                        pattern(call, src as u64 * 1000 + r as u64, j, p.row_bytes as usize)
                    );
                }
            }
        }
    }
    Ok(s)
}

// ---- double buffer with hook over RDMA ------------------------------------------------------

/// Double-buffer parameters.
#[derive(Debug, Clone, Copy)]
pub struct DoubleParams {
    pub ranks: usize,
    pub rows: u64,
    pub row_bytes: u64,
    pub calls: u64,
    pub qp_depth: u32,
}

impl Default for DoubleParams {
    fn default() -> Self {
        DoubleParams {
            ranks: 2,
            rows: 2,
            row_bytes: 32,
            calls: 4,
            qp_depth: 8,
        }
    }
}

/// Low-latency style: call k's send half stages rows in a send buffer, puts them into every
/// peer's receive buffer `k % 2` and signals with `put_signal(SET, k)`, then quiets (sources
/// reusable). The receive half (the hook) of call k waits for the signal `>= k` and reads. The
/// hook of call k runs before the send half of call k + 2 (the next call on its buffer).
pub fn double_buffer(
    mutation: Mutation,
    p: DoubleParams,
    seed: u64,
    policy: Policy,
) -> Result<Sim, SimError> {
    let n = p.ranks;
    let mut f = FabricParams::single_node(n);
    f.ranks_per_node = 1;
    f.qp_depth = p.qp_depth;
    let mut s = sim(f, seed, policy);
    let region = n as u64 * p.rows * p.row_bytes;
    let recv = alloc(&mut s, "recv buffers", 2 * region, Init::Poison);
    let flags = alloc(&mut s, "recv flags", 2 * n as u64 * 16, Init::Zero);
    let send = alloc(&mut s, "send buffer", region, Init::Poison);
    let out = alloc(&mut s, "out", p.calls * region, Init::Poison);
    // Order of halves: send 1, send 2, hook 1, send 3, hook 2, ... (hook k before send k+2);
    // the mutation delays every hook by one more call.
    let lag = if mutation == Mutation::HookAfterNextCall {
        2
    } else {
        1
    };
    let mut order = Vec::new();
    for k in 1..=p.calls {
        order.push((true, k));
        if k > lag {
            order.push((false, k - lag));
        }
    }
    for k in (p.calls + 1 - lag.min(p.calls))..=p.calls {
        order.push((false, k));
    }
    for (is_send, k) in order {
        let b = k % 2;
        let mut phase = custom(if is_send { "send" } else { "hook" }, k);
        for r in 0..n {
            let (recv, flags, send, out) = (recv.clone(), flags.clone(), send.clone(), out.clone());
            if is_send {
                phase = phase.agent(r, 0, "send", move |c: &mut dyn AgentCtx| {
                    for dst in 0..n {
                        let src = send.at(dst as u64 * p.rows * p.row_bytes);
                        for j in 0..p.rows {
                            c.store(
                                r,
                                src.add(j * p.row_bytes),
                                &pattern(k, (r * 100 + dst) as u64, j, p.row_bytes as usize),
                            )?;
                        }
                        c.put_signal(
                            dst,
                            QpIndex(0),
                            recv.at(b * region + r as u64 * p.rows * p.row_bytes),
                            src,
                            p.rows * p.row_bytes,
                            flags.at((b * n as u64 + r as u64) * 16),
                            SignalOp::Set,
                            k,
                        )?;
                    }
                    if mutation != Mutation::SourceReusedBeforeQuiet {
                        c.quiet()?;
                    }
                    Ok(())
                });
            } else {
                phase = phase.agent(r, 0, "hook", move |c: &mut dyn AgentCtx| {
                    let mut buf = vec![0u8; (p.rows * p.row_bytes) as usize];
                    for src in 0..n {
                        let w = flags.at((b * n as u64 + src as u64) * 16);
                        c.wait(&until(
                            r,
                            w,
                            Cmp::Ge,
                            k,
                            format!("signal of call {k} from rank {src}"),
                        ))?;
                        c.load(
                            r,
                            recv.at(b * region + src as u64 * p.rows * p.row_bytes),
                            &mut buf,
                        )?;
                        c.store(
                            r,
                            out.at((k - 1) * region + src as u64 * p.rows * p.row_bytes),
                            &buf,
                        )?;
                    }
                    Ok(())
                });
            }
        }
        s.run(phase)?;
    }
    for k in 1..=p.calls {
        for r in 0..n {
            for src in 0..n {
                for j in 0..p.rows {
                    let at = out.at((k - 1) * region + (src as u64 * p.rows + j) * p.row_bytes);
                    let got = s.host_read(r, at, p.row_bytes).expect("read");
                    assert_eq!(
                        got,
                        pattern(k, (src * 100 + r) as u64, j, p.row_bytes as usize),
                        "call {k} rank {r} src {src} row {j}"
                    );
                }
            }
        }
    }
    Ok(s)
}

// ---- credit-counted stream with QP depth checked by the protocol ---------------------------

/// Credit-stream parameters.
#[derive(Debug, Clone, Copy)]
pub struct CreditParams {
    pub messages: u64,
    pub qp_depth: u32,
    pub granularity: u64,
}

impl Default for CreditParams {
    fn default() -> Self {
        CreditParams {
            messages: 12,
            qp_depth: 3,
            granularity: 256,
        }
    }
}

/// A device layer that does not wait for free QP slots (DeepEP V1's IBGDA layer, spec §3.8): the
/// protocol keeps a credit count of its in-flight work requests and quiets before the QP would
/// overflow. Rank 0 sends `messages` messages of 48 bytes at a 80-byte stride into rank 1's
/// buffer (some straddle a `granularity` chunk boundary and so are two work requests), then
/// signals with an `amo_add` on the same QP.
pub fn credit_stream(
    mutation: Mutation,
    p: CreditParams,
    seed: u64,
    policy: Policy,
) -> Result<Sim, SimError> {
    let mut f = FabricParams::single_node(2);
    f.ranks_per_node = 1;
    f.qp_depth = p.qp_depth;
    f.granularity = p.granularity;
    f.qp_full = QpFullPolicy::Error;
    let mut s = sim(f, seed, policy);
    let (len, stride) = (48u64, 80u64);
    let dst = alloc(&mut s, "dst", p.messages * stride, Init::Poison);
    let src = alloc(&mut s, "src", p.messages * stride, Init::Poison);
    let done = alloc(&mut s, "done", 16, Init::Zero);
    let out = alloc(&mut s, "out", p.messages * len, Init::Poison);
    let out2 = out.clone();
    for m in 0..p.messages {
        s.host_write(0, src.at(m * stride), &pattern(7, m, 0, len as usize))
            .expect("host write");
    }
    let depth = u64::from(p.qp_depth);
    let (dst2, done2) = (dst.clone(), done.clone());
    let phase = custom("credit-stream", 1)
        .agent(0, 0, "sender", move |c: &mut dyn AgentCtx| {
            let mut credits = 0u64;
            for m in 0..p.messages {
                let d = dst.at(m * stride);
                let need = if mutation == Mutation::StraddleUncounted {
                    1
                } else {
                    u64::from(c.work_requests(d, src.at(m * stride), len))
                };
                if credits + need > depth {
                    c.quiet()?;
                    credits = 0;
                }
                c.put(1, QpIndex(0), d, src.at(m * stride), len)?;
                credits += need;
            }
            if credits + 1 > depth {
                c.quiet()?;
            }
            c.amo_add(1, QpIndex(0), done.at(0), 1)?;
            c.quiet()
        })
        .agent(1, 0, "receiver", move |c: &mut dyn AgentCtx| {
            c.wait(&until(1, done2.at(0), Cmp::Ge, 1, "stream done".into()))?;
            let mut buf = vec![0u8; len as usize];
            for m in 0..p.messages {
                c.load(1, dst2.at(m * stride), &mut buf)?;
                c.store(1, out2.at(m * len), &buf)?;
            }
            Ok(())
        });
    s.run(phase)?;
    for m in 0..p.messages {
        let got = s.host_read(1, out.at(m * len), len).expect("read");
        assert_eq!(got, pattern(7, m, 0, len as usize), "message {m}");
    }
    Ok(s)
}

/// Region helper.
pub fn region(a: &SymAlloc) -> Region {
    a.region
}
