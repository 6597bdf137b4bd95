//! Judging a GPU trace: the events the kernels' blocks recorded (ep-core's
//! [`ep_core::transport::device_trace`], decoded by ep-kernels' `gpu::trace`) replayed as agents
//! of the deterministic checked simulator, so the memory-model rules that judge the simulator's
//! own protocol judge the GPU's too (DESIGN.md, "The GPU backend").
//!
//! # The replay
//! One simulator agent per recorded block (role `block{b}`), on a fabric of `num_ranks` NVLink
//! peers whose heaps hold each rank's `ll.signals` (zero) and `ll.data` (poison) at the same
//! offsets, plus one zeroed word per counter arrival. Each event becomes vocabulary calls:
//!
//! | event | replayed as |
//! |---|---|
//! | `Store` | [`AgentCtx::store`] of defined bytes |
//! | `Load` | [`AgentCtx::load`]: checked against the block's clock |
//! | `Fence` | [`AgentCtx::fence`] (a release point); a GPU-scope fence is no fence unless [`CheckConfig::same_gpu`] |
//! | `Release` | [`AgentCtx::store_release_after_fence`]: publishes the block's acquisitions and its stores before its last fence |
//! | `Acquire` | [`AgentCtx::wait`] until the word **equals** the value seen (acquire) |
//! | `CounterArrive` | wait for the arrival with the previous ticket (acquire; the acq_rel chain), then publish this arrival as a `Release` |
//! | `Put` | a load of the local source, then a store to the peer |
//! | `PutSignal` | the load, then a `Release` of the signal carrying the put's bytes |
//!
//! The waits order the replay as the recorded synchronisation did: an acquire of `v` completes
//! only after the release of `v`, the last arrival after every other. What is not ordered, the
//! seeded scheduler interleaves; any legal interleaving judges the same happens-before relation,
//! so a correct trace passes under every seed.

use std::collections::{BTreeMap, BTreeSet};

use ep_core::transport::{
    AgentCtx, AgentEvents, AllocRequest, Cmp, DeviceEvent, FabricParams, FenceScope, Init, Phase,
    PhaseKind, Region, SymAddr, SymAlloc, TraceRegion, Transport, WaitUntil,
};

use crate::{Sim, SimConfig, SimError, Violation};

/// Byte stored by replayed stores (any defined value: the checker judges visibility, not data).
const STORED: u8 = 0x5a;
/// Bytes per counter-arrival word (one shadow granule each, so arrivals never share one).
const ARRIVAL_STRIDE: u64 = 16;

/// Sizes of one rank's arenas (the same on every rank, as the symmetric allocations are).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arenas {
    /// Bytes of `ll.signals`.
    pub signals_bytes: u64,
    /// Bytes of `ll.data`.
    pub data_bytes: u64,
}

/// How to replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckConfig {
    /// Seed of the scheduler (which unordered event runs first).
    pub seed: u64,
    /// Every rank of the trace runs on one GPU (the kernels' `EP_FLAG_SAME_GPU`): GPU-scope
    /// fences order for every observer. When false (the default), a GPU-scope fence orders
    /// nothing the checker can rely on, and only system-scope fences count.
    pub same_gpu: bool,
}

impl Default for CheckConfig {
    fn default() -> Self {
        CheckConfig {
            seed: 1,
            same_gpu: false,
        }
    }
}

/// What a passing replay covered.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckReport {
    /// Blocks replayed.
    pub agents: usize,
    /// Events replayed.
    pub events: usize,
    /// Ordinary loads judged (puts' source loads included).
    pub loads: u64,
    /// Bytes those loads read.
    pub load_bytes: u64,
    /// Releases, put-with-signals and counter arrivals (publishing events).
    pub publishes: u64,
    /// Acquires.
    pub acquires: u64,
    /// GPU-scope fences replayed as no fence ([`CheckConfig::same_gpu`] false).
    pub gpu_fences_ignored: u64,
    /// Simulator operations the replay took.
    pub operations: u64,
}

/// Where in the trace's arenas a finding lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TracePlace {
    /// Rank whose memory.
    pub rank: usize,
    /// Arena.
    pub region: TraceRegion,
    /// Byte offset of the (first offending 16-byte granule) in the arena.
    pub offset: u64,
}

/// Why a trace did not pass.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// The trace breaks the memory model: the simulator's typed finding (its reader and writer
    /// are `rank{r}/agent{i}(block{b})`), and where it lies in the arenas.
    #[error("{violation}{}", place.map_or_else(String::new, |p| format!(" (rank {} {} offset {:#x})", p.rank, p.region, p.offset)))]
    Violation {
        /// The finding.
        violation: Box<Violation>,
        /// Its place in `ll.signals` / `ll.data`, when it names bytes.
        place: Option<TracePlace>,
    },
    /// The trace contradicts itself or its arenas (not a protocol finding: a recording bug, or
    /// arenas given too small).
    #[error(
        "inconsistent trace: rank {rank} block {agent} event {event}: {detail}; record every event of the launch (and give the arenas' real sizes)"
    )]
    Inconsistent {
        /// Rank of the block.
        rank: usize,
        /// Block.
        agent: usize,
        /// Index of the event in the block's list.
        event: usize,
        /// What is wrong.
        detail: String,
    },
    /// The replay failed outside the memory model (an access the simulator refused).
    #[error("replay failed: {0}")]
    Replay(ep_core::Error),
}

impl TraceError {
    /// The simulator's finding, if this is one.
    #[must_use]
    pub fn violation(&self) -> Option<&Violation> {
        match self {
            TraceError::Violation { violation, .. } => Some(violation),
            _ => None,
        }
    }
}

/// [`check_with`] under [`CheckConfig::default`] (system-scope fences only).
pub fn check(
    num_ranks: usize,
    arenas: Arenas,
    agents: &[AgentEvents],
) -> Result<CheckReport, TraceError> {
    check_with(num_ranks, arenas, agents, &CheckConfig::default())
}

/// Replays `agents` (every block of every rank's launch) on `num_ranks` ranks with `arenas`, and
/// returns what it covered, or the first broken rule.
pub fn check_with(
    num_ranks: usize,
    arenas: Arenas,
    agents: &[AgentEvents],
    cfg: &CheckConfig,
) -> Result<CheckReport, TraceError> {
    let counters = validate(num_ranks, arenas, agents)?;
    let events: usize = agents.iter().map(|a| a.events.len()).sum();
    let fabric = FabricParams::single_node(num_ranks);
    // Bound a wait by everything the replay can do before it is released.
    let ticks = 4 * events as u64 + 4 * agents.len() as u64 + 10_000;
    let mut sim = Sim::new(SimConfig::new(fabric, cfg.seed).wait_timeout(ticks));
    let mut alloc = |name: &str, bytes: u64, init| {
        sim.alloc(AllocRequest {
            name: name.into(),
            bytes: bytes.max(16),
            align: 128,
            init,
        })
        .map_err(TraceError::Replay)
    };
    let signals = alloc("ll.signals", arenas.signals_bytes, Init::Zero)?;
    let data = alloc("ll.data", arenas.data_bytes, Init::Poison)?;
    let arrivals = alloc(
        "trace.counter_arrivals",
        counters.words() * ARRIVAL_STRIDE,
        Init::Zero,
    )?;
    let map = Map {
        signals: signals.clone(),
        data: data.clone(),
        arrivals,
        counters,
        same_gpu: cfg.same_gpu,
    };
    let mut report = CheckReport {
        agents: agents.len(),
        events,
        ..CheckReport::default()
    };
    let mut phase = Phase::new(PhaseKind::Custom("device trace".into()), 0);
    for a in agents {
        tally(&mut report, a, cfg.same_gpu);
        let map = map.clone();
        let a = a.clone();
        phase = phase.agent(
            a.rank,
            a.agent,
            &format!("block{}", a.agent),
            move |c: &mut dyn AgentCtx| replay(c, &map, &a),
        );
    }
    match sim.run(phase) {
        Ok(r) => {
            report.operations = r.operations;
            Ok(report)
        }
        Err(SimError::Violation(v)) => {
            let place = locate(&v, &signals, &data);
            Err(TraceError::Violation {
                violation: v,
                place,
            })
        }
        Err(SimError::Core(ep_core::Error::ProtocolViolation { violation, .. })) => {
            let place = locate(&violation, &signals, &data);
            Err(TraceError::Violation { violation, place })
        }
        Err(SimError::Core(e)) => Err(TraceError::Replay(e)),
    }
}

fn tally(r: &mut CheckReport, a: &AgentEvents, same_gpu: bool) {
    for e in &a.events {
        match *e {
            DeviceEvent::Load { len, .. }
            | DeviceEvent::Put { len, .. }
            | DeviceEvent::PutSignal { len, .. } => {
                r.loads += 1;
                r.load_bytes += len;
            }
            _ => {}
        }
        match *e {
            DeviceEvent::Release { .. }
            | DeviceEvent::PutSignal { .. }
            | DeviceEvent::CounterArrive { .. } => r.publishes += 1,
            DeviceEvent::Acquire { .. } => r.acquires += 1,
            DeviceEvent::Fence {
                scope: FenceScope::Gpu,
            } if !same_gpu => r.gpu_fences_ignored += 1,
            _ => {}
        }
    }
}

/// The counters of the trace: a dense index per `(rank, counter)` id and the most arrivals any
/// has, so arrival `t` of counter `c` is word `index(c) * max_arrivals + t`.
#[derive(Debug, Clone, Default)]
struct Counters {
    ids: BTreeMap<u32, u64>,
    max_arrivals: u64,
}

impl Counters {
    fn words(&self) -> u64 {
        self.ids.len() as u64 * self.max_arrivals
    }
}

/// Addresses of the replay's heap.
#[derive(Debug, Clone)]
struct Map {
    signals: SymAlloc,
    data: SymAlloc,
    arrivals: SymAlloc,
    counters: Counters,
    same_gpu: bool,
}

impl Map {
    fn at(&self, region: TraceRegion, offset: u64) -> SymAddr {
        match region {
            TraceRegion::Signals => self.signals.at(offset),
            TraceRegion::Data => self.data.at(offset),
        }
    }
    fn arrival(&self, counter: u32, ticket: u64) -> SymAddr {
        let word = self.counters.ids[&counter] * self.counters.max_arrivals + ticket;
        self.arrivals.at(word * ARRIVAL_STRIDE)
    }
}

fn replay(c: &mut dyn AgentCtx, m: &Map, a: &AgentEvents) -> ep_core::Result<()> {
    let me = a.rank;
    for (i, e) in a.events.iter().enumerate() {
        match *e {
            DeviceEvent::Store {
                rank,
                region,
                offset,
                len,
            } => c.store(rank, m.at(region, offset), &vec![STORED; len as usize])?,
            DeviceEvent::Load {
                rank,
                region,
                offset,
                len,
            } => c.load(rank, m.at(region, offset), &mut vec![0; len as usize])?,
            DeviceEvent::Fence { scope } => {
                if scope == FenceScope::System || m.same_gpu {
                    c.fence()?;
                }
            }
            DeviceEvent::Release {
                rank,
                offset,
                value,
            } => c.store_release_after_fence(rank, m.signals.at(offset), value, None)?,
            DeviceEvent::Acquire {
                rank,
                offset,
                value,
            } => {
                let until = WaitUntil {
                    rank,
                    word: m.signals.at(offset),
                    cmp: Cmp::Eq,
                    value,
                    what: format!(
                        "ll.signals+{offset:#x} of rank {rank} = {value:#x} (event {i} of rank {me} block {})",
                        a.agent
                    ),
                };
                c.wait(&until)?;
            }
            DeviceEvent::CounterArrive {
                counter, ticket, ..
            } => {
                if ticket > 0 {
                    let until = WaitUntil {
                        rank: me,
                        word: m.arrival(counter, ticket - 1),
                        cmp: Cmp::Eq,
                        value: 1,
                        what: format!("arrival {} at counter {counter} of rank {me}", ticket - 1),
                    };
                    c.wait(&until)?;
                }
                c.store_release_after_fence(me, m.arrival(counter, ticket), 1, None)?;
            }
            DeviceEvent::Put {
                dst_rank,
                dst_offset,
                src_offset,
                len,
            } => {
                let mut b = vec![0; len as usize];
                c.load(me, m.data.at(src_offset), &mut b)?;
                c.store(dst_rank, m.data.at(dst_offset), &b)?;
            }
            DeviceEvent::PutSignal {
                dst_rank,
                dst_offset,
                src_offset,
                len,
                signal_offset,
                value,
            } => {
                let mut b = vec![0; len as usize];
                c.load(me, m.data.at(src_offset), &mut b)?;
                c.store_release_after_fence(
                    dst_rank,
                    m.signals.at(signal_offset),
                    value,
                    Some((m.data.at(dst_offset), &b)),
                )?;
            }
        }
    }
    Ok(())
}

/// The bytes a finding names, as a place in the arenas.
fn locate(v: &Violation, signals: &SymAlloc, data: &SymAlloc) -> Option<TracePlace> {
    let (rank, r): (usize, Region) = match v {
        Violation::SignalBeforeData { rank, data, .. }
        | Violation::ReadOfUndelivered { rank, data, .. }
        | Violation::ReadOfPoison { rank, data, .. }
        | Violation::StoreNotPublished { rank, data, .. }
        | Violation::DataRace { rank, data, .. }
        | Violation::SourceWrittenBeforeCompletion { rank, data, .. }
        | Violation::HookAfterNextCall { rank, data, .. } => (*rank, *data),
        _ => return None,
    };
    [(TraceRegion::Signals, signals), (TraceRegion::Data, data)]
        .into_iter()
        .find(|(_, a)| a.region.overlaps(&Region::new(r.addr, 1)))
        .map(|(region, a)| TracePlace {
            rank,
            region,
            offset: r.addr.0 - a.region.addr.0,
        })
}

/// One recorded arrival at a `(rank, counter)`: ticket, `last`, agent index, event index.
type Arrival = (u64, bool, usize, usize);

/// Checks ranks, bounds, alignment, counters and acquired values before replaying.
fn validate(
    num_ranks: usize,
    arenas: Arenas,
    agents: &[AgentEvents],
) -> Result<Counters, TraceError> {
    let bad = |a: &AgentEvents, event: usize, detail: String| TraceError::Inconsistent {
        rank: a.rank,
        agent: a.agent,
        event,
        detail,
    };
    let mut seen = BTreeSet::new();
    let mut released = BTreeSet::new();
    let mut arrivals: BTreeMap<(usize, u32), Vec<Arrival>> = BTreeMap::new();
    for (ai, a) in agents.iter().enumerate() {
        if a.rank >= num_ranks {
            return Err(bad(a, 0, format!("rank outside the {num_ranks} ranks")));
        }
        if !seen.insert((a.rank, a.agent)) {
            return Err(bad(a, 0, "block listed twice".into()));
        }
        for (i, e) in a.events.iter().enumerate() {
            let in_arena = |rank: usize, region: TraceRegion, off: u64, len: u64| {
                let size = match region {
                    TraceRegion::Signals => arenas.signals_bytes,
                    TraceRegion::Data => arenas.data_bytes,
                };
                if rank >= num_ranks {
                    Err(bad(
                        a,
                        i,
                        format!("rank {rank} outside the {num_ranks} ranks"),
                    ))
                } else if off.checked_add(len).is_none_or(|end| end > size) {
                    Err(bad(
                        a,
                        i,
                        format!("[{off:#x}, +{len:#x}) outside {region} ({size:#x} bytes)"),
                    ))
                } else {
                    Ok(())
                }
            };
            let word = |rank: usize, off: u64| {
                in_arena(rank, TraceRegion::Signals, off, 8)?;
                if off.is_multiple_of(8) {
                    Ok(())
                } else {
                    Err(bad(
                        a,
                        i,
                        format!("signal word {off:#x} not 8-byte aligned"),
                    ))
                }
            };
            match *e {
                DeviceEvent::Store {
                    rank,
                    region,
                    offset,
                    len,
                }
                | DeviceEvent::Load {
                    rank,
                    region,
                    offset,
                    len,
                } => in_arena(rank, region, offset, len)?,
                DeviceEvent::Fence { .. } => {}
                DeviceEvent::Release {
                    rank,
                    offset,
                    value,
                } => {
                    word(rank, offset)?;
                    released.insert((rank, offset, value));
                }
                DeviceEvent::Acquire { rank, offset, .. } => word(rank, offset)?,
                DeviceEvent::CounterArrive {
                    counter,
                    ticket,
                    last,
                } => arrivals
                    .entry((a.rank, counter))
                    .or_default()
                    .push((ticket, last, ai, i)),
                DeviceEvent::Put {
                    dst_rank,
                    dst_offset,
                    src_offset,
                    len,
                } => {
                    in_arena(a.rank, TraceRegion::Data, src_offset, len)?;
                    in_arena(dst_rank, TraceRegion::Data, dst_offset, len)?;
                }
                DeviceEvent::PutSignal {
                    dst_rank,
                    dst_offset,
                    src_offset,
                    len,
                    signal_offset,
                    value,
                } => {
                    in_arena(a.rank, TraceRegion::Data, src_offset, len)?;
                    in_arena(dst_rank, TraceRegion::Data, dst_offset, len)?;
                    word(dst_rank, signal_offset)?;
                    released.insert((dst_rank, signal_offset, value));
                }
            }
        }
    }
    // An acquire must have seen a released value (or the zero the arena starts with).
    for a in agents {
        for (i, e) in a.events.iter().enumerate() {
            if let DeviceEvent::Acquire {
                rank,
                offset,
                value,
            } = *e
                && value != 0
                && !released.contains(&(rank, offset, value))
            {
                return Err(bad(
                    a,
                    i,
                    format!(
                        "acquired {value:#x} from ll.signals+{offset:#x} of rank {rank}, which no recorded release stored"
                    ),
                ));
            }
        }
    }
    // Tickets of a counter are 0..n, each once, and `last` is exactly ticket n - 1.
    let mut counters = Counters::default();
    for ((_, counter), mut list) in arrivals {
        list.sort_unstable();
        let n = list.len() as u64;
        for (k, &(ticket, last, ai, i)) in list.iter().enumerate() {
            let a = &agents[ai];
            if ticket != k as u64 {
                return Err(bad(
                    a,
                    i,
                    format!(
                        "counter {counter}: tickets must be 0..{n} each once (ticket {ticket} where {k} was expected)"
                    ),
                ));
            }
            if last != (ticket + 1 == n) {
                return Err(bad(
                    a,
                    i,
                    format!(
                        "counter {counter}: ticket {ticket} of {n} arrivals recorded last = {last}"
                    ),
                ));
            }
        }
        let next = counters.ids.len() as u64;
        counters.ids.entry(counter).or_insert(next);
        counters.max_arrivals = counters.max_arrivals.max(n);
    }
    Ok(counters)
}
