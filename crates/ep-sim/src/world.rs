//! The simulated fabric: heaps, QPs, work requests in flight, agents' clocks, and the checks.
//!
//! Everything here runs on the executor's thread: agents never touch it, they send requests
//! (`proto::Req`) that the executor serves one at a time, and remote operations are work
//! requests that the target's "NIC" applies when the executor delivers them (owner-applied
//! delivery). Determinism: every container that is iterated is ordered (`BTreeMap`, `Vec`), and
//! every choice goes through the seeded RNG in `exec`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use ep_core::Error;
use ep_core::transport::{
    AllocRequest, FabricParams, Init, PhaseKind, PhaseReport, QpFullPolicy, QpIndex, Region,
    RingDecl, SignalOp, SymAddr, SymAlloc, WaitUntil, chunk_pieces,
};

use crate::clock::{HOST_KEY, KeyDesc, Keys, VClock};
use crate::cost::{Hops, LinkClass, PhaseRecord, Recorder};
use crate::fault::Fault;
use crate::memory::{GRANULE, Heap, Stamp};
use crate::proto::{Post, Req, Resp};
use crate::violation::{AgentRef, Violation, Waiting};

mod faults;
mod memory_model;
mod recover;
mod rings;

pub(crate) use faults::Timeout;

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

/// One entry of the replayable trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TraceEvent {
    /// An agent's request was served.
    Agent {
        /// Virtual time.
        t: u64,
        /// Rank.
        rank: usize,
        /// Agent index on the rank.
        index: usize,
        /// The vocabulary call.
        op: &'static str,
    },
    /// A work request was applied by its target.
    Deliver {
        /// Virtual time.
        t: u64,
        /// Work request id.
        wr: u64,
    },
    /// A work request completed at its source.
    Complete {
        /// Virtual time.
        t: u64,
        /// Work request id.
        wr: u64,
    },
}

/// Counters of a run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Agent requests served.
    pub operations: u64,
    /// Work requests delivered.
    pub delivered: u64,
    /// Work requests posted.
    pub posted: u64,
    /// Posts that found their QP full and waited.
    pub qp_full_waits: u64,
    /// Highest number of outstanding work requests seen on any QP.
    pub max_outstanding: u32,
    /// Ordering breaches the executor found in its own bookkeeping (must stay 0).
    pub fifo_breaches: u64,
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

    // ---- host face ---------------------------------------------------------------------------

    pub(crate) fn alloc(&mut self, req: AllocRequest) -> Result<SymAlloc, Error> {
        let align = req.align.max(GRANULE).next_power_of_two();
        let addr = self.next_addr.div_ceil(align) * align;
        let avail = self.fabric.heap_bytes.saturating_sub(addr);
        if req.bytes > avail {
            return Err(Error::HeapExhausted {
                requested: req.bytes,
                available: avail,
            });
        }
        self.next_addr = addr + req.bytes;
        let a = SymAlloc {
            name: req.name,
            region: Region::new(SymAddr(addr), req.bytes),
            init: req.init,
        };
        if a.init == Init::Zero {
            for h in &mut self.heaps {
                h.add_zero_region(a.region);
            }
        }
        self.allocs.push(a.clone());
        Ok(a)
    }

    fn alloc_of(&self, addr: u64, len: u64) -> Option<&SymAlloc> {
        let i = self.allocs.partition_point(|a| a.region.end() <= addr);
        self.allocs
            .get(i)
            .filter(|a| a.region.addr.0 <= addr && addr + len <= a.region.end())
    }

    fn check_bounds(
        &self,
        rank: usize,
        addr: u64,
        len: u64,
        what: &'static str,
    ) -> Result<(), Error> {
        if rank >= self.fabric.num_ranks || self.alloc_of(addr, len.max(1)).is_none() {
            return Err(Error::BadAccess {
                rank,
                what,
                addr,
                len,
            });
        }
        Ok(())
    }

    fn check_word(&self, rank: usize, addr: u64, what: &'static str) -> Result<(), Error> {
        if !addr.is_multiple_of(8) {
            return Err(Error::BadAccess {
                rank,
                what,
                addr,
                len: 8,
            });
        }
        self.check_bounds(rank, addr, 8, what)
    }

    pub(crate) fn host_write(&mut self, rank: usize, addr: u64, bytes: &[u8]) -> Result<(), Error> {
        self.check_bounds(rank, addr, bytes.len() as u64, "host write")?;
        self.heaps[rank].write(addr, bytes, None, Stamp::default());
        self.sync_range_clear(rank, addr, bytes.len() as u64);
        Ok(())
    }

    pub(crate) fn host_read(&mut self, rank: usize, addr: u64, len: u64) -> Result<Vec<u8>, Error> {
        let mut v = vec![0u8; len as usize];
        self.host_read_into(rank, addr, &mut v)?;
        Ok(v)
    }

    pub(crate) fn host_read_into(
        &self,
        rank: usize,
        addr: u64,
        out: &mut [u8],
    ) -> Result<(), Error> {
        self.check_bounds(rank, addr, out.len() as u64, "host read")?;
        self.heaps[rank].read_shared(addr, out);
        Ok(())
    }

    pub(crate) fn resident_bytes(&self) -> u64 {
        self.heaps.iter().map(Heap::resident_bytes).sum()
    }

    pub(crate) fn digest(&self) -> u64 {
        self.heaps
            .iter()
            .fold(0xcbf2_9ce4_8422_2325, |h, heap| heap.digest(h))
    }

    /// The host barrier over `team`: delivers and completes every work request the team's ranks
    /// posted (lowest id first), then makes every team rank know what every team rank knew
    /// (ranks outside the team learn nothing). Fails, naming the rank or the QP, when a team rank
    /// is dead or a work request of the team can never complete (an injected fault).
    pub(crate) fn barrier(&mut self, team: &[usize]) -> Result<(), Error> {
        let n = self.fabric.num_ranks;
        let mut member = vec![false; n];
        for &r in team {
            if r >= n {
                return Err(Error::BadAccess {
                    rank: r,
                    what: "barrier team member",
                    addr: 0,
                    len: 0,
                });
            }
            member[r] = true;
            if let Some(why) = &self.dead[r] {
                return Err(Error::RankFailed {
                    rank: r,
                    detail: format!("host barrier: {why}"),
                });
            }
        }
        loop {
            let mut best: Option<(u64, Event)> = None;
            for (&k, q) in &self.qps {
                if !member[k.0] {
                    continue;
                }
                if let Some(&w) = q.posted.front()
                    && self.deliverable(w)
                    && best.is_none_or(|(b, _)| w < b)
                {
                    best = Some((w, Event::Deliver(k)));
                }
                if let Some(&w) = q.delivered.front()
                    && self.completable(k, w)
                    && best.is_none_or(|(b, _)| w < b)
                {
                    best = Some((w, Event::Complete(k)));
                }
            }
            match best {
                Some((_, Event::Deliver(k))) => self.deliver(k),
                Some((_, Event::Complete(k))) => self.complete(k),
                _ => break,
            }
        }
        if let Some((&k, q)) = self
            .qps
            .iter()
            .find(|(k, q)| member[k.0] && q.outstanding > 0)
        {
            let w = q.delivered.front().or(q.posted.front()).copied();
            let notes = self.fault_notes();
            return Err(Error::CompletionTimeout {
                rank: k.0,
                agent: "host barrier".into(),
                peer: k.1,
                qp: k.2,
                during: "host barrier",
                outstanding: u64::from(q.outstanding),
                oldest: format!(
                    "work request {}; {}",
                    w.unwrap_or(0),
                    if notes.is_empty() {
                        "no fault injected".into()
                    } else {
                        notes.join("; ")
                    }
                ),
            });
        }
        let mut g = VClock::default();
        for (r, v) in self.rank_vc.iter().enumerate() {
            if member[r] {
                g.join(v);
            }
        }
        for (&s, h) in &self.streams {
            if let KeyDesc::Stream { rank, .. } = self.keys.desc(s)
                && member[rank]
            {
                g.raise(s, h.len() as u64);
            }
        }
        for (r, v) in self.rank_vc.iter_mut().enumerate() {
            if member[r] {
                *v = g.clone();
            }
        }
        Ok(())
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

    fn deliverable(&self, w: u64) -> bool {
        let wr = &self.wrs[&w];
        if self.dead[wr.qp.0].is_some() || self.dead[wr.qp.1].is_some() {
            return false; // nothing more leaves a dead rank, its NIC applies nothing more
        }
        match wr.dep {
            None => true,
            Some(d) => self.slots[&wr.slot]
                .undelivered
                .get(&wr.qp.1)
                .and_then(|s| s.first())
                .is_none_or(|&first| first > d),
        }
    }

    fn qp_has_room(&self, k: QpKey) -> bool {
        self.fabric.qp_full == QpFullPolicy::Error
            || self
                .qps
                .get(&k)
                .is_none_or(|q| q.outstanding < self.fabric.qp_depth)
    }

    fn word_now(&mut self, rank: usize, addr: u64) -> (u64, bool) {
        let v = self.heaps[rank].read_u64(addr);
        let mut ok = true;
        self.heaps[rank].granules(addr, 8, |_, valid, _| ok &= valid);
        (v, ok)
    }

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
        if let Some(t) = &mut self.trace {
            let a = &self.agents[i];
            t.push(TraceEvent::Agent {
                t: self.now,
                rank: a.r.rank,
                index: a.r.index,
                op: p.req.name(),
            });
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
                let op = self.id();
                let a = &self.agents[i];
                let stamp = Stamp {
                    key: a.key,
                    epoch: a.vc.get(a.key),
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
                self.heaps[tr].write(addr.0, &bytes, None, stamp);
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
            Req::Barrier => {
                let block = (rank, self.agents[i].block);
                match p.prog {
                    Prog::Arrived(_) => {
                        let done = self.blocks[&block].done_vc.clone();
                        let h = self.blocks[&block].done_hops;
                        self.agents[i].hops = self.agents[i].hops.join(h);
                        self.agents[i].vc.join(&done);
                        Ok(Served::Respond(Resp::Unit))
                    }
                    _ => {
                        let vc = self.agents[i].vc.clone();
                        let h = self.agents[i].hops;
                        let b = self.blocks.get_mut(&block).expect("block");
                        let g = b.generation;
                        b.acc.join(&vc);
                        b.hops = b.hops.join(h);
                        b.arrived += 1;
                        if b.arrived == b.size {
                            b.done_hops = std::mem::take(&mut b.hops);
                            b.done_vc = std::mem::take(&mut b.acc);
                            b.arrived = 0;
                            b.generation += 1;
                        }
                        self.release_point(i);
                        self.agents[i].pending = Some(Pending {
                            req: Req::Barrier,
                            prog: Prog::Arrived(g),
                        });
                        Ok(Served::Stay)
                    }
                }
            }
        }
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

    /// Serves `post`, the request `p` carries: plans its work requests on first service, then
    /// posts as many as the QP takes (the rest on later services).
    fn serve_post(&mut self, i: usize, p: Pending, post: &Post) -> Result<Served, Error> {
        let rank = self.agents[i].r.rank;
        let idx = self.agents[i].r.index;
        let (op, peer, qp, wrs, mut next) = match p.prog {
            Prog::Posting {
                op,
                peer,
                qp,
                wrs,
                next,
            } => (op, peer, qp, wrs, next),
            _ => {
                let (peer, qp, plan, src) = self.plan_post(rank, post)?;
                let bytes = plan
                    .iter()
                    .map(|w| match w.kind {
                        WrKind::Data { len, .. } => len,
                        WrKind::Signal { .. } | WrKind::Amo { .. } => 8,
                    })
                    .sum();
                self.rec
                    .post(&self.fabric, (rank, peer, qp), bytes, plan.len() as u64);
                let op = self.id();
                self.ops.insert(
                    op,
                    OpState {
                        src,
                        left: plan.len() as u32,
                        slot: (rank, idx),
                        peer,
                        qp,
                    },
                );
                self.slots
                    .get_mut(&(rank, idx))
                    .expect("slot")
                    .outstanding_ops += 1;
                if self.fabric.qp_full == QpFullPolicy::Error {
                    let out = self.qps.get(&(rank, peer, qp)).map_or(0, |q| q.outstanding);
                    let n = plan.len() as u32;
                    if out + n > self.fabric.qp_depth {
                        let v = self.depth_exceeded(i, op, (rank, peer, qp), &plan, out);
                        self.flag(v);
                    }
                }
                for w in &plan {
                    if let WrKind::Data { dst, len, .. } = w.kind {
                        let who = format!("op {op} posted by {} (qp{qp})", self.agents[i].r);
                        self.check_ring_write(peer, Region::new(SymAddr(dst), len), &who, None);
                    }
                }
                (op, peer, qp, plan, 0)
            }
        };
        let qk = (rank, peer, qp);
        while next < wrs.len() {
            if self.fabric.qp_full == QpFullPolicy::Wait
                && self
                    .qps
                    .get(&qk)
                    .is_some_and(|q| q.outstanding >= self.fabric.qp_depth)
            {
                self.stats.qp_full_waits += 1;
                let req = p.req;
                self.agents[i].pending = Some(Pending {
                    req,
                    prog: Prog::Posting {
                        op,
                        peer,
                        qp,
                        wrs,
                        next,
                    },
                });
                return Ok(Served::Stay);
            }
            self.post_wr(i, op, qk, wrs[next].kind);
            next += 1;
        }
        Ok(Served::Respond(Resp::Unit))
    }

    /// The violation for posting `plan` (op `op`) into QP `k` holding `out` work requests.
    fn depth_exceeded(&self, i: usize, op: u64, k: QpKey, plan: &[WrPlan], out: u32) -> Violation {
        let data = |p: &[WrPlan]| {
            p.iter()
                .filter(|w| matches!(w.kind, WrKind::Data { .. }))
                .count() as u32
        };
        let mut split_ops = Vec::new();
        if let Some(q) = self.qps.get(&k) {
            let mut per_op: BTreeMap<u64, u32> = BTreeMap::new();
            for w in q.posted.iter().chain(q.delivered.iter()) {
                if matches!(self.wrs[w].kind, WrKind::Data { .. }) {
                    *per_op.entry(self.wrs[w].op).or_default() += 1;
                }
            }
            split_ops.extend(per_op.into_iter().filter(|&(_, n)| n > 1));
        }
        if data(plan) > 1 {
            split_ops.push((op, data(plan)));
        }
        Violation::QpDepthExceeded {
            agent: self.agents[i].r.clone(),
            peer: k.1,
            qp: QpIndex(k.2),
            depth: self.fabric.qp_depth,
            outstanding: out,
            op,
            work_requests: plan.len() as u32,
            split_ops,
        }
    }

    /// Validates a post and splits it into work requests (one per heap chunk touched).
    #[allow(clippy::type_complexity, reason = "internal tuple")]
    fn plan_post(
        &self,
        rank: usize,
        post: &Post,
    ) -> Result<(usize, u16, Vec<WrPlan>, Option<(usize, Region)>), Error> {
        let check_qp = |qp: QpIndex| {
            if qp.0 >= self.fabric.rc_per_pe {
                Err(Error::QpOutOfRange {
                    qp: qp.0,
                    rc_per_pe: self.fabric.rc_per_pe,
                })
            } else {
                Ok(())
            }
        };
        match *post {
            Post::Put {
                peer,
                qp,
                dst,
                src,
                len,
                signal,
            } => {
                check_qp(qp)?;
                self.check_bounds(peer, dst.0, len, "put destination")?;
                self.check_bounds(rank, src.0, len, "put source")?;
                let mut plan: Vec<WrPlan> = chunk_pieces(self.fabric.granularity, dst, src, len)
                    .into_iter()
                    .map(|(off, n)| WrPlan {
                        kind: WrKind::Data {
                            dst: dst.0 + off,
                            src: src.0 + off,
                            len: n,
                        },
                    })
                    .collect();
                if let Some((w, op, value)) = signal {
                    self.check_word(peer, w.0, "put_signal signal")?;
                    plan.push(WrPlan {
                        kind: WrKind::Signal {
                            word: w.0,
                            op,
                            value,
                        },
                    });
                }
                if plan.is_empty() {
                    plan.push(WrPlan {
                        kind: WrKind::Data {
                            dst: dst.0,
                            src: src.0,
                            len: 0,
                        },
                    });
                }
                Ok((peer, qp.0, plan, Some((rank, Region::new(src, len)))))
            }
            Post::Amo {
                peer,
                qp,
                word,
                value,
            } => {
                check_qp(qp)?;
                self.check_word(peer, word.0, "amo_add")?;
                Ok((
                    peer,
                    qp.0,
                    vec![WrPlan {
                        kind: WrKind::Amo {
                            word: word.0,
                            value,
                        },
                    }],
                    None,
                ))
            }
        }
    }

    fn post_wr(&mut self, i: usize, op: u64, qk: QpKey, kind: WrKind) {
        let (rank, peer, qp) = qk;
        let idx = self.agents[i].r.index;
        self.stats.posted += 1;
        let nth = {
            let q = self.qps.entry(qk).or_default();
            q.posted_total += 1;
            q.posted_total
        };
        let (lost, no_completion) = self.qp_fault(qk, nth);
        if lost {
            self.lose_wr(i, op, qk, kind);
            return;
        }
        let id = self.id();
        let stream = self.keys.id(KeyDesc::Stream {
            rank,
            index: idx,
            target: peer,
            qp,
        });
        let slot = self.slots.get_mut(&(rank, idx)).expect("slot");
        let seq = {
            let s = slot.seq.entry((peer, qp)).or_insert(0);
            *s += 1;
            *s
        };
        slot.last_wr_to.insert(peer, id);
        slot.undelivered.entry(peer).or_default().insert(id);
        let a = &self.agents[i];
        let hops_src = a.hops;
        let mut carried = (*a.released).clone();
        if let Some(f) = a.fence_vc.get(&peer) {
            carried.join(f);
        }
        carried.raise(stream, seq);
        let dep = a.fence_dep.get(&peer).copied();
        let word = match kind {
            WrKind::Data { dst, .. } => dst,
            WrKind::Signal { word, .. } | WrKind::Amo { word, .. } => word,
        };
        self.streams.entry(stream).or_default().push(StreamEntry {
            wr: id,
            op,
            qp,
            word,
        });
        self.wrs.insert(
            id,
            Wr {
                id,
                op,
                qp: qk,
                slot: (rank, idx),
                stream,
                seq,
                kind,
                carried: Arc::new(carried),
                dep,
                call: self.call,
                no_completion,
                hops: hops_src.hop(LinkClass::of(self.fabric.reach(rank, peer))),
            },
        );
        let q = self.qps.entry(qk).or_default();
        q.posted.push_back(id);
        q.outstanding += 1;
        self.stats.max_outstanding = self.stats.max_outstanding.max(q.outstanding);
    }

    fn set_word_hops(&mut self, rank: usize, addr: u64, h: Hops) {
        let e = self.word_hops.entry((rank, addr)).or_default();
        *e = e.join(h);
    }

    // ---- delivery and completion -------------------------------------------------------------

    pub(crate) fn deliver(&mut self, k: QpKey) {
        let q = self.qps.get_mut(&k).expect("qp");
        let id = q.posted.pop_front().expect("posted");
        q.delivered.push_back(id);
        self.stats.delivered += 1;
        if let Some(t) = &mut self.trace {
            t.push(TraceEvent::Deliver {
                t: self.now,
                wr: id,
            });
        }
        let wr = self.wrs[&id].clone();
        let last = self.last_delivered_seq.entry(wr.stream).or_insert(0);
        if wr.seq != *last + 1 {
            self.stats.fifo_breaches += 1;
        }
        *last = wr.seq;
        if let Some(s) = self
            .slots
            .get_mut(&wr.slot)
            .and_then(|s| s.undelivered.get_mut(&k.1))
        {
            s.remove(&id);
        }
        let dst_rank = k.1;
        let stamp = Stamp {
            key: wr.stream,
            epoch: wr.seq,
            op: id,
            call: wr.call,
        };
        let who = format!(
            "work request {id} (op {}) of {} on qp{}",
            wr.op,
            self.slot_ref(wr.slot),
            k.2
        );
        match wr.kind {
            WrKind::Signal { word, .. } | WrKind::Amo { word, .. } => {
                self.set_word_hops(dst_rank, word, wr.hops);
            }
            WrKind::Data { dst, len, .. } if len <= 64 && dst % 8 == 0 && len % 8 == 0 => {
                for w in (dst..dst + len).step_by(8) {
                    self.set_word_hops(dst_rank, w, wr.hops);
                }
            }
            WrKind::Data { .. } => {}
        }
        match wr.kind {
            WrKind::Data { dst, src, len } => {
                let (bytes, valid) = self.heaps[k.0].read_with_valid(src, len);
                self.check_write(
                    dst_rank,
                    Region::new(SymAddr(dst), len),
                    &who,
                    Some(wr.op),
                    Some((id, wr.slot, k.2)),
                );
                self.heaps[dst_rank].write(dst, &bytes, Some(&valid), stamp);
                if len <= 64 && dst % 8 == 0 && len % 8 == 0 {
                    for w in (dst..dst + len).step_by(8) {
                        self.sync.insert((dst_rank, w), wr.carried.clone());
                    }
                } else {
                    self.sync_range_clear(dst_rank, dst, len);
                }
            }
            WrKind::Signal { word, op, value } => {
                let old = self.heaps[dst_rank].read_u64(word);
                let new = match op {
                    SignalOp::Set => value,
                    SignalOp::Add => old.wrapping_add(value),
                };
                self.check_write(
                    dst_rank,
                    Region::new(SymAddr(word), 8),
                    &who,
                    Some(wr.op),
                    None,
                );
                self.heaps[dst_rank].write(word, &new.to_le_bytes(), None, stamp);
                let c = match (op, self.sync.get(&(dst_rank, word))) {
                    (SignalOp::Add, Some(c)) => {
                        let mut c = (**c).clone();
                        c.join(&wr.carried);
                        Arc::new(c)
                    }
                    _ => wr.carried.clone(),
                };
                self.sync.insert((dst_rank, word), c);
            }
            WrKind::Amo { word, value } => {
                let old = self.heaps[dst_rank].read_u64(word);
                self.check_write(
                    dst_rank,
                    Region::new(SymAddr(word), 8),
                    &who,
                    Some(wr.op),
                    None,
                );
                self.heaps[dst_rank].write(
                    word,
                    &old.wrapping_add(value).to_le_bytes(),
                    None,
                    stamp,
                );
                let mut c = self
                    .sync
                    .get(&(dst_rank, word))
                    .map(|c| (**c).clone())
                    .unwrap_or_default();
                c.join(&wr.carried);
                self.sync.insert((dst_rank, word), Arc::new(c));
            }
        }
    }

    /// What each finished phase moved (cost model).
    pub(crate) fn records(&self) -> &[PhaseRecord] {
        &self.records
    }

    pub(crate) fn complete(&mut self, k: QpKey) {
        let q = self.qps.get_mut(&k).expect("qp");
        let id = q.delivered.pop_front().expect("delivered");
        q.outstanding -= 1;
        if let Some(t) = &mut self.trace {
            t.push(TraceEvent::Complete {
                t: self.now,
                wr: id,
            });
        }
        let wr = self.wrs.remove(&id).expect("wr");
        let o = self.ops.get_mut(&wr.op).expect("op");
        o.left -= 1;
        if o.left == 0 {
            let o = self.ops.remove(&wr.op).expect("op");
            if let Some(s) = self.slots.get_mut(&o.slot) {
                s.outstanding_ops -= 1;
            }
        }
    }

    fn sync_range_clear(&mut self, rank: usize, addr: u64, len: u64) {
        let lo = addr / 8 * 8;
        let keys: Vec<(usize, u64)> = self
            .sync
            .range((rank, lo)..(rank, addr + len))
            .map(|(&k, _)| k)
            .collect();
        for k in keys {
            self.sync.remove(&k);
        }
    }

    fn sync_all_ranks_clear(&mut self, r: Region) {
        for rank in 0..self.fabric.num_ranks {
            self.sync_range_clear(rank, r.addr.0, r.len);
        }
    }
}
