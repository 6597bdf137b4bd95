//! The QP engine: a post is planned into work requests (one per heap chunk touched, plus its
//! signal), posted as QP depth allows, delivered in order per QP by the target's "NIC"
//! (owner-applied: the target's heap is written, visibility clocks carried), and completed at
//! the source.

use std::collections::BTreeMap;
use std::sync::Arc;

use ep_core::Error;
use ep_core::transport::{QpFullPolicy, QpIndex, Region, SignalOp, SymAddr, chunk_pieces};

use super::{
    OpState, Pending, Prog, QpKey, Served, StreamEntry, TraceEvent, World, Wr, WrKind, WrPlan,
};
use crate::clock::KeyDesc;
use crate::cost::LinkClass;
use crate::memory::Stamp;
use crate::proto::{Post, Resp};
use crate::violation::Violation;

impl World {
    pub(super) fn deliverable(&self, w: u64) -> bool {
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

    pub(super) fn qp_has_room(&self, k: QpKey) -> bool {
        self.fabric.qp_full == QpFullPolicy::Error
            || self
                .qps
                .get(&k)
                .is_none_or(|q| q.outstanding < self.fabric.qp_depth)
    }

    /// Serves `post`, the request `p` carries: plans its work requests on first service, then
    /// posts as many as the QP takes (the rest on later services).
    pub(super) fn serve_post(
        &mut self,
        i: usize,
        p: Pending,
        post: &Post,
    ) -> Result<Served, Error> {
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
    pub(super) fn depth_exceeded(
        &self,
        i: usize,
        op: u64,
        k: QpKey,
        plan: &[WrPlan],
        out: u32,
    ) -> Violation {
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
    pub(super) fn plan_post(
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

    pub(super) fn post_wr(&mut self, i: usize, op: u64, qk: QpKey, kind: WrKind) {
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

    pub(crate) fn deliver(&mut self, k: QpKey) {
        let q = self.qps.get_mut(&k).expect("qp");
        let id = q.posted.pop_front().expect("posted");
        q.delivered.push_back(id);
        self.stats.delivered += 1;
        self.trace(TraceEvent::Deliver {
            t: self.now,
            wr: id,
        });
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
        self.delivery_hops(dst_rank, &wr);
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

    pub(crate) fn complete(&mut self, k: QpKey) {
        let q = self.qps.get_mut(&k).expect("qp");
        let id = q.delivered.pop_front().expect("delivered");
        q.outstanding -= 1;
        self.trace(TraceEvent::Complete {
            t: self.now,
            wr: id,
        });
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
}
