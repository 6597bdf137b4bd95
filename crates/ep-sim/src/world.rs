//! The simulated fabric: heaps, QPs, work requests in flight, agents' clocks, and the checks.
//!
//! Everything here runs on the executor's thread: agents never touch it, they send requests
//! (`proto::Req`) that the executor serves one at a time, and remote operations are work
//! requests that the target's "NIC" applies when the executor delivers them (owner-applied
//! delivery). Determinism: every container that is iterated is ordered (`BTreeMap`, `Vec`), and
//! every choice goes through the seeded RNG in `exec`.
//!
//! This file holds the state (`World` and its records), phases, enabledness and the wait-for
//! graph, and the serving of agent requests; the rest has its own room:
//! - `heap`: allocation, bounds, host reads and writes, the per-word visibility clocks;
//! - `qp`: the QP engine (planning posts into work requests, QP depth, delivery, completion);
//! - `barriers`: the host barrier over a team and the block barrier;
//! - `memory_model`: the memory-model checker (reads, writes, put sources);
//! - `rings`: declared rings (live slots, ring violations);
//! - `hops`: the cost model's wait-chain hops per word and the phase records;
//! - `trace`: the replayable trace and the run's counters;
//! - `faults`, `recover`: injected faults and their typed errors, recovery after them.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use ep_core::Error;
use ep_core::transport::{
    FabricParams, Init, PhaseKind, PhaseReport, Region, RingDecl, SignalOp, SymAddr, SymAlloc,
    WaitUntil,
};

use crate::clock::{HOST_KEY, KeyDesc, Keys, VClock};
use crate::cost::{Hops, LinkClass, PhaseRecord, Recorder};
use crate::fault::Fault;
use crate::memory::{Heap, Stamp};
use crate::proto::{Req, Resp};
use crate::violation::{AgentRef, Violation, Waiting};

mod barriers;
mod faults;
mod heap;
mod hops;
mod memory_model;
mod qp;
mod recover;
mod rings;
mod trace;

pub(crate) use faults::Timeout;
pub use trace::{Stats, TraceEvent};

/// A QP: (source rank, target rank, index).
pub(crate) type QpKey = (usize, usize, u16);
/// An agent slot: (rank, index among the rank's agents).
pub(crate) type SlotKey = (usize, usize);

#[derive(Debug, Clone, Copy)]
pub(crate) enum WrKind {
    Data { dst: u64, src: u64, len: u64 },
    Signal { word: u64, op: SignalOp, value: u64 },
    Amo { word: u64, value: u64 },
}

#[derive(Debug, Clone)]
pub(crate) struct Wr {
    pub(crate) id: u64,
    op: u64,
    qp: QpKey,
    slot: SlotKey,
    stream: u32,
    seq: u64,
    kind: WrKind,
    carried: Arc<VClock>,
    /// Fence dependency: every WR of this slot to this target with an id `<= dep` first.
    dep: Option<u64>,
    call: u64,
    /// Delivered but never completed (an injected dropped completion).
    pub(crate) no_completion: bool,
    /// The poster's wait-chain hops plus this link's (cost model).
    hops: Hops,
}

/// Stream history entry: what sequence number `n` of a stream was.
#[derive(Debug, Clone, Copy)]
struct StreamEntry {
    wr: u64,
    op: u64,
    qp: u16,
    word: u64,
}

#[derive(Debug)]
struct OpState {
    src: Option<(usize, Region)>,
    left: u32,
    slot: SlotKey,
    peer: usize,
    qp: u16,
}

#[derive(Debug, Default)]
struct Qp {
    posted: VecDeque<u64>,
    delivered: VecDeque<u64>,
    outstanding: u32,
    /// Work requests ever posted (fault triggers count these).
    posted_total: u64,
}

/// Persistent per slot (survives phases).
#[derive(Debug, Default)]
struct Slot {
    epoch: u64,
    /// (target, qp) → last sequence number posted.
    seq: BTreeMap<(usize, u16), u64>,
    /// target → last WR id posted.
    last_wr_to: BTreeMap<usize, u64>,
    /// target → undelivered WR ids.
    undelivered: BTreeMap<usize, BTreeSet<u64>>,
    outstanding_ops: usize,
    role: String,
    /// Posts lost to a QP in error state, not yet reported by a `quiet`.
    qp_errors: Vec<QpErr>,
}

/// Work requests a QP in error state flushed.
#[derive(Debug, Clone)]
pub(crate) struct QpErr {
    pub(crate) peer: usize,
    pub(crate) qp: u16,
    pub(crate) lost: u64,
    pub(crate) first: String,
}

#[derive(Debug, Clone)]
pub(crate) struct WrPlan {
    kind: WrKind,
}

#[derive(Debug)]
pub(crate) enum Prog {
    None,
    Posting {
        op: u64,
        peer: usize,
        qp: u16,
        wrs: Vec<WrPlan>,
        next: usize,
    },
    Arrived(u64),
}

#[derive(Debug)]
pub(crate) struct Pending {
    pub(crate) req: Req,
    pub(crate) prog: Prog,
}

#[derive(Debug)]
pub(crate) struct Agent {
    pub(crate) r: AgentRef,
    block: usize,
    key: u32,
    vc: VClock,
    released: Arc<VClock>,
    fence_dep: BTreeMap<usize, u64>,
    fence_vc: BTreeMap<usize, VClock>,
    acquired_writers: BTreeSet<u32>,
    /// Last value this agent acquired from each word (rank, offset), this phase.
    acquired: BTreeMap<(usize, u64), u64>,
    pub(crate) pending: Option<Pending>,
    pub(crate) done: bool,
    pub(crate) parked_since: Option<u64>,
    /// Link hops of the longest wait chain leading here (cost model).
    hops: Hops,
}

#[derive(Debug, Default)]
struct Block {
    size: usize,
    arrived: usize,
    generation: u64,
    acc: VClock,
    done_vc: VClock,
    hops: Hops,
    done_hops: Hops,
}

/// An event the executor may pick.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Event {
    Agent(usize),
    Deliver(QpKey),
    Complete(QpKey),
}

pub(crate) struct World {
    pub(crate) fabric: FabricParams,
    pub(crate) wait_timeout: u64,
    heaps: Vec<Heap>,
    allocs: Vec<SymAlloc>,
    next_addr: u64,
    keys: Keys,
    slots: BTreeMap<SlotKey, Slot>,
    rank_vc: Vec<VClock>,
    qps: BTreeMap<QpKey, Qp>,
    wrs: BTreeMap<u64, Wr>,
    ops: BTreeMap<u64, OpState>,
    streams: BTreeMap<u32, Vec<StreamEntry>>,
    sync: BTreeMap<(usize, u64), Arc<VClock>>,
    next_id: u64,
    pub(crate) now: u64,
    pub(crate) agents: Vec<Agent>,
    blocks: BTreeMap<(usize, usize), Block>,
    rings: Vec<RingDecl>,
    call: u64,
    pub(crate) violation: Option<Violation>,
    pub(crate) trace: Option<Vec<TraceEvent>>,
    pub(crate) stats: Stats,
    last_delivered_seq: BTreeMap<u32, u64>,
    /// Virtual time and counters when the running phase began.
    phase_start: (u64, Stats),
    /// Injected faults, whether each rank fault has struck, and their effects.
    pub(crate) faults: Vec<Fault>,
    pub(crate) struck: Vec<bool>,
    /// Operations served per rank, since creation.
    pub(crate) rank_ops: Vec<u64>,
    /// Why each dead rank is dead.
    pub(crate) dead: Vec<Option<String>>,
    /// Virtual tick until which each rank's agents are stalled.
    pub(crate) stall_until: Vec<u64>,
    /// The running phase's traffic, and the records of past phases (cost model).
    rec: Recorder,
    pub(crate) records: Vec<PhaseRecord>,
    phase_kind: Option<PhaseKind>,
    /// Hops of the last write to each word (rank, offset).
    word_hops: BTreeMap<(usize, u64), Hops>,
}

/// What serving a request did.
pub(crate) enum Served {
    /// Answer the agent, which then runs to its next call.
    Respond(Resp),
    /// The request stays pending (partly posted, or arrived at a barrier).
    Stay,
}

impl World {
    pub(crate) fn new(
        fabric: FabricParams,
        wait_timeout: u64,
        trace: bool,
        faults: Vec<Fault>,
    ) -> World {
        let n = fabric.num_ranks;
        World {
            struck: vec![false; faults.len()],
            faults,
            rank_ops: vec![0; n],
            dead: vec![None; n],
            stall_until: vec![0; n],
            rec: Recorder::default(),
            records: Vec::new(),
            phase_kind: None,
            word_hops: BTreeMap::new(),
            heaps: (0..n).map(|_| Heap::new(true)).collect(),
            rank_vc: vec![VClock::default(); n],
            fabric,
            wait_timeout,
            allocs: Vec::new(),
            next_addr: 0,
            keys: Keys::new(),
            slots: BTreeMap::new(),
            qps: BTreeMap::new(),
            wrs: BTreeMap::new(),
            ops: BTreeMap::new(),
            streams: BTreeMap::new(),
            sync: BTreeMap::new(),
            next_id: 1,
            now: 0,
            agents: Vec::new(),
            blocks: BTreeMap::new(),
            rings: Vec::new(),
            call: 0,
            violation: None,
            trace: trace.then(Vec::new),
            stats: Stats::default(),
            last_delivered_seq: BTreeMap::new(),
            phase_start: (0, Stats::default()),
        }
    }

    fn id(&mut self) -> u64 {
        let i = self.next_id;
        self.next_id += 1;
        i
    }

    // ---- phases ------------------------------------------------------------------------------

    /// Checks the phase's assumptions, poisons scratch, and sets up its agents.
    pub(crate) fn begin_phase(
        &mut self,
        kind: PhaseKind,
        call: u64,
        agents: &[(usize, usize, String)],
        assume_zero: &[(usize, Region)],
        rings: Vec<RingDecl>,
    ) -> Result<(), Box<Violation>> {
        self.call = call;
        self.phase_start = (self.now, self.stats.clone());
        self.phase_kind = Some(kind);
        self.rec = Recorder::default();
        self.word_hops.clear();
        for &(rank, region) in assume_zero {
            let mut w = region.addr.0 / 8 * 8;
            while w < region.end() {
                let v = self.heaps[rank].read_u64(w);
                let mut stamp = Stamp::default();
                self.heaps[rank].granules(w, 8, |_, _, s| stamp = s);
                if v != 0 {
                    return Err(Box::new(Violation::NonZeroAtCallStart {
                        rank,
                        word: w,
                        value: v,
                        call,
                        last_writer: self.describe_writer(stamp),
                        written_in_call: stamp.call,
                    }));
                }
                w += 8;
            }
        }
        let scratch: Vec<Region> = self
            .allocs
            .iter()
            .filter(|a| a.init == Init::Scratch)
            .map(|a| a.region)
            .collect();
        for r in scratch {
            for h in &mut self.heaps {
                h.poison(r);
            }
            self.sync_all_ranks_clear(r);
        }
        self.rings = rings;
        self.blocks.clear();
        self.agents.clear();
        let mut per_rank = vec![0usize; self.fabric.num_ranks];
        for (rank, block, role) in agents {
            let (rank, block) = (*rank, *block);
            let index = per_rank[rank];
            per_rank[rank] += 1;
            let key = self.keys.id(KeyDesc::Agent { rank, index });
            let slot = self.slots.entry((rank, index)).or_default();
            slot.role.clone_from(role);
            let released = Arc::new(self.rank_vc[rank].clone());
            let mut vc = self.rank_vc[rank].clone();
            slot.epoch += 1;
            vc.set(key, slot.epoch);
            self.blocks.entry((rank, block)).or_default().size += 1;
            self.agents.push(Agent {
                r: AgentRef {
                    rank,
                    index,
                    role: role.clone(),
                },
                block,
                key,
                vc,
                released,
                fence_dep: BTreeMap::new(),
                fence_vc: BTreeMap::new(),
                acquired_writers: BTreeSet::new(),
                acquired: BTreeMap::new(),
                pending: Some(Pending {
                    req: Req::Start,
                    prog: Prog::None,
                }),
                done: false,
                parked_since: None,
                hops: Hops::default(),
            });
        }
        Ok(())
    }

    /// Folds the agents' knowledge into their ranks' clocks (kernel boundary).
    pub(crate) fn end_phase(&mut self) -> PhaseReport {
        for a in &self.agents {
            self.rec.depth = self.rec.depth.join(a.hops);
            self.rank_vc[a.r.rank].join(&a.vc);
            let s = self.slots.get_mut(&(a.r.rank, a.r.index)).expect("slot");
            s.epoch = s.epoch.max(a.vc.get(a.key));
        }
        self.agents.clear();
        self.rings.clear();
        let (t0, s0) = std::mem::take(&mut self.phase_start);
        let mut rec = std::mem::take(&mut self.rec);
        rec.operations = self.stats.operations - s0.operations;
        let kind = self
            .phase_kind
            .take()
            .unwrap_or_else(|| PhaseKind::Custom(String::new()));
        self.records.push(rec.finish(kind, self.call));
        PhaseReport {
            time_ns: self.now - t0,
            operations: self.stats.operations - s0.operations,
            work_requests: self.stats.delivered - s0.delivered,
            qp_full_waits: self.stats.qp_full_waits - s0.qp_full_waits,
        }
    }

    // ---- enabledness -------------------------------------------------------------------------

    /// Whether agent `i`'s pending request can be served now.
    pub(crate) fn agent_enabled(&mut self, i: usize) -> bool {
        let a = &self.agents[i];
        if a.done {
            return false;
        }
        let rank = a.r.rank;
        let slot = (a.r.rank, a.r.index);
        if self.dead[rank].is_some() || self.now < self.stall_until[rank] {
            return false;
        }
        let Some(p) = &a.pending else { return false };
        match (&p.req, &p.prog) {
            (Req::Post(post), Prog::None) => {
                let (peer, qp) = post.target();
                self.qp_has_room((rank, peer, qp.0))
            }
            (_, Prog::Posting { peer, qp, .. }) => self.qp_has_room((rank, *peer, *qp)),
            (Req::Quiet, _) => {
                let s = &self.slots[&slot];
                s.outstanding_ops == 0 || !s.qp_errors.is_empty()
            }
            (Req::Wait(w) | Req::WaitOrExpire(w), _) => {
                let w = w.clone();
                if self.check_word(w.rank, w.word.0, "wait").is_err()
                    || !self.fabric.reach(rank, w.rank).load_store()
                {
                    return true; // served to report the error
                }
                let (v, ok) = self.word_now(w.rank, w.word.0);
                !ok || w.cmp.holds(v, w.value)
            }
            (Req::Barrier, Prog::Arrived(g)) => self.blocks[&(rank, a.block)].generation > *g,
            _ => true,
        }
    }

    /// Every event that may happen now, in a fixed order.
    pub(crate) fn enabled_events(&mut self) -> Vec<Event> {
        let mut ev = Vec::new();
        if !self.faults.is_empty() {
            self.strike_faults();
        }
        for i in 0..self.agents.len() {
            let en = self.agent_enabled(i);
            let benched = self.benched(self.agents[i].r.rank);
            let a = &mut self.agents[i];
            if benched {
                a.parked_since = None;
            } else if en {
                a.parked_since = None;
                ev.push(Event::Agent(i));
            } else if !a.done && a.parked_since.is_none() {
                a.parked_since = Some(self.now);
                if a.pending
                    .as_ref()
                    .is_some_and(|p| matches!(p.req, Req::Post(_)))
                {
                    self.stats.qp_full_waits += 1;
                }
            }
        }
        for (&k, q) in &self.qps {
            if let Some(&w) = q.posted.front()
                && self.deliverable(w)
            {
                ev.push(Event::Deliver(k));
            }
            if let Some(&w) = q.delivered.front()
                && self.completable(k, w)
            {
                ev.push(Event::Complete(k));
            }
        }
        ev
    }

    /// The wait-for graph of parked agents.
    pub(crate) fn deadlock(&mut self) -> Violation {
        let parked: Vec<usize> = (0..self.agents.len())
            .filter(|&i| !self.agents[i].done)
            .collect();
        Violation::Deadlock {
            waiting: parked.into_iter().map(|i| self.waiting(i)).collect(),
        }
    }

    fn waiting(&mut self, i: usize) -> Waiting {
        let a = &self.agents[i];
        let agent = a.r.clone();
        let block = a.block;
        let rank = a.r.rank;
        let req = a.pending.as_ref().map(|p| p.req.clone());
        match req {
            Some(Req::Wait(w) | Req::WaitOrExpire(w)) => {
                let WaitUntil {
                    rank: wr,
                    word,
                    cmp,
                    value,
                    what,
                } = w;
                let (v, _) = self.word_now(wr, word.0);
                let mut stamp = Stamp::default();
                self.heaps[wr].granules(word.0, 8, |_, _, s| stamp = s);
                Waiting {
                    agent,
                    what: format!("{what} (word {cmp} {value})"),
                    word: Some((wr, word.0)),
                    last_seen: Some(v),
                    last_writer: (stamp.op != 0).then(|| self.describe_writer(stamp)),
                    faults: Vec::new(),
                }
            }
            Some(Req::Barrier) => {
                let b = &self.blocks[&(rank, block)];
                Waiting {
                    agent,
                    what: format!(
                        "block barrier of block {block} ({} of {} arrived)",
                        b.arrived, b.size
                    ),
                    word: None,
                    last_seen: None,
                    last_writer: None,
                    faults: Vec::new(),
                }
            }
            Some(r) => Waiting {
                agent,
                what: format!("{} to proceed", r.name()),
                word: None,
                last_seen: None,
                last_writer: None,
                faults: Vec::new(),
            },
            None => Waiting {
                agent,
                what: "nothing (running)".into(),
                word: None,
                last_seen: None,
                last_writer: None,
                faults: Vec::new(),
            },
        }
    }

    fn describe_writer(&self, s: Stamp) -> String {
        match self.keys.desc(s.key) {
            KeyDesc::Host => "the host".into(),
            KeyDesc::Agent { rank, index } => {
                format!(
                    "rank{rank}/agent{index}({}) op {}",
                    self.slots.get(&(rank, index)).map_or("", |x| &x.role),
                    s.op
                )
            }
            KeyDesc::Stream {
                rank,
                index,
                target,
                qp,
            } => format!(
                "work request {} of rank{rank}/agent{index}({}) -> rank {target} qp{qp}",
                s.op,
                self.slots.get(&(rank, index)).map_or("", |x| &x.role)
            ),
        }
    }

    fn slot_ref(&self, (rank, index): SlotKey) -> AgentRef {
        AgentRef {
            rank,
            index,
            role: self
                .slots
                .get(&(rank, index))
                .map_or_else(String::new, |s| s.role.clone()),
        }
    }

    // ---- serving agent requests --------------------------------------------------------------

    pub(crate) fn serve(&mut self, i: usize) -> Served {
        self.stats.operations += 1;
        let p = self.agents[i].pending.take().expect("pending request");
        if !matches!(p.req, Req::Start) {
            self.rank_ops[self.agents[i].r.rank] += 1;
        }
        if self.trace.is_some() {
            let a = &self.agents[i];
            let e = TraceEvent::Agent {
                t: self.now,
                rank: a.r.rank,
                index: a.r.index,
                op: p.req.name(),
            };
            self.trace(e);
        }
        let r = match self.serve_req(i, p) {
            Ok(s) => s,
            Err(e) => Served::Respond(Resp::Err(e)),
        };
        if matches!(r, Served::Respond(_)) {
            self.agents[i].pending = None;
        }
        r
    }

    fn release_point(&mut self, i: usize) {
        let a = &mut self.agents[i];
        a.released = Arc::new(a.vc.clone());
        let e = a.vc.get(a.key);
        a.vc.set(a.key, e + 1);
    }

    fn serve_req(&mut self, i: usize, p: Pending) -> Result<Served, Error> {
        let rank = self.agents[i].r.rank;
        match p.req {
            Req::Start => Ok(Served::Respond(Resp::Unit)),
            Req::Post(ref post) => {
                let post = post.clone();
                self.serve_post(i, p, &post)
            }
            Req::Fence => {
                let slot = &self.slots[&(rank, self.agents[i].r.index)];
                let deps: Vec<(usize, u64)> =
                    slot.last_wr_to.iter().map(|(&t, &w)| (t, w)).collect();
                let seqs: Vec<((usize, u16), u64)> =
                    slot.seq.iter().map(|(&k, &v)| (k, v)).collect();
                let idx = self.agents[i].r.index;
                for (t, w) in deps {
                    self.agents[i].fence_dep.insert(t, w);
                }
                for ((t, q), s) in seqs {
                    let k = self.keys.id(KeyDesc::Stream {
                        rank,
                        index: idx,
                        target: t,
                        qp: q,
                    });
                    self.agents[i].fence_vc.entry(t).or_default().raise(k, s);
                }
                self.release_point(i);
                Ok(Served::Respond(Resp::Unit))
            }
            Req::Quiet => {
                let idx = self.agents[i].r.index;
                let errs =
                    std::mem::take(&mut self.slots.get_mut(&(rank, idx)).expect("slot").qp_errors);
                if let Some(e) = errs.into_iter().next() {
                    return Err(Error::QpError {
                        rank,
                        agent: self.agents[i].r.to_string(),
                        peer: e.peer,
                        qp: e.qp,
                        lost: e.lost,
                        first_lost: e.first,
                    });
                }
                let seqs: Vec<((usize, u16), u64)> = self.slots[&(rank, idx)]
                    .seq
                    .iter()
                    .map(|(&k, &v)| (k, v))
                    .collect();
                for ((t, q), s) in seqs {
                    let k = self.keys.id(KeyDesc::Stream {
                        rank,
                        index: idx,
                        target: t,
                        qp: q,
                    });
                    self.agents[i].vc.raise(k, s);
                }
                self.release_point(i);
                Ok(Served::Respond(Resp::Unit))
            }
            Req::Store {
                rank: tr,
                addr,
                bytes,
                release,
            } => {
                self.check_load_store(rank, tr)?;
                if release {
                    self.check_word(tr, addr.0, "store_release")?;
                } else {
                    self.check_bounds(tr, addr.0, bytes.len() as u64, "store")?;
                }
                let epoch = self.agents[i].vc.get(self.agents[i].key);
                self.agent_write(i, tr, addr, &bytes, epoch);
                if release {
                    self.release_point(i);
                }
                let clock = self.agents[i].released.clone();
                if bytes.len() == 8 && addr.0 % 8 == 0 {
                    self.sync.insert((tr, addr.0), clock);
                } else {
                    self.sync_range_clear(tr, addr.0, bytes.len() as u64);
                }
                Ok(Served::Respond(Resp::Unit))
            }
            Req::StoreReleaseAfterFence {
                rank: tr,
                addr,
                value,
                data,
            } => {
                self.check_load_store(rank, tr)?;
                self.check_word(tr, addr.0, "store_release_after_fence")?;
                if let Some((at, bytes)) = &data {
                    self.check_bounds(tr, at.0, bytes.len() as u64, "store_release_after_fence")?;
                }
                // The own epoch this release publishes: that of the agent's last release point
                // (its last fence); stores since carry a later epoch and stay unpublished.
                let a = &self.agents[i];
                let (key, fenced, now) = (a.key, a.released.get(a.key), a.vc.get(a.key));
                if let Some((at, bytes)) = data {
                    // Put-with-signal data: published by this release and by nothing before it
                    // of this agent that a reader could have acquired since its last fence
                    // (limit: a reader that acquired an earlier release of this agent after
                    // that fence sees it too).
                    self.agent_write(i, tr, at, &bytes, fenced);
                    self.sync_range_clear(tr, at.0, bytes.len() as u64);
                }
                self.agent_write(i, tr, addr, &value.to_le_bytes(), now);
                let mut clock = self.agents[i].vc.clone();
                clock.set(key, fenced);
                self.sync.insert((tr, addr.0), Arc::new(clock));
                Ok(Served::Respond(Resp::Unit))
            }
            Req::Load {
                rank: tr,
                addr,
                len,
            } => {
                self.check_load_store(rank, tr)?;
                self.check_bounds(tr, addr.0, len, "load")?;
                self.rec.load(&self.fabric, rank, tr, len);
                self.check_read(i, tr, Region::new(addr, len));
                let mut out = vec![0u8; len as usize];
                self.heaps[tr].read(addr.0, &mut out);
                Ok(Served::Respond(Resp::Bytes(out)))
            }
            Req::LoadAcquire { rank: tr, addr } => {
                self.check_load_store(rank, tr)?;
                self.check_word(tr, addr.0, "load_acquire")?;
                let v = self.acquire(i, tr, addr.0);
                Ok(Served::Respond(Resp::Word(v)))
            }
            Req::Wait(w) | Req::WaitOrExpire(w) => {
                self.check_load_store(rank, w.rank)?;
                self.check_word(w.rank, w.word.0, "wait")?;
                let v = self.acquire(i, w.rank, w.word.0);
                Ok(Served::Respond(Resp::Word(v)))
            }
            Req::Barrier => Ok(self.serve_block_barrier(i, rank, p.prog)),
        }
    }

    /// An ordinary write by agent `i` of `bytes` at `tr`'s `addr`, stamped with the agent's
    /// `epoch`: traffic record, wait-chain hops, write checks, heap and shadow.
    fn agent_write(&mut self, i: usize, tr: usize, addr: SymAddr, bytes: &[u8], epoch: u64) {
        let op = self.id();
        let a = &self.agents[i];
        let rank = a.r.rank;
        let stamp = Stamp {
            key: a.key,
            epoch,
            op,
            call: self.call,
        };
        let region = Region::new(addr, bytes.len() as u64);
        let who = format!("{} op {op}", a.r);
        let hops = a.hops.hop(LinkClass::of(self.fabric.reach(rank, tr)));
        self.rec.store(&self.fabric, rank, tr, bytes.len() as u64);
        if bytes.len() == 8 && addr.0.is_multiple_of(8) {
            self.set_word_hops(tr, addr.0, hops);
        }
        self.check_write(tr, region, &who, None, None);
        self.heaps[tr].write(addr.0, bytes, None, stamp);
    }

    fn check_load_store(&self, from: usize, to: usize) -> Result<(), Error> {
        if to >= self.fabric.num_ranks || !self.fabric.reach(from, to).load_store() {
            return Err(Error::Unreachable {
                from,
                to,
                class: "load/store",
            });
        }
        Ok(())
    }

    /// Acquire-read of a word: poison check, clock join.
    fn acquire(&mut self, i: usize, rank: usize, addr: u64) -> u64 {
        let (v, ok) = self.word_now(rank, addr);
        if !ok {
            let alloc = self
                .alloc_of(addr, 8)
                .map_or_else(String::new, |a| a.name.clone());
            self.flag(Violation::ReadOfPoison {
                rank,
                reader: self.agents[i].r.clone(),
                data: Region::new(SymAddr(addr), 8),
                alloc,
            });
        }
        if let Some(c) = self.sync.get(&(rank, addr)).cloned() {
            self.agents[i].vc.join(&c);
        }
        if let Some(&h) = self.word_hops.get(&(rank, addr)) {
            self.agents[i].hops = self.agents[i].hops.join(h);
        }
        let mut stamp = Stamp::default();
        self.heaps[rank].granules(addr, 8, |_, _, s| stamp = s);
        if stamp.key != HOST_KEY {
            self.agents[i].acquired_writers.insert(stamp.key);
        }
        self.agents[i].acquired.insert((rank, addr), v);
        v
    }

    fn flag(&mut self, v: Violation) {
        if self.violation.is_none() {
            self.violation = Some(v);
        }
    }
}
