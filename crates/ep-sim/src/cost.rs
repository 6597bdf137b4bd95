//! The cost model: a run's actual messages over link classes, giving a predicted time per phase
//! (DESIGN.md, "The simulator": NVLink, RDMA NIC, PCIe; bandwidth, latency, per-message
//! overhead, QP-depth stalls).
//!
//! Both executors record what each phase moved ([`PhaseRecord`], from [`crate::Sim::records`]
//! and [`crate::ThreadSim::records`]): bytes, messages and work requests per (source, destination)
//! with the link class reachability gives it, work requests per QP after chunk splitting, and the
//! causal depth of the phase (how many link hops its longest wait chain crossed). Recording is
//! cheap: counters per (source, destination) and per QP, kept per agent and merged at the end.
//!
//! [`CostModel::predict`] turns one record into a [`Prediction`]:
//!
//! ```text
//! predicted = launch + max(serialisation, qp_stall) + latency
//! serialisation = max over resources of Σ bytes / bandwidth + Σ messages × per-message overhead
//!   resources: HBM of each rank (local copies), NVLink out of / into each rank,
//!              PCIe GPU→NIC and NIC→GPU of each rank, NIC egress / ingress of each rank
//! qp_stall = max over RDMA QPs of ceil(work requests / depth) × round trip (2 × NIC latency):
//!   a QP of depth D sustains at most D work requests per round trip
//! latency = NVLink hops × NVLink latency + RDMA hops × NIC latency on the longest wait chain
//! ```
//!
//! Properties (tested): deterministic; a smaller QP depth never lowers the prediction; a larger
//! payload never lowers it. The hop count is an upper bound (the component-wise maximum over
//! agents of NVLink and RDMA hops).
//!
//! Default parameters ([`CostModel::h200_nv18_cx7`]), with their sources:
//!
//! | link | bandwidth | latency | per message | source |
//! |---|---|---|---|---|
//! | HBM (local copy) | 1980 GB/s | — | — | GPU.md, "local HBM copy ~1980" |
//! | NVLink, per direction | 364 GB/s | 1 µs | — | GPU.md, NV18 both directions at once, 132 blocks; latency assumed |
//! | RDMA NIC, per direction | 50 GB/s | 3 µs | 5 ns per work request | ConnectX-7 400 Gb/s line rate; latency and message rate (200 M/s) assumed |
//! | PCIe GPU↔NIC, per direction | 55 GB/s | — | — | Gen5 x16, 64 GB/s raw less protocol overhead |
//! | kernel launch | — | 5 µs | — | GPU.md, ~5.5 µs between back-to-back launches of a 1 MiB copy |
//!
//! The assumed latencies and message rate are to be calibrated on a cluster; the bandwidths are
//! measured on the project's GPU machine (BASELINES.md) or the NIC's line rate.

use std::collections::BTreeMap;
use std::fmt;

use ep_core::transport::{FabricParams, PhaseKind, Reach};

/// The link class a transfer crosses, from reachability.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LinkClass {
    /// Source and destination on the same GPU: an HBM copy.
    Local,
    /// NVLink between GPUs of one node (load/store, or NVSHMEM P2P for RDMA-class operations).
    NvLink,
    /// GPU → PCIe → NIC → network → NIC → PCIe → GPU.
    Rdma,
}

impl LinkClass {
    /// The class of a transfer between ranks reached as `reach`.
    #[must_use]
    pub const fn of(reach: Reach) -> LinkClass {
        match reach {
            Reach::Local => LinkClass::Local,
            Reach::NvLink => LinkClass::NvLink,
            Reach::Rdma => LinkClass::Rdma,
        }
    }
}

/// What one phase moved from one rank to another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flow {
    /// The link class.
    pub link: LinkClass,
    /// Payload bytes (data, signals and atomics count 8 bytes each).
    pub bytes: u64,
    /// Vocabulary operations (a store, a put, a signal, a load of peer memory).
    pub messages: u64,
    /// RDMA work requests, after splitting at heap chunk boundaries.
    pub work_requests: u64,
}

/// Work requests one QP carried in a phase.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QpTraffic {
    /// Work requests posted (after chunk splitting; a signal or atomic is one).
    pub work_requests: u64,
    /// Bytes they carried.
    pub bytes: u64,
}

/// Link hops on a chain of waits: each acquire of a word written over NVLink or RDMA adds a hop
/// to the writer's count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Hops {
    /// NVLink hops.
    pub nvlink: u32,
    /// RDMA hops.
    pub rdma: u32,
}

impl Hops {
    /// Component-wise maximum.
    #[must_use]
    pub fn join(self, o: Hops) -> Hops {
        Hops {
            nvlink: self.nvlink.max(o.nvlink),
            rdma: self.rdma.max(o.rdma),
        }
    }
    /// One more hop over `link`.
    #[must_use]
    pub fn hop(self, link: LinkClass) -> Hops {
        match link {
            LinkClass::Local => self,
            LinkClass::NvLink => Hops {
                nvlink: self.nvlink + 1,
                ..self
            },
            LinkClass::Rdma => Hops {
                rdma: self.rdma + 1,
                ..self
            },
        }
    }
}

/// What one phase moved, as recorded by an executor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PhaseRecord {
    /// The phase.
    pub kind: PhaseKind,
    /// Its call.
    pub call: u64,
    /// Traffic per (source rank, destination rank).
    pub flows: BTreeMap<(usize, usize), Flow>,
    /// Work requests per QP (source rank, destination rank, QP index).
    pub qps: BTreeMap<(usize, usize, u16), QpTraffic>,
    /// The longest wait chain's hops.
    pub depth: Hops,
    /// Vocabulary operations executed.
    pub operations: u64,
}

impl PhaseRecord {
    /// Payload bytes of all flows.
    #[must_use]
    pub fn bytes(&self) -> u64 {
        self.flows.values().map(|f| f.bytes).sum()
    }
    /// Payload bytes that left their rank (NVLink and RDMA).
    #[must_use]
    pub fn remote_bytes(&self) -> u64 {
        self.flows
            .values()
            .filter(|f| f.link != LinkClass::Local)
            .map(|f| f.bytes)
            .sum()
    }
}

/// One agent's (or one executor's) running record; merged at the end of a phase.
#[derive(Debug, Clone, Default)]
pub(crate) struct Recorder {
    flows: BTreeMap<(usize, usize), Flow>,
    qps: BTreeMap<(usize, usize, u16), QpTraffic>,
    pub(crate) depth: Hops,
    pub(crate) operations: u64,
}

impl Recorder {
    fn flow(&mut self, f: &FabricParams, src: usize, dst: usize) -> &mut Flow {
        self.flows.entry((src, dst)).or_insert_with(|| Flow {
            link: LinkClass::of(f.reach(src, dst)),
            bytes: 0,
            messages: 0,
            work_requests: 0,
        })
    }
    /// A load/store-class store of `bytes` by `src` into `dst`'s memory.
    pub(crate) fn store(&mut self, f: &FabricParams, src: usize, dst: usize, bytes: u64) {
        let fl = self.flow(f, src, dst);
        fl.bytes += bytes;
        fl.messages += 1;
    }
    /// A load by `reader` of `bytes` of `owner`'s memory (only peer loads move bytes over a link).
    pub(crate) fn load(&mut self, f: &FabricParams, reader: usize, owner: usize, bytes: u64) {
        if reader != owner {
            self.store(f, owner, reader, bytes);
        }
    }
    /// An RDMA-class post of `bytes` in `wrs` work requests from `src` to `dst` on `qp`.
    pub(crate) fn post(
        &mut self,
        f: &FabricParams,
        (src, dst, qp): (usize, usize, u16),
        bytes: u64,
        wrs: u64,
    ) {
        let fl = self.flow(f, src, dst);
        fl.bytes += bytes;
        fl.messages += 1;
        fl.work_requests += wrs;
        let q = self.qps.entry((src, dst, qp)).or_default();
        q.work_requests += wrs;
        q.bytes += bytes;
    }
    /// Adds `o` into `self` (depths: maximum).
    pub(crate) fn merge(&mut self, o: &Recorder) {
        for (&k, v) in &o.flows {
            let e = self.flows.entry(k).or_insert(Flow {
                link: v.link,
                bytes: 0,
                messages: 0,
                work_requests: 0,
            });
            e.bytes += v.bytes;
            e.messages += v.messages;
            e.work_requests += v.work_requests;
        }
        for (&k, v) in &o.qps {
            let e = self.qps.entry(k).or_default();
            e.work_requests += v.work_requests;
            e.bytes += v.bytes;
        }
        self.depth = self.depth.join(o.depth);
        self.operations += o.operations;
    }
    /// The finished record.
    pub(crate) fn finish(self, kind: PhaseKind, call: u64) -> PhaseRecord {
        PhaseRecord {
            kind,
            call,
            flows: self.flows,
            qps: self.qps,
            depth: self.depth,
            operations: self.operations,
        }
    }
}

/// One link class's parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkParams {
    /// Bandwidth per direction, GB/s (10^9 bytes per second).
    pub gb_per_s: f64,
    /// One-way latency of a hop, microseconds.
    pub latency_us: f64,
    /// Overhead per message (vocabulary operation, or RDMA work request), microseconds.
    pub per_message_us: f64,
}

/// The cost model's parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// Local HBM copies.
    pub hbm: LinkParams,
    /// NVLink, per GPU and direction.
    pub nvlink: LinkParams,
    /// The RDMA NIC of each GPU, per direction; its latency is a whole RDMA hop.
    pub nic: LinkParams,
    /// PCIe between each GPU and its NIC, per direction.
    pub pcie: LinkParams,
    /// Fixed cost of launching a phase's kernel, microseconds.
    pub launch_us: f64,
}

/// A predicted phase time and its parts.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    /// Predicted time, microseconds.
    pub total_us: f64,
    /// The busiest resource's time: bytes over bandwidth plus per-message overheads.
    pub serialisation_us: f64,
    /// The busiest resource ("nvlink out of rank 3", ...); empty when nothing moved.
    pub bottleneck: String,
    /// The slowest QP's depth-bound time: ceil(work requests / depth) round trips.
    pub qp_stall_us: f64,
    /// That QP (source, destination, index), if any RDMA QP was used.
    pub qp_stall_at: Option<(usize, usize, u16)>,
    /// Latency of the longest wait chain.
    pub latency_us: f64,
    /// Launch overhead.
    pub launch_us: f64,
}

impl fmt::Display for Prediction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:.1} us (launch {:.1} + max(serialisation {:.1} [{}], qp stall {:.1}) + latency {:.1})",
            self.total_us,
            self.launch_us,
            self.serialisation_us,
            self.bottleneck,
            self.qp_stall_us,
            self.latency_us
        )
    }
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel::h200_nv18_cx7()
    }
}

impl CostModel {
    /// H200 SXM GPUs on NV18 NVLink with one ConnectX-7 400 Gb/s NIC per GPU on PCIe Gen5 x16
    /// (sources in the module docs).
    #[must_use]
    pub fn h200_nv18_cx7() -> CostModel {
        CostModel {
            hbm: LinkParams {
                gb_per_s: 1980.0,
                latency_us: 0.0,
                per_message_us: 0.0,
            },
            nvlink: LinkParams {
                gb_per_s: 364.0,
                latency_us: 1.0,
                per_message_us: 0.0,
            },
            nic: LinkParams {
                gb_per_s: 50.0,
                latency_us: 3.0,
                per_message_us: 0.005,
            },
            pcie: LinkParams {
                gb_per_s: 55.0,
                latency_us: 0.0,
                per_message_us: 0.0,
            },
            launch_us: 5.0,
        }
    }

    /// Predicts the time of the phase `rec` recorded on `fabric` (its QP depth bounds the QPs).
    #[must_use]
    pub fn predict(&self, rec: &PhaseRecord, fabric: &FabricParams) -> Prediction {
        // Resource busy times, microseconds; keys order the report deterministically.
        let mut busy: BTreeMap<(usize, &'static str), f64> = BTreeMap::new();
        let mut add = |rank: usize, what: &'static str, us: f64| {
            *busy.entry((rank, what)).or_insert(0.0) += us;
        };
        let us = |bytes: u64, p: &LinkParams| bytes as f64 / (p.gb_per_s * 1e3);
        for (&(s, d), fl) in &rec.flows {
            match fl.link {
                LinkClass::Local => add(
                    s,
                    "hbm of",
                    us(fl.bytes, &self.hbm) + fl.messages as f64 * self.hbm.per_message_us,
                ),
                LinkClass::NvLink => {
                    add(
                        s,
                        "nvlink out of",
                        us(fl.bytes, &self.nvlink)
                            + fl.messages as f64 * self.nvlink.per_message_us,
                    );
                    add(d, "nvlink into", us(fl.bytes, &self.nvlink));
                }
                LinkClass::Rdma => {
                    add(s, "pcie to the nic of", us(fl.bytes, &self.pcie));
                    add(
                        s,
                        "nic egress of",
                        us(fl.bytes, &self.nic)
                            + fl.work_requests.max(fl.messages) as f64 * self.nic.per_message_us,
                    );
                    add(d, "nic ingress of", us(fl.bytes, &self.nic));
                    add(d, "pcie from the nic of", us(fl.bytes, &self.pcie));
                }
            }
        }
        let mut serialisation_us = 0.0;
        let mut bottleneck = String::new();
        for (&(rank, what), &t) in &busy {
            if t > serialisation_us {
                serialisation_us = t;
                bottleneck = format!("{what} rank {rank}");
            }
        }
        let depth = u64::from(fabric.qp_depth.max(1));
        let rtt = 2.0 * self.nic.latency_us;
        let mut qp_stall_us = 0.0;
        let mut qp_stall_at = None;
        for (&(s, d, q), t) in &rec.qps {
            if LinkClass::of(fabric.reach(s, d)) != LinkClass::Rdma {
                continue; // NVLink peers are reached through P2P, not through a QP
            }
            let stall = t.work_requests.div_ceil(depth) as f64 * rtt;
            if qp_stall_at.is_none() || stall > qp_stall_us {
                qp_stall_us = stall;
                qp_stall_at = Some((s, d, q));
            }
        }
        let latency_us = f64::from(rec.depth.nvlink) * self.nvlink.latency_us
            + f64::from(rec.depth.rdma) * self.nic.latency_us;
        let launch_us = self.launch_us;
        Prediction {
            total_us: launch_us + serialisation_us.max(qp_stall_us) + latency_us,
            serialisation_us,
            bottleneck,
            qp_stall_us,
            qp_stall_at,
            latency_us,
            launch_us,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fabric(depth: u32) -> FabricParams {
        let mut f = FabricParams::single_node(4);
        f.ranks_per_node = 2;
        f.qp_depth = depth;
        f
    }

    fn record(f: &FabricParams, row: u64, rows: u64) -> PhaseRecord {
        let mut r = Recorder::default();
        for s in 0..4 {
            for d in 0..4 {
                for i in 0..rows {
                    if f.reach(s, d) == Reach::Rdma {
                        r.post(f, (s, d, (i % 2) as u16), row, 1);
                    } else {
                        r.store(f, s, d, row);
                    }
                }
            }
        }
        r.depth = Hops { nvlink: 1, rdma: 2 };
        r.finish(PhaseKind::DispatchSend, 1)
    }

    #[test]
    fn smaller_qp_depth_and_larger_payload_never_predict_less() {
        let m = CostModel::default();
        for rows in [1u64, 7, 64, 300] {
            let mut last = f64::INFINITY;
            for depth in [1u32, 2, 3, 8, 64, 1024] {
                let f = fabric(depth);
                let p = m.predict(&record(&f, 14336, rows), &f);
                assert!(p.total_us <= last, "depth {depth} rows {rows}: {p}");
                last = p.total_us;
            }
            let f = fabric(16);
            let mut last = 0.0;
            for row in [16u64, 1024, 7168, 14336, 1 << 20] {
                let p = m.predict(&record(&f, row, rows), &f);
                assert!(p.total_us >= last, "row {row} rows {rows}: {p}");
                last = p.total_us;
            }
        }
    }

    #[test]
    fn prediction_is_deterministic_and_names_its_bottleneck() {
        let m = CostModel::default();
        let f = fabric(1024);
        let a = m.predict(&record(&f, 14336, 4096), &f);
        let b = m.predict(&record(&f, 14336, 4096), &f);
        assert_eq!(a, b);
        assert!(
            a.bottleneck.contains("nic") || a.bottleneck.contains("pcie"),
            "{a}"
        );
        // 4096 rows of 14336 bytes to each of 2 RDMA peers over a 50 GB/s NIC.
        let expect = 2.0 * 4096.0 * 14336.0 / 50e3;
        assert!((a.serialisation_us - expect).abs() / expect < 0.05, "{a}");
        assert_eq!(a.latency_us, 1.0 + 2.0 * 3.0);
    }
}
