//! The memory-model checker (DESIGN.md, "The memory model the protocol may rely on"): an
//! ordinary read must see only what a release/acquire or signal chain made visible, a write must
//! not touch the source of a put before its completion nor a live ring entry. Each finding is a
//! typed [`Violation`] naming rank, agent, QP or word and the operations involved.

use ep_core::transport::{QpIndex, Region, SymAddr};

use super::{SlotKey, World, Wr, WrKind};
use crate::clock::KeyDesc;
use crate::memory::GRANULE;
use crate::violation::Violation;

impl World {
    /// Checks a write of `region` on `rank` by `who` (own op excluded from source checks).
    #[allow(clippy::type_complexity, reason = "internal tuple")]
    pub(super) fn check_write(
        &mut self,
        rank: usize,
        region: Region,
        who: &str,
        own_op: Option<u64>,
        data_wr: Option<(u64, SlotKey, u16)>,
    ) {
        if region.len == 0 {
            return;
        }
        let hit = self.ops.iter().find(|(id, o)| {
            Some(**id) != own_op && o.src.is_some_and(|(r, s)| r == rank && s.overlaps(&region))
        });
        if let Some((&op, o)) = hit {
            let v = Violation::SourceWrittenBeforeCompletion {
                rank,
                writer: who.to_owned(),
                data: region,
                op,
                issuer: self.slot_ref(o.slot),
                peer: o.peer,
                qp: QpIndex(o.qp),
            };
            self.flag(v);
        }
        self.check_ring_write(rank, region, who, data_wr);
    }

    /// Checks an ordinary read by agent `i` of `region` on `rank`.
    pub(super) fn check_read(&mut self, i: usize, rank: usize, region: Region) {
        if region.len == 0 || self.violation.is_some() {
            return;
        }
        let reader = self.agents[i].r.clone();
        if self.check_ring_read(i, rank, region) {
            return;
        }
        // A put still in flight to these bytes.
        let pending = self
            .qps
            .iter()
            .filter(|(k, _)| k.1 == rank)
            .flat_map(|(_, q)| q.posted.iter())
            .filter(|w| match self.wrs[w].kind {
                WrKind::Data { dst, len, .. } => Region::new(SymAddr(dst), len).overlaps(&region),
                _ => false,
            })
            .min()
            .copied();
        if let Some(w) = pending {
            let wr = self.wrs[&w].clone();
            let v = match self.later_signal_known(i, &wr) {
                Some((sig, sig_qp, word)) => Violation::SignalBeforeData {
                    rank,
                    reader,
                    data: region,
                    put_op: wr.op,
                    put_qp: QpIndex(wr.qp.2),
                    signal_op: sig,
                    signal_qp: QpIndex(sig_qp),
                    signal_word: word,
                    sender: self.slot_ref(wr.slot),
                    delivered: false,
                },
                None => match self.live_ring_slot(rank, region) {
                    // The put in flight targets a slot whose entry is live: the producer overran.
                    Some(live) => live.overrun(
                        rank,
                        format!(
                            "work request {w} (op {}) of {} on qp{}, still in flight",
                            wr.op,
                            self.slot_ref(wr.slot),
                            wr.qp.2
                        ),
                    ),
                    None => Violation::ReadOfUndelivered {
                        rank,
                        reader,
                        data: region,
                        put_op: wr.op,
                        sender: self.slot_ref(wr.slot),
                        qp: QpIndex(wr.qp.2),
                    },
                },
            };
            self.flag(v);
            return;
        }
        let mut granules = Vec::new();
        self.heaps[rank].granules(region.addr.0, region.len, |g, ok, s| {
            granules.push((g, ok, s))
        });
        let a = &self.agents[i];
        for (g, ok, s) in granules {
            let gr = Region::new(SymAddr(g), GRANULE);
            if !ok {
                let alloc = self
                    .alloc_of(g, 1)
                    .map_or_else(String::new, |a| a.name.clone());
                self.flag(Violation::ReadOfPoison {
                    rank,
                    reader,
                    data: gr,
                    alloc,
                });
                return;
            }
            if s.call != 0 && self.call != 0 && s.call > self.call {
                self.flag(Violation::HookAfterNextCall {
                    rank,
                    reader,
                    data: gr,
                    hook_call: self.call,
                    written_in_call: s.call,
                    write_op: s.op,
                });
                return;
            }
            if a.vc.get(s.key) >= s.epoch {
                continue;
            }
            let v = match self.keys.desc(s.key) {
                KeyDesc::Stream {
                    rank: sr,
                    index: si,
                    ..
                } => {
                    let wr = self.streams[&s.key][(s.epoch - 1) as usize];
                    match self.later_signal_known_entry(i, s.key, wr.wr) {
                        Some((sig, sig_qp, word)) => Violation::SignalBeforeData {
                            rank,
                            reader,
                            data: gr,
                            put_op: wr.op,
                            put_qp: QpIndex(wr.qp),
                            signal_op: sig,
                            signal_qp: QpIndex(sig_qp),
                            signal_word: word,
                            sender: self.slot_ref((sr, si)),
                            delivered: true,
                        },
                        None => Violation::DataRace {
                            rank,
                            reader,
                            data: gr,
                            writer: self.describe_writer(s),
                            write_op: s.op,
                        },
                    }
                }
                KeyDesc::Agent {
                    rank: wr,
                    index: wi,
                } if a.acquired_writers.contains(&s.key) => Violation::StoreNotPublished {
                    rank,
                    reader,
                    data: gr,
                    writer: self.slot_ref((wr, wi)),
                    store_op: s.op,
                    store_epoch: s.epoch,
                    known_epoch: a.vc.get(s.key),
                },
                _ => Violation::DataRace {
                    rank,
                    reader,
                    data: gr,
                    writer: self.describe_writer(s),
                    write_op: s.op,
                },
            };
            self.flag(v);
            return;
        }
    }

    fn later_signal_known(&self, i: usize, wr: &Wr) -> Option<(u64, u16, u64)> {
        self.later_signal_known_entry(i, wr.stream, wr.id)
    }

    /// Whether agent `i` knows a work request of the same sender to the same target on another
    /// QP that was posted after work request `wr` of stream `stream`: (its op, its QP, its word).
    fn later_signal_known_entry(&self, i: usize, stream: u32, wr: u64) -> Option<(u64, u16, u64)> {
        let KeyDesc::Stream {
            rank,
            index,
            target,
            qp,
        } = self.keys.desc(stream)
        else {
            return None;
        };
        let a = &self.agents[i];
        for (k, n) in a.vc.iter() {
            if n == 0 || k == stream {
                continue;
            }
            if let KeyDesc::Stream {
                rank: r2,
                index: i2,
                target: t2,
                qp: q2,
            } = self.keys.desc(k)
                && (r2, i2, t2) == (rank, index, target)
                && q2 != qp
                && let Some(e) = self.streams.get(&k).and_then(|h| h.get((n - 1) as usize))
                && e.wr > wr
            {
                return Some((e.op, q2, e.word));
            }
        }
        None
    }
}
