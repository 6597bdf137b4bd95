//! Threads mode: the same agent code on real threads, for throughput (`ep bench`).
//!
//! Every agent runs concurrently on its own thread. Memory ([`crate::tmem`]) is lazily allocated
//! 256 KiB pages, each behind its own short-held lock; `store`, `put` and `load` are bulk
//! `copy_from_slice`s of whole page pieces, with no per-byte bookkeeping and no allocation per
//! operation. RDMA operations are applied synchronously by the issuer (so `fence` and `quiet`
//! have nothing left to wait for and QPs never fill). Waits and block barriers park
//! ([`crate::park`]: writers wake sleepers only when some exist) with a wall-clock bound.
//! No memory-model checks: use [`crate::Sim`] to judge a protocol, this to time it. Each phase's
//! traffic is recorded for the cost model ([`ThreadSim::records`]).

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::sync::atomic::AtomicU64;
use std::sync::{Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use ep_core::transport::{
    AgentCtx, AgentId, AllocRequest, FabricParams, Phase, PhaseKind, PhaseReport, QpIndex, Region,
    SignalOp, SymAddr, SymAlloc, Team, Transport, WaitUntil,
};
use ep_core::{Error, Result};

use crate::cost::{Hops, LinkClass, PhaseRecord, Recorder};
use crate::fault::{Fault, Trigger};
use crate::memory::GRANULE;
use crate::park::{Parked, Parker};
use crate::sync::{AtomicBool, Ordering};
use crate::tmem::{TMem, copy};

/// How long a parked waiter sleeps before re-checking on its own.
const STEP: Duration = Duration::from_millis(20);

struct RankMem {
    mem: TMem,
    park: Parker,
    /// Hops of the last write to each word (for the cost model's wait chains).
    words: Mutex<BTreeMap<u64, Hops>>,
    /// Operations performed by the rank's agents (fault triggers; counted only with faults).
    ops: AtomicU64,
}

#[derive(Default)]
struct BlockBarrier {
    size: usize,
    arrived: usize,
    generation: u64,
}

struct Shared {
    fabric: FabricParams,
    ranks: Vec<RankMem>,
    allocs: Vec<Region>,
    abort: AtomicBool,
    blocks: Mutex<BTreeMap<(usize, usize), BlockBarrier>>,
    block_cv: Condvar,
    timeout: Duration,
    faults: Vec<Fault>,
    /// Work requests posted per faulted QP.
    qp_wrs: Mutex<BTreeMap<(usize, usize, u16), u64>>,
    /// When each rank fault struck (by index in `faults`).
    struck: Vec<OnceLock<Instant>>,
    phase_start: Instant,
}

fn lock_std<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Shared {
    /// The segment of `rank`'s memory holding `[addr, addr + len)`.
    fn seg(&self, rank: usize, addr: u64, len: u64, what: &'static str) -> Result<usize> {
        self.ranks
            .get(rank)
            .and_then(|r| r.mem.segment(addr, len))
            .ok_or(Error::BadAccess {
                rank,
                what,
                addr,
                len,
            })
    }
    fn word_seg(&self, rank: usize, addr: u64, what: &'static str) -> Result<usize> {
        if !addr.is_multiple_of(8) {
            return Err(Error::BadAccess {
                rank,
                what,
                addr,
                len: 8,
            });
        }
        self.seg(rank, addr, 8, what)
    }
    fn aborted(&self) -> Result<()> {
        if self.abort.load(Ordering::Acquire) {
            Err(Error::PhaseAborted {
                reason: "another agent failed".into(),
            })
        } else {
            Ok(())
        }
    }
    fn abort_all(&self) {
        Parker::abort(&self.abort, self.ranks.iter().map(|r| &r.park));
        drop(lock_std(&self.blocks));
        self.block_cv.notify_all();
    }
    fn set_word_hops(&self, rank: usize, addr: u64, h: Hops) {
        let mut w = lock_std(&self.ranks[rank].words);
        let e = w.entry(addr).or_default();
        *e = e.join(h);
    }
    fn word_hops(&self, rank: usize, addr: u64) -> Hops {
        lock_std(&self.ranks[rank].words)
            .get(&addr)
            .copied()
            .unwrap_or_default()
    }
    fn check_qp(&self, qp: QpIndex) -> Result<()> {
        if qp.0 >= self.fabric.rc_per_pe {
            return Err(Error::QpOutOfRange {
                qp: qp.0,
                rc_per_pe: self.fabric.rc_per_pe,
            });
        }
        Ok(())
    }
}

/// What an agent's posts on a faulted QP did.
#[derive(Debug, Clone)]
struct QpTrouble {
    peer: usize,
    qp: u16,
    lost: u64,
    first: String,
    dropped: bool,
}

struct ThreadCtx<'s> {
    me: AgentId,
    role: String,
    block: usize,
    call: u64,
    sh: &'s Shared,
    rec: Recorder,
    trouble: Vec<QpTrouble>,
}

impl ThreadCtx<'_> {
    fn agent(&self) -> String {
        format!("{}({})", self.me, self.role)
    }

    /// Every vocabulary call starts here: abort check, count, rank faults.
    fn op(&mut self) -> Result<()> {
        self.sh.aborted()?;
        self.rec.operations += 1;
        if self.sh.faults.is_empty() {
            return Ok(());
        }
        let rank = self.me.rank;
        let n = self.sh.ranks[rank].ops.fetch_add(1, Ordering::Relaxed);
        let since = self.sh.phase_start.elapsed();
        for (i, f) in self.sh.faults.iter().enumerate() {
            let (fr, at, stall) = match *f {
                Fault::DeadRank { rank, at } => (rank, at, None),
                Fault::StalledRank { rank, at, ticks } => (rank, at, Some(ticks)),
                _ => continue,
            };
            let hit = fr == rank
                && match at {
                    Trigger::AfterOps(k) => n >= k,
                    Trigger::AtTick(t) => since >= Duration::from_micros(t),
                };
            if !hit {
                continue;
            }
            let t0 = *self.sh.struck[i].get_or_init(Instant::now);
            match stall {
                None => {
                    return Err(Error::RankFailed {
                        rank,
                        detail: format!("{} stopped at its operation {n}: {f}", self.agent()),
                    });
                }
                Some(us) => {
                    let until = t0 + Duration::from_micros(us);
                    let now = Instant::now();
                    if until > now {
                        thread::sleep(until - now);
                    }
                }
            }
        }
        Ok(())
    }

    /// Counts `wrs` work requests on a QP; false when the QP's faults lose them.
    fn qp_faults(&mut self, peer: usize, qp: u16, wrs: u64, what: impl Fn() -> String) -> bool {
        let k = (self.me.rank, peer, qp);
        if !self.sh.faults.iter().any(|f| f.on_qp(k)) {
            return true;
        }
        let before = {
            let mut m = lock_std(&self.sh.qp_wrs);
            let c = m.entry(k).or_insert(0);
            let b = *c;
            *c += wrs;
            b
        };
        let mut delivered = true;
        let mut dropped = false;
        for f in self.sh.faults.iter().filter(|f| f.on_qp(k)) {
            match *f {
                Fault::QpError { after_wrs, .. } if before + wrs > after_wrs => delivered = false,
                Fault::DroppedCompletion { nth, .. } if before < nth && nth <= before + wrs => {
                    dropped = true
                }
                _ => {}
            }
        }
        if !delivered || dropped {
            let t = match self
                .trouble
                .iter_mut()
                .find(|t| (t.peer, t.qp) == (peer, qp))
            {
                Some(t) => t,
                None => {
                    self.trouble.push(QpTrouble {
                        peer,
                        qp,
                        lost: 0,
                        first: what(),
                        dropped: false,
                    });
                    self.trouble.last_mut().expect("pushed")
                }
            };
            if !delivered {
                t.lost += wrs;
            }
            t.dropped |= dropped;
        }
        delivered
    }

    fn load_store(&self, to: usize) -> Result<()> {
        if to >= self.sh.fabric.num_ranks || !self.sh.fabric.reach(self.me.rank, to).load_store() {
            return Err(Error::Unreachable {
                from: self.me.rank,
                to,
                class: "load/store",
            });
        }
        Ok(())
    }

    fn hop_to(&self, rank: usize) -> Hops {
        self.rec
            .depth
            .hop(LinkClass::of(self.sh.fabric.reach(self.me.rank, rank)))
    }

    /// Atomically updates the word and wakes its waiters.
    fn update_word(&self, rank: usize, seg: usize, addr: u64, op: SignalOp, value: u64) {
        let r = &self.sh.ranks[rank];
        r.mem.update_u64(seg, addr, |old| match op {
            SignalOp::Set => value,
            SignalOp::Add => old.wrapping_add(value),
        });
        self.sh.set_word_hops(rank, addr, self.hop_to(rank));
        r.park.notify();
    }

    fn park_wait(&mut self, w: &WaitUntil) -> Result<std::result::Result<u64, u64>> {
        self.op()?;
        self.load_store(w.rank)?;
        let seg = self.sh.word_seg(w.rank, w.word.0, "wait")?;
        let r = &self.sh.ranks[w.rank];
        let mut last = 0;
        let got = r.park.wait(&self.sh.abort, self.sh.timeout, STEP, || {
            let v = r.mem.read_u64(seg, w.word.0);
            last = v;
            w.cmp.holds(v, w.value).then_some(v)
        });
        match got {
            Parked::Ready(v) => {
                let h = self.sh.word_hops(w.rank, w.word.0);
                self.rec.depth = self.rec.depth.join(h);
                Ok(Ok(v))
            }
            Parked::Aborted => self.sh.aborted().map(|()| Err(last)),
            Parked::TimedOut => Ok(Err(last)),
        }
    }

    fn timeout(&self, w: &WaitUntil, last_seen: u64) -> Error {
        Error::WaitTimeout {
            rank: self.me.rank,
            agent: self.agent(),
            what: w.what.clone(),
            word_rank: w.rank,
            word: w.word.0,
            expected: format!("{} {}", w.cmp, w.value),
            last_seen,
        }
    }
}

impl AgentCtx for ThreadCtx<'_> {
    fn me(&self) -> AgentId {
        self.me
    }
    fn num_ranks(&self) -> usize {
        self.sh.fabric.num_ranks
    }
    fn call(&self) -> u64 {
        self.call
    }
    fn work_requests(&self, dst: SymAddr, src: SymAddr, len: u64) -> u32 {
        self.sh.fabric.work_requests(dst, src, len)
    }
    fn put(
        &mut self,
        peer: usize,
        qp: QpIndex,
        dst: SymAddr,
        src: SymAddr,
        len: u64,
    ) -> Result<()> {
        self.op()?;
        self.sh.check_qp(qp)?;
        let ds = self.sh.seg(peer, dst.0, len, "put destination")?;
        let ss = self.sh.seg(self.me.rank, src.0, len, "put source")?;
        let wrs = u64::from(self.sh.fabric.work_requests(dst, src, len));
        self.rec
            .post(&self.sh.fabric, (self.me.rank, peer, qp.0), len, wrs);
        if !self.qp_faults(peer, qp.0, wrs, || format!("put of {len} bytes to {dst}")) {
            return Ok(());
        }
        let me = self.me.rank;
        copy(
            (&self.sh.ranks[me].mem, me, ss, src.0),
            (&self.sh.ranks[peer].mem, peer, ds, dst.0),
            len,
        );
        self.sh.ranks[peer].park.notify();
        Ok(())
    }
    fn put_signal(
        &mut self,
        peer: usize,
        qp: QpIndex,
        dst: SymAddr,
        src: SymAddr,
        len: u64,
        signal: SymAddr,
        op: SignalOp,
        value: u64,
    ) -> Result<()> {
        let sseg = self.sh.word_seg(peer, signal.0, "put_signal signal")?;
        self.put(peer, qp, dst, src, len)?;
        self.rec
            .post(&self.sh.fabric, (self.me.rank, peer, qp.0), 8, 1);
        if !self.qp_faults(peer, qp.0, 1, || format!("signal to {signal}")) {
            return Ok(());
        }
        self.update_word(peer, sseg, signal.0, op, value);
        Ok(())
    }
    fn amo_add(&mut self, peer: usize, qp: QpIndex, word: SymAddr, value: u64) -> Result<()> {
        self.op()?;
        self.sh.check_qp(qp)?;
        let seg = self.sh.word_seg(peer, word.0, "amo_add")?;
        self.rec
            .post(&self.sh.fabric, (self.me.rank, peer, qp.0), 8, 1);
        if !self.qp_faults(peer, qp.0, 1, || format!("amo_add to {word}")) {
            return Ok(());
        }
        self.update_word(peer, seg, word.0, SignalOp::Add, value);
        Ok(())
    }
    fn fence(&mut self) -> Result<()> {
        self.op()
    }
    fn quiet(&mut self) -> Result<()> {
        self.op()?;
        let Some(t) = self.trouble.first().cloned() else {
            return Ok(());
        };
        if t.lost > 0 {
            self.trouble.clear();
            return Err(Error::QpError {
                rank: self.me.rank,
                agent: self.agent(),
                peer: t.peer,
                qp: t.qp,
                lost: t.lost,
                first_lost: t.first,
            });
        }
        // A dropped completion: quiet waits for it until the bound.
        let park = &self.sh.ranks[self.me.rank].park;
        match park.wait(&self.sh.abort, self.sh.timeout, STEP, || None::<()>) {
            Parked::Aborted => self.sh.aborted(),
            _ => {
                self.sh.abort_all();
                Err(Error::CompletionTimeout {
                    rank: self.me.rank,
                    agent: self.agent(),
                    peer: t.peer,
                    qp: t.qp,
                    during: "quiet",
                    outstanding: 1,
                    oldest: t.first,
                })
            }
        }
    }
    fn store(&mut self, rank: usize, addr: SymAddr, bytes: &[u8]) -> Result<()> {
        self.op()?;
        self.load_store(rank)?;
        let len = bytes.len() as u64;
        let seg = self.sh.seg(rank, addr.0, len, "store")?;
        self.rec.store(&self.sh.fabric, self.me.rank, rank, len);
        let r = &self.sh.ranks[rank];
        r.mem.write(seg, addr.0, bytes);
        if len == 8 && addr.0.is_multiple_of(8) {
            self.sh.set_word_hops(rank, addr.0, self.hop_to(rank));
        }
        r.park.notify();
        Ok(())
    }
    fn store_release(&mut self, rank: usize, addr: SymAddr, value: u64) -> Result<()> {
        self.sh.word_seg(rank, addr.0, "store_release")?;
        self.store(rank, addr, &value.to_le_bytes())
    }
    fn load(&mut self, rank: usize, addr: SymAddr, out: &mut [u8]) -> Result<()> {
        self.op()?;
        self.load_store(rank)?;
        let len = out.len() as u64;
        let seg = self.sh.seg(rank, addr.0, len, "load")?;
        self.rec.load(&self.sh.fabric, self.me.rank, rank, len);
        self.sh.ranks[rank].mem.read(seg, addr.0, out);
        Ok(())
    }
    fn load_acquire(&mut self, rank: usize, addr: SymAddr) -> Result<u64> {
        self.op()?;
        self.load_store(rank)?;
        let seg = self.sh.word_seg(rank, addr.0, "load_acquire")?;
        let v = self.sh.ranks[rank].mem.read_u64(seg, addr.0);
        let h = self.sh.word_hops(rank, addr.0);
        self.rec.depth = self.rec.depth.join(h);
        Ok(v)
    }
    fn wait(&mut self, w: &WaitUntil) -> Result<u64> {
        match self.park_wait(w)? {
            Ok(v) => Ok(v),
            Err(last) => {
                self.sh.abort_all();
                Err(self.timeout(w, last))
            }
        }
    }
    fn wait_or_expire(&mut self, w: &WaitUntil) -> Result<Option<u64>> {
        Ok(self.park_wait(w)?.ok())
    }
    fn block_barrier(&mut self) -> Result<()> {
        self.op()?;
        let key = (self.me.rank, self.block);
        let start = Instant::now();
        let mut b = lock_std(&self.sh.blocks);
        let e = b.get_mut(&key).expect("block registered");
        let generation = e.generation;
        e.arrived += 1;
        if e.arrived == e.size {
            e.arrived = 0;
            e.generation += 1;
            self.sh.block_cv.notify_all();
            return Ok(());
        }
        loop {
            self.sh.aborted()?;
            if b[&key].generation > generation {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited >= self.sh.timeout {
                let arrived = b[&key].arrived as u64;
                drop(b);
                self.sh.abort_all();
                return Err(Error::WaitTimeout {
                    rank: self.me.rank,
                    agent: self.agent(),
                    what: format!("block barrier of block {}", self.block),
                    word_rank: self.me.rank,
                    word: 0,
                    expected: "all agents of the block".into(),
                    last_seen: arrived,
                });
            }
            let step = (self.sh.timeout - waited).min(STEP);
            b = self
                .sh
                .block_cv
                .wait_timeout(b, step)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }
}

/// The threads-mode executor: real concurrency, parking waits bounded in wall time.
pub struct ThreadSim {
    sh: Shared,
    next_addr: u64,
    records: Vec<PhaseRecord>,
    /// Agent threads a phase may start before a spawn is refused (test hook).
    spawn_limit: Option<usize>,
}

impl std::fmt::Debug for ThreadSim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadSim")
            .field("fabric", &self.sh.fabric)
            .finish_non_exhaustive()
    }
}

impl ThreadSim {
    /// A threads-mode fabric; waits fail after `timeout` of wall time.
    #[must_use]
    pub fn new(fabric: FabricParams, timeout: Duration) -> ThreadSim {
        let ranks = (0..fabric.num_ranks)
            .map(|_| RankMem {
                mem: TMem::default(),
                park: Parker::new(),
                words: Mutex::new(BTreeMap::new()),
                ops: AtomicU64::new(0),
            })
            .collect();
        ThreadSim {
            sh: Shared {
                fabric,
                ranks,
                allocs: Vec::new(),
                abort: AtomicBool::new(false),
                blocks: Mutex::new(BTreeMap::new()),
                block_cv: Condvar::new(),
                timeout,
                faults: Vec::new(),
                qp_wrs: Mutex::new(BTreeMap::new()),
                struck: Vec::new(),
                phase_start: Instant::now(),
            },
            next_addr: 0,
            records: Vec::new(),
            spawn_limit: None,
        }
    }

    /// Fault injection for tests: from now on, a phase starts at most `limit` agent threads and
    /// the next spawn fails as the operating system refuses one under `ulimit -u` or `ulimit -v`
    /// (`None` lifts it). The phase must then end at once in [`Error::AgentSpawnFailed`].
    pub fn limit_agent_threads(&mut self, limit: Option<usize>) {
        self.spawn_limit = limit;
    }

    /// Injects faults ([`crate::fault`] says how threads mode reads them); replaces earlier ones.
    pub fn set_faults(&mut self, faults: Vec<Fault>) {
        self.sh.struck = faults.iter().map(|_| OnceLock::new()).collect();
        self.sh.faults = faults;
    }

    /// Clears every injected fault (a dead rank's agents run again in later phases). Threads mode
    /// keeps nothing in flight between phases, so nothing else needs repair.
    pub fn clear_faults(&mut self) {
        self.set_faults(Vec::new());
    }

    /// Host write.
    pub fn host_write(&mut self, rank: usize, addr: SymAddr, bytes: &[u8]) -> Result<()> {
        let seg = self
            .sh
            .seg(rank, addr.0, bytes.len() as u64, "host write")?;
        self.sh.ranks[rank].mem.write(seg, addr.0, bytes);
        Ok(())
    }

    /// Host read.
    pub fn host_read(&mut self, rank: usize, addr: SymAddr, len: u64) -> Result<Vec<u8>> {
        let mut v = vec![0u8; len as usize];
        self.host_read_into(rank, addr, &mut v)?;
        Ok(v)
    }

    /// Host read into a caller's buffer (no allocation).
    pub fn host_read_into(&self, rank: usize, addr: SymAddr, out: &mut [u8]) -> Result<()> {
        let seg = self.sh.seg(rank, addr.0, out.len() as u64, "host read")?;
        self.sh.ranks[rank].mem.read(seg, addr.0, out);
        Ok(())
    }

    /// What each phase run so far moved, in order, for the cost model.
    #[must_use]
    pub fn records(&self) -> &[PhaseRecord] {
        &self.records
    }

    /// Forgets the records kept so far.
    pub fn clear_records(&mut self) {
        self.records.clear();
    }
}

/// `ThreadSim` runs every phase as the protocol's agents, every rank local: ep-core's simulator
/// executor drives it.
impl ep_core::RunsAgents for ThreadSim {}

impl Transport for ThreadSim {
    fn fabric(&self) -> &FabricParams {
        &self.sh.fabric
    }

    fn alloc(&mut self, req: AllocRequest) -> Result<SymAlloc> {
        let align = req.align.max(GRANULE).next_power_of_two();
        let addr = self.next_addr.div_ceil(align) * align;
        let avail = self.sh.fabric.heap_bytes.saturating_sub(addr);
        if req.bytes > avail {
            return Err(Error::HeapExhausted {
                requested: req.bytes,
                available: avail,
            });
        }
        self.next_addr = addr + req.bytes;
        let region = Region::new(SymAddr(addr), req.bytes);
        self.sh.allocs.push(region);
        for r in &mut self.sh.ranks {
            r.mem.add(region);
        }
        // Fresh pages read as zeros in threads mode: poison is not tracked here.
        Ok(SymAlloc {
            name: req.name,
            region,
            init: req.init,
        })
    }

    fn barrier(&mut self, team: &Team) -> Result<()> {
        for &r in &team.ranks {
            if r >= self.sh.fabric.num_ranks {
                return Err(Error::BadAccess {
                    rank: r,
                    what: "barrier team member",
                    addr: 0,
                    len: 0,
                });
            }
        }
        Ok(()) // every operation completed when it returned
    }

    fn read_local(&self, rank: usize, addr: SymAddr, out: &mut [u8]) -> Result<()> {
        self.host_read_into(rank, addr, out)
    }

    fn visit_local(
        &self,
        rank: usize,
        addr: SymAddr,
        len: u64,
        f: &mut dyn FnMut(&[u8]),
    ) -> Result<()> {
        let seg = self.sh.seg(rank, addr.0, len, "host read")?;
        self.sh.ranks[rank].mem.visit(seg, addr.0, len, f);
        Ok(())
    }

    fn write_local(&mut self, rank: usize, addr: SymAddr, bytes: &[u8]) -> Result<()> {
        self.host_write(rank, addr, bytes)
    }

    fn run_phase(&mut self, phase: Phase<'_>) -> Result<PhaseReport> {
        self.sh.abort.store(false, Ordering::Release);
        self.sh.phase_start = Instant::now();
        {
            let mut b = lock_std(&self.sh.blocks);
            b.clear();
            for a in &phase.agents {
                if a.rank >= self.sh.fabric.num_ranks {
                    return Err(Error::BadAccess {
                        rank: a.rank,
                        what: "agent rank",
                        addr: 0,
                        len: 0,
                    });
                }
                b.entry((a.rank, a.block)).or_default().size += 1;
            }
        }
        for r in &self.sh.ranks {
            lock_std(&r.words).clear();
        }
        let mut per_rank = vec![0usize; self.sh.fabric.num_ranks];
        let sh = &self.sh;
        let call = phase.call;
        let start = Instant::now();
        let total = phase.agents.len();
        let spawn_limit = self.spawn_limit;
        let mut spawn_failed = None;
        let results: Vec<(Result<()>, Recorder)> = thread::scope(|s| {
            let mut handles = Vec::with_capacity(total);
            for a in phase.agents {
                let index = per_rank[a.rank];
                per_rank[a.rank] += 1;
                let me = AgentId {
                    rank: a.rank,
                    index,
                };
                let mut ctx = ThreadCtx {
                    me,
                    role: a.role,
                    block: a.block,
                    call,
                    sh,
                    rec: Recorder::default(),
                    trouble: Vec::new(),
                };
                let body = a.body;
                let agent = format!("{me} ({})", ctx.role);
                let spawned = if spawn_limit.is_some_and(|n| handles.len() >= n) {
                    Err(std::io::Error::new(
                        std::io::ErrorKind::OutOfMemory,
                        "refused by ThreadSim::limit_agent_threads (test hook)",
                    ))
                } else {
                    thread::Builder::new().spawn_scoped(s, move || {
                        let r = body(&mut ctx);
                        // A dead rank's agents just stop; everything else tears the phase down.
                        if r.as_ref()
                            .is_err_and(|e| !matches!(e, Error::RankFailed { .. }))
                        {
                            sh.abort_all();
                        }
                        (r, ctx.rec)
                    })
                };
                match spawned {
                    Ok(h) => handles.push((me, h)),
                    Err(e) => {
                        // The agents already running may wait for this one: wake and stop them
                        // now instead of letting them sit out their wait bound.
                        sh.abort_all();
                        spawn_failed = Some(Error::AgentSpawnFailed {
                            rank: me.rank,
                            agent,
                            started: handles.len(),
                            total,
                            detail: e.to_string(),
                        });
                        break;
                    }
                }
            }
            handles
                .into_iter()
                .map(|(me, h)| {
                    h.join().unwrap_or_else(|_| {
                        sh.abort_all();
                        (
                            Err(Error::AgentFailed {
                                rank: me.rank,
                                agent: me.to_string(),
                                detail: "agent panicked".into(),
                            }),
                            Recorder::default(),
                        )
                    })
                })
                .collect()
        });
        let elapsed = start.elapsed();
        let mut rec = Recorder::default();
        for (_, r) in &results {
            rec.merge(r);
        }
        let record = rec.finish(PhaseKind::clone(&phase.kind), call);
        let report = PhaseReport {
            time_ns: elapsed.as_nanos() as u64,
            operations: record.operations,
            work_requests: record.qps.values().map(|q| q.work_requests).sum(),
            qp_full_waits: 0,
        };
        self.records.push(record);
        if let Some(e) = spawn_failed {
            return Err(e);
        }
        // The first real failure wins over the aborts it caused; a dead rank comes last.
        let (mut aborted, mut dead) = (None, None);
        for (r, _) in results {
            match r {
                Ok(()) => {}
                Err(e @ Error::PhaseAborted { .. }) => aborted = aborted.or(Some(e)),
                Err(e @ Error::RankFailed { .. }) => dead = dead.or(Some(e)),
                Err(e) => return Err(e),
            }
        }
        match dead.or(aborted) {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }
}
