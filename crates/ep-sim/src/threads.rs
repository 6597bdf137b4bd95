//! Threads mode: the same agent code on real threads, for throughput (`ep bench`).
//!
//! Every agent runs concurrently on its own thread. Memory is one lock-protected heap per rank;
//! RDMA operations are applied synchronously by the issuer (so `fence` and `quiet` have nothing
//! left to wait for and QPs never fill), waits and block barriers park on condition variables
//! with a wall-clock bound. No checks: use [`crate::Sim`] to judge a protocol, this to time it.
//! Uses no lock-free structure (only `Mutex`/`Condvar` and one `AtomicBool` abort flag that is
//! read under a mutex-guarded condition wait), so there is nothing for loom to model check.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use ep_core::transport::{
    AgentCtx, AgentId, AllocRequest, FabricParams, Phase, PhaseReport, QpIndex, Region, SignalOp,
    SymAddr, SymAlloc, Team, Transport, WaitUntil,
};
use ep_core::{Error, Result};

use crate::memory::{GRANULE, Heap};

struct RankMem {
    heap: Mutex<Heap>,
    changed: Condvar,
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
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking agent is reported through its result; the heap stays usable.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Shared {
    fn bounds(&self, rank: usize, addr: u64, len: u64, what: &'static str) -> Result<()> {
        let i = self.allocs.partition_point(|r| r.end() <= addr);
        let ok = rank < self.ranks.len()
            && self
                .allocs
                .get(i)
                .is_some_and(|r| r.addr.0 <= addr && addr + len.max(1) <= r.end());
        if ok {
            Ok(())
        } else {
            Err(Error::BadAccess {
                rank,
                what,
                addr,
                len,
            })
        }
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
    fn write(&self, rank: usize, addr: u64, bytes: &[u8]) {
        let r = &self.ranks[rank];
        lock(&r.heap).write(addr, bytes, None, crate::memory::Stamp::default());
        r.changed.notify_all();
    }
    fn add(&self, rank: usize, addr: u64, op: SignalOp, value: u64) {
        let r = &self.ranks[rank];
        let mut h = lock(&r.heap);
        let old = h.read_u64(addr);
        let new = match op {
            SignalOp::Set => value,
            SignalOp::Add => old.wrapping_add(value),
        };
        h.write(
            addr,
            &new.to_le_bytes(),
            None,
            crate::memory::Stamp::default(),
        );
        drop(h);
        r.changed.notify_all();
    }
}

struct ThreadCtx<'s> {
    me: AgentId,
    block: usize,
    call: u64,
    sh: &'s Shared,
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
        self.sh.aborted()?;
        if qp.0 >= self.sh.fabric.rc_per_pe {
            return Err(Error::QpOutOfRange {
                qp: qp.0,
                rc_per_pe: self.sh.fabric.rc_per_pe,
            });
        }
        self.sh.bounds(peer, dst.0, len, "put destination")?;
        self.sh.bounds(self.me.rank, src.0, len, "put source")?;
        let mut buf = vec![0u8; len as usize];
        lock(&self.sh.ranks[self.me.rank].heap).read(src.0, &mut buf);
        self.sh.write(peer, dst.0, &buf);
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
        self.put(peer, qp, dst, src, len)?;
        self.sh.bounds(peer, signal.0, 8, "put_signal signal")?;
        self.sh.add(peer, signal.0, op, value);
        Ok(())
    }
    fn amo_add(&mut self, peer: usize, qp: QpIndex, word: SymAddr, value: u64) -> Result<()> {
        self.sh.aborted()?;
        if qp.0 >= self.sh.fabric.rc_per_pe {
            return Err(Error::QpOutOfRange {
                qp: qp.0,
                rc_per_pe: self.sh.fabric.rc_per_pe,
            });
        }
        self.sh.bounds(peer, word.0, 8, "amo_add")?;
        self.sh.add(peer, word.0, SignalOp::Add, value);
        Ok(())
    }
    fn fence(&mut self) -> Result<()> {
        self.sh.aborted()
    }
    fn quiet(&mut self) -> Result<()> {
        self.sh.aborted()
    }
    fn store(&mut self, rank: usize, addr: SymAddr, bytes: &[u8]) -> Result<()> {
        self.sh.aborted()?;
        if !self.sh.fabric.reach(self.me.rank, rank).load_store() {
            return Err(Error::Unreachable {
                from: self.me.rank,
                to: rank,
                class: "load/store",
            });
        }
        self.sh.bounds(rank, addr.0, bytes.len() as u64, "store")?;
        self.sh.write(rank, addr.0, bytes);
        Ok(())
    }
    fn store_release(&mut self, rank: usize, addr: SymAddr, value: u64) -> Result<()> {
        self.store(rank, addr, &value.to_le_bytes())
    }
    fn load(&mut self, rank: usize, addr: SymAddr, out: &mut [u8]) -> Result<()> {
        self.sh.aborted()?;
        if !self.sh.fabric.reach(self.me.rank, rank).load_store() {
            return Err(Error::Unreachable {
                from: self.me.rank,
                to: rank,
                class: "load/store",
            });
        }
        self.sh.bounds(rank, addr.0, out.len() as u64, "load")?;
        lock(&self.sh.ranks[rank].heap).read(addr.0, out);
        Ok(())
    }
    fn load_acquire(&mut self, rank: usize, addr: SymAddr) -> Result<u64> {
        let mut b = [0u8; 8];
        self.load(rank, addr, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }
    fn wait(&mut self, w: &WaitUntil) -> Result<u64> {
        if !self.sh.fabric.reach(self.me.rank, w.rank).load_store() {
            return Err(Error::Unreachable {
                from: self.me.rank,
                to: w.rank,
                class: "load/store",
            });
        }
        self.sh.bounds(w.rank, w.word.0, 8, "wait")?;
        let r = &self.sh.ranks[w.rank];
        let start = Instant::now();
        let mut h = lock(&r.heap);
        loop {
            self.sh.aborted()?;
            let v = h.read_u64(w.word.0);
            if w.cmp.holds(v, w.value) {
                return Ok(v);
            }
            let waited = start.elapsed();
            if waited >= self.sh.timeout {
                self.sh.abort.store(true, Ordering::Release);
                return Err(Error::WaitTimeout {
                    rank: self.me.rank,
                    agent: self.me.to_string(),
                    what: w.what.clone(),
                    word_rank: w.rank,
                    word: w.word.0,
                    expected: format!("{} {}", w.cmp, w.value),
                    last_seen: v,
                });
            }
            let step = (self.sh.timeout - waited).min(Duration::from_millis(20));
            h = r
                .changed
                .wait_timeout(h, step)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }
    fn block_barrier(&mut self) -> Result<()> {
        let key = (self.me.rank, self.block);
        let start = Instant::now();
        let mut b = lock(&self.sh.blocks);
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
                self.sh.abort.store(true, Ordering::Release);
                return Err(Error::WaitTimeout {
                    rank: self.me.rank,
                    agent: self.me.to_string(),
                    what: format!("block barrier of block {}", self.block),
                    word_rank: self.me.rank,
                    word: 0,
                    expected: "all agents of the block".into(),
                    last_seen: b[&key].arrived as u64,
                });
            }
            let step = (self.sh.timeout - waited).min(Duration::from_millis(20));
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
                heap: Mutex::new(Heap::new(false)),
                changed: Condvar::new(),
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
            },
            next_addr: 0,
        }
    }

    /// Host write.
    pub fn host_write(&mut self, rank: usize, addr: SymAddr, bytes: &[u8]) -> Result<()> {
        self.sh
            .bounds(rank, addr.0, bytes.len() as u64, "host write")?;
        self.sh.write(rank, addr.0, bytes);
        Ok(())
    }

    /// Host read.
    pub fn host_read(&mut self, rank: usize, addr: SymAddr, len: u64) -> Result<Vec<u8>> {
        self.sh.bounds(rank, addr.0, len, "host read")?;
        let mut v = vec![0u8; len as usize];
        lock(&self.sh.ranks[rank].heap).read(addr.0, &mut v);
        Ok(v)
    }
}

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
        // Fresh pages read as zeros in threads mode: poison is not tracked here.
        Ok(SymAlloc {
            name: req.name,
            region,
            init: req.init,
        })
    }

    fn barrier(&mut self, _team: &Team) -> Result<()> {
        Ok(()) // every operation completed when it returned
    }

    fn run_phase(&mut self, phase: Phase<'_>) -> Result<PhaseReport> {
        self.sh.abort.store(false, Ordering::Release);
        {
            let mut b = lock(&self.sh.blocks);
            b.clear();
            for a in &phase.agents {
                b.entry((a.rank, a.block)).or_default().size += 1;
            }
        }
        let mut per_rank = vec![0usize; self.sh.fabric.num_ranks];
        let sh = &self.sh;
        let call = phase.call;
        let results: Vec<Result<()>> = thread::scope(|s| {
            let handles: Vec<_> = phase
                .agents
                .into_iter()
                .map(|a| {
                    let index = per_rank[a.rank];
                    per_rank[a.rank] += 1;
                    let mut ctx = ThreadCtx {
                        me: AgentId {
                            rank: a.rank,
                            index,
                        },
                        block: a.block,
                        call,
                        sh,
                    };
                    let body = a.body;
                    s.spawn(move || {
                        let r = body(&mut ctx);
                        if r.is_err() {
                            sh.abort.store(true, Ordering::Release);
                            for rm in &sh.ranks {
                                rm.changed.notify_all();
                            }
                            sh.block_cv.notify_all();
                        }
                        r
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(Error::AgentFailed {
                            rank: 0,
                            agent: "?".into(),
                            detail: "agent panicked".into(),
                        })
                    })
                })
                .collect()
        });
        // The first real failure wins over the aborts it caused.
        let mut aborted = None;
        for r in results {
            match r {
                Ok(()) => {}
                Err(e @ Error::PhaseAborted { .. }) => aborted = aborted.or(Some(e)),
                Err(e) => return Err(e),
            }
        }
        match aborted {
            Some(e) => Err(e),
            None => Ok(PhaseReport::default()),
        }
    }
}
