//! Barriers: the host barrier over a team (drains the team's work requests, then merges the
//! team's knowledge) and the block barrier among one block's agents (release/acquire).

use ep_core::Error;

use super::{Event, Pending, Prog, Served, World};
use crate::clock::{KeyDesc, VClock};
use crate::proto::{Req, Resp};

impl World {
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

    /// A block barrier (release/acquire among the block's agents): the first service counts
    /// the agent in and parks it, the service after the last arrival hands it the block's
    /// joined clock and hops.
    pub(super) fn serve_block_barrier(&mut self, i: usize, rank: usize, prog: Prog) -> Served {
        let block = (rank, self.agents[i].block);
        match prog {
            Prog::Arrived(_) => {
                let done = self.blocks[&block].done_vc.clone();
                let h = self.blocks[&block].done_hops;
                self.agents[i].hops = self.agents[i].hops.join(h);
                self.agents[i].vc.join(&done);
                Served::Respond(Resp::Unit)
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
                Served::Stay
            }
        }
    }
}
