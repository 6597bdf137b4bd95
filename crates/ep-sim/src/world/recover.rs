//! Recovery after a failed phase (`Transport::recover`, used by `Buffer::reset` and by shrink
//! masking) and clearing injected faults ([`crate::Sim::set_faults`]).
//!
//! A phase that fails leaves the fabric mid-flight: work requests queued towards or from a dead
//! rank, delivered ones whose completion was dropped, posts lost to a QP in error state and not
//! yet reported by a `quiet`, and operations whose agent was torn down before it posted all their
//! work requests. Recovery over a team completes what can complete between team ranks, flushes
//! everything that crosses the team's boundary, and forgets what torn-down agents left behind.

use ep_core::Error;

use super::World;
use crate::fault::Fault;

impl World {
    /// Replaces the injected faults. The effects of the old ones end: dead ranks come back (their
    /// memory as it was when they died), stalls end, dropped completions arrive. Posts already
    /// lost to a QP in error state stay lost (a `quiet` or a recovery reports or flushes them).
    pub(crate) fn set_faults(&mut self, faults: Vec<Fault>) {
        self.dead.iter_mut().for_each(|d| *d = None);
        self.stall_until.iter_mut().for_each(|t| *t = 0);
        for wr in self.wrs.values_mut() {
            wr.no_completion = false;
        }
        self.struck = vec![false; faults.len()];
        self.faults = faults;
    }

    /// Work requests ever posted on QP `k` (what QP fault triggers count).
    pub(crate) fn posted_on(&self, k: super::QpKey) -> u64 {
        self.qps.get(&k).map_or(0, |q| q.posted_total)
    }

    /// Recovery over `team`: flushes every work request between a team rank and a rank outside
    /// the team, completes the rest as the host barrier does, then drops the bookkeeping of
    /// operations whose agents were torn down before posting all their work requests, and the
    /// error completions of team ranks' QPs. Fails like the barrier (a dead team rank, or a work
    /// request between team ranks that can never complete).
    pub(crate) fn recover(&mut self, team: &[usize]) -> Result<(), Error> {
        let n = self.fabric.num_ranks;
        let member = |r: usize| team.contains(&r);
        let crossing: Vec<super::QpKey> = self
            .qps
            .keys()
            .copied()
            .filter(|&(s, d, _)| s < n && d < n && member(s) != member(d))
            .collect();
        for k in crossing {
            self.flush_qp(k);
        }
        self.barrier(team)?;
        // What is left of team ranks' operations was abandoned mid-post: nothing of it is queued.
        let abandoned: Vec<u64> = self
            .ops
            .iter()
            .filter(|(_, o)| member(o.slot.0))
            .map(|(&id, _)| id)
            .collect();
        for id in abandoned {
            if let Some(o) = self.ops.remove(&id)
                && let Some(s) = self.slots.get_mut(&o.slot)
            {
                s.outstanding_ops = s.outstanding_ops.saturating_sub(1);
            }
        }
        for (_, s) in self.slots.iter_mut().filter(|(k, _)| member(k.0)) {
            s.qp_errors.clear();
        }
        Ok(())
    }

    /// Flushes every work request of QP `k` (posted or delivered, never completed): as an error
    /// completion would, it frees the QP slot and its operation, and keeps the stream's delivery
    /// order consistent for later work requests.
    fn flush_qp(&mut self, k: super::QpKey) {
        let Some(q) = self.qps.get_mut(&k) else {
            return;
        };
        let ids: Vec<u64> = q.delivered.drain(..).chain(q.posted.drain(..)).collect();
        q.outstanding = 0;
        for id in ids {
            let Some(wr) = self.wrs.remove(&id) else {
                continue;
            };
            let last = self.last_delivered_seq.entry(wr.stream).or_insert(0);
            *last = (*last).max(wr.seq);
            if let Some(u) = self
                .slots
                .get_mut(&wr.slot)
                .and_then(|s| s.undelivered.get_mut(&k.1))
            {
                u.remove(&id);
            }
            if let Some(o) = self.ops.get_mut(&wr.op) {
                o.left = o.left.saturating_sub(1);
                if o.left == 0 {
                    let slot = o.slot;
                    self.ops.remove(&wr.op);
                    if let Some(s) = self.slots.get_mut(&slot) {
                        s.outstanding_ops = s.outstanding_ops.saturating_sub(1);
                    }
                }
            }
        }
    }
}
