//! Injected faults in the deterministic simulator ([`crate::fault`]): when rank faults strike,
//! which work requests a faulty QP loses or never completes, how virtual time jumps past a
//! fault, and the typed errors the run ends in.

use ep_core::Error;
use ep_core::transport::{QpIndex, SymAddr};

use super::{Prog, QpErr, QpKey, World, WrKind};
use crate::fault::{Fault, Trigger};
use crate::proto::Req;
use crate::violation::{SimError, Violation};

/// A wait past its bound.
pub(crate) enum Timeout {
    /// A `wait_or_expire`: answer the agent with `Expired`.
    Expire(usize),
    /// Anything else ends the phase.
    Fail(Violation),
}

fn describe(kind: WrKind) -> String {
    match kind {
        WrKind::Data { dst, len, .. } => format!("put of {len} bytes to {}", SymAddr(dst)),
        WrKind::Signal { word, .. } => format!("signal to {}", SymAddr(word)),
        WrKind::Amo { word, .. } => format!("amo_add to {}", SymAddr(word)),
    }
}

impl World {
    /// Rank faults whose trigger has come strike (once each).
    pub(crate) fn strike_faults(&mut self) {
        for j in 0..self.faults.len() {
            if self.struck[j] {
                continue;
            }
            let f = self.faults[j].clone();
            let (rank, at, stall) = match f {
                Fault::DeadRank { rank, at } => (rank, at, None),
                Fault::StalledRank { rank, at, ticks } => (rank, at, Some(ticks)),
                _ => continue,
            };
            if rank >= self.fabric.num_ranks {
                continue;
            }
            let hit = match at {
                Trigger::AfterOps(k) => self.rank_ops[rank] >= k,
                Trigger::AtTick(t) => self.now >= t,
            };
            if !hit {
                continue;
            }
            self.struck[j] = true;
            match stall {
                None => {
                    self.dead[rank] = Some(format!(
                        "{f}: struck at tick {} after {} operations",
                        self.now, self.rank_ops[rank]
                    ));
                }
                Some(t) => {
                    self.stall_until[rank] = self.stall_until[rank].max(self.now + t);
                }
            }
            for a in &mut self.agents {
                if a.r.rank == rank {
                    a.parked_since = None;
                }
            }
        }
    }

    /// Whether an agent of `rank` is out of play now (dead, or stalled).
    pub(crate) fn benched(&self, rank: usize) -> bool {
        self.dead[rank].is_some() || self.now < self.stall_until[rank]
    }

    /// What the QP's faults do to its `nth` work request: (lost, never completes).
    pub(crate) fn qp_fault(&self, k: QpKey, nth: u64) -> (bool, bool) {
        let (mut lost, mut dropped) = (false, false);
        for f in self.faults.iter().filter(|f| f.on_qp(k)) {
            match *f {
                Fault::QpError { after_wrs, .. } => lost |= nth > after_wrs,
                Fault::DroppedCompletion { nth: n, .. } => dropped |= nth == n,
                _ => {}
            }
        }
        (lost, dropped)
    }

    /// A post lost to a QP in error state: it succeeds locally, is flushed with an error
    /// completion (its QP slot is free at once), and the poster's next `quiet` reports it.
    pub(crate) fn lose_wr(&mut self, i: usize, op: u64, (rank, peer, qp): QpKey, kind: WrKind) {
        let idx = self.agents[i].r.index;
        let slot = self.slots.get_mut(&(rank, idx)).expect("slot");
        match slot
            .qp_errors
            .iter_mut()
            .find(|e| (e.peer, e.qp) == (peer, qp))
        {
            Some(e) => e.lost += 1,
            None => slot.qp_errors.push(QpErr {
                peer,
                qp,
                lost: 1,
                first: format!("{} (op {op})", describe(kind)),
            }),
        }
        let o = self.ops.get_mut(&op).expect("op");
        o.left -= 1;
        if o.left == 0 {
            self.ops.remove(&op);
            slot.outstanding_ops -= 1;
        }
    }

    /// Whether the delivered work request `w` at the head of QP `k` may complete.
    pub(crate) fn completable(&self, k: QpKey, w: u64) -> bool {
        self.dead[k.0].is_none() && !self.wrs[&w].no_completion
    }

    /// The injected faults that have struck, for reports.
    pub(crate) fn fault_notes(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (j, f) in self.faults.iter().enumerate() {
            match *f {
                Fault::DeadRank { rank, .. } if self.struck[j] => {
                    out.push(self.dead[rank].clone().unwrap_or_else(|| f.to_string()));
                }
                Fault::StalledRank { .. } if self.struck[j] => out.push(f.to_string()),
                Fault::QpError {
                    src,
                    dst,
                    qp,
                    after_wrs,
                } if self
                    .qps
                    .get(&(src, dst, qp.0))
                    .is_some_and(|q| q.posted_total > after_wrs) =>
                {
                    out.push(f.to_string());
                }
                Fault::DroppedCompletion { src, dst, qp, nth }
                    if self
                        .qps
                        .get(&(src, dst, qp.0))
                        .is_some_and(|q| q.posted_total >= nth) =>
                {
                    out.push(f.to_string());
                }
                _ => {}
            }
        }
        out
    }

    /// Whether the phase is over: every agent done, or only dead ranks' agents left (then the
    /// typed error naming the first dead rank and where its agents stopped).
    pub(crate) fn finished(&self) -> Option<Result<(), SimError>> {
        let left: Vec<usize> = (0..self.agents.len())
            .filter(|&i| !self.agents[i].done)
            .collect();
        if left.is_empty() {
            return Some(Ok(()));
        }
        if left
            .iter()
            .any(|&i| self.dead[self.agents[i].r.rank].is_none())
        {
            return None;
        }
        let rank = self.agents[left[0]].r.rank;
        let stopped: Vec<String> = left
            .iter()
            .filter(|&&i| self.agents[i].r.rank == rank)
            .map(|&i| {
                let a = &self.agents[i];
                let at = a.pending.as_ref().map_or("its end", |p| p.req.name());
                format!("{} before {at}", a.r)
            })
            .collect();
        Some(Err(SimError::Core(Error::RankFailed {
            rank,
            detail: format!(
                "its agents stopped ({}); {}",
                stopped.join(", "),
                self.dead[rank].as_deref().unwrap_or("dead")
            ),
        })))
    }

    /// With faults injected and nothing enabled: the next virtual time something can happen
    /// (a stall ends, a timed trigger fires, a wait reaches its bound).
    pub(crate) fn next_time_event(&self) -> Option<u64> {
        if self.faults.is_empty() {
            return None;
        }
        let mut t: Option<u64> = None;
        let mut at = |x: u64| {
            if x > self.now {
                t = Some(t.map_or(x, |y| y.min(x)));
            }
        };
        for a in self.agents.iter().filter(|a| !a.done) {
            let r = a.r.rank;
            if self.dead[r].is_some() {
                continue;
            }
            if self.now < self.stall_until[r] {
                at(self.stall_until[r]);
            } else if let Some(p) = a.parked_since {
                at(p + self.wait_timeout + 1);
            }
        }
        for (j, f) in self.faults.iter().enumerate() {
            if let Fault::DeadRank {
                at: Trigger::AtTick(x),
                ..
            }
            | Fault::StalledRank {
                at: Trigger::AtTick(x),
                ..
            } = *f
                && !self.struck[j]
            {
                at(x);
            }
        }
        t
    }

    /// A parked agent (not dead or stalled) past its bound, if any.
    pub(crate) fn timed_out(&mut self) -> Option<Timeout> {
        let bound = self.wait_timeout;
        let i = (0..self.agents.len()).find(|&i| {
            let a = &self.agents[i];
            !a.done
                && !self.benched(a.r.rank)
                && a.parked_since
                    .is_some_and(|t| self.now.saturating_sub(t) > bound)
        })?;
        let waited = self.now - self.agents[i].parked_since.unwrap_or(self.now);
        let a = &self.agents[i];
        let slot = (a.r.rank, a.r.index);
        let qk = match a.pending.as_ref().map(|p| (&p.req, &p.prog)) {
            Some((Req::WaitOrExpire(_), _)) => return Some(Timeout::Expire(i)),
            Some((_, Prog::Posting { peer, qp, .. })) => Some((*peer, *qp, "post to a full QP")),
            Some((Req::Post(post), _)) => {
                let (peer, qp) = post.target();
                Some((peer, qp.0, "post to a full QP"))
            }
            Some((Req::Quiet, _)) => self
                .ops
                .values()
                .find(|o| o.slot == slot)
                .map(|o| (o.peer, o.qp, "quiet")),
            _ => None,
        };
        let Some((peer, qp, during)) = qk else {
            let mut waiting = self.waiting(i);
            waiting.faults = self.fault_notes();
            return Some(Timeout::Fail(Violation::WaitTimeout { waiting, waited }));
        };
        let k = (slot.0, peer, qp);
        let (outstanding, oldest) = match self.qps.get(&k) {
            Some(q) => {
                let oldest = match (q.delivered.front(), q.posted.front()) {
                    (Some(w), _) => format!(
                        "work request {w} ({}), delivered, no completion",
                        describe(self.wrs[w].kind)
                    ),
                    (None, Some(w)) => format!(
                        "work request {w} ({}), not delivered",
                        describe(self.wrs[w].kind)
                    ),
                    (None, None) => "none".into(),
                };
                (u64::from(q.outstanding), oldest)
            }
            None => (0, "none".into()),
        };
        Some(Timeout::Fail(Violation::CompletionTimeout {
            agent: self.agents[i].r.clone(),
            peer,
            qp: QpIndex(qp),
            during,
            outstanding,
            oldest,
            waited,
            faults: self.fault_notes(),
        }))
    }
}
