//! The deterministic executor: one OS thread per agent, and a baton that only the executor hands
//! out. At every vocabulary call (a scheduling point) the agent sends its request and blocks; the
//! executor picks the next event (serve an agent, deliver a work request, complete one) with the
//! seeded RNG under the configured policy, so a seed fixes the whole interleaving.

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc;
use std::thread;

use ep_core::Error;
use ep_core::transport::{AgentId, Phase, PhaseReport};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::config::Policy;
use crate::ctx::SimCtx;
use crate::proto::{Msg, Resp};
use crate::violation::SimError;
use crate::world::{Event, Pending, Prog, QpKey, Served, SlotKey, Timeout, World};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Entity {
    Agent(SlotKey),
    Deliver(QpKey),
    Complete(QpKey),
}

/// Picks events: the seeded RNG and the policy's state.
pub(crate) struct Chooser {
    rng: ChaCha8Rng,
    policy: Policy,
    prio: BTreeMap<Entity, u64>,
    change_points: Vec<u64>,
    steps: u64,
}

impl Chooser {
    pub(crate) fn new(seed: u64, policy: Policy) -> Chooser {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut change_points = Vec::new();
        if let Policy::Pct { depth, horizon } = policy {
            for _ in 1..depth.max(1) {
                change_points.push(rng.random_range(0..horizon.max(1)));
            }
        }
        Chooser {
            rng,
            policy,
            prio: BTreeMap::new(),
            change_points,
            steps: 0,
        }
    }

    fn entity(w: &World, e: Event) -> Entity {
        match e {
            Event::Agent(i) => Entity::Agent((w.agents[i].r.rank, w.agents[i].r.index)),
            Event::Deliver(k) => Entity::Deliver(k),
            Event::Complete(k) => Entity::Complete(k),
        }
    }

    pub(crate) fn pick(&mut self, w: &World, ev: &[Event]) -> Event {
        self.steps += 1;
        match self.policy {
            Policy::Uniform => ev[self.rng.random_range(0..ev.len())],
            Policy::LatestLegal => {
                let agents: Vec<Event> = ev
                    .iter()
                    .copied()
                    .filter(|e| matches!(e, Event::Agent(_)))
                    .collect();
                let pool = if agents.is_empty() {
                    ev.to_vec()
                } else {
                    agents
                };
                pool[self.rng.random_range(0..pool.len())]
            }
            Policy::Pct { depth, .. } => {
                for &e in ev {
                    let ent = Self::entity(w, e);
                    if !self.prio.contains_key(&ent) {
                        let p = u64::from(depth) + u64::from(self.rng.random::<u32>());
                        self.prio.insert(ent, p);
                    }
                }
                let best = |c: &Chooser| {
                    *ev.iter()
                        .max_by_key(|&&e| (c.prio[&Self::entity(w, e)], std::cmp::Reverse(e)))
                        .expect("non-empty")
                };
                let mut e = best(self);
                if let Some(j) = self.change_points.iter().position(|&c| c == self.steps) {
                    self.prio.insert(Self::entity(w, e), j as u64);
                    e = best(self);
                }
                e
            }
        }
    }
}

fn agent_failed(w: &World, i: usize, e: Error) -> SimError {
    match e {
        Error::PhaseAborted { .. } => SimError::Core(e),
        Error::BadAccess { .. }
        | Error::Unreachable { .. }
        | Error::QpOutOfRange { .. }
        | Error::WaitTimeout { .. }
        | Error::QpError { .. }
        | Error::CompletionTimeout { .. }
        | Error::RankFailed { .. }
        | Error::ProtocolViolation { .. } => SimError::Core(e),
        other => SimError::Core(Error::AgentFailed {
            rank: w.agents[i].r.rank,
            agent: w.agents[i].r.to_string(),
            detail: other.to_string(),
        }),
    }
}

/// Runs one phase to completion or to its first violation.
pub(crate) fn run_phase(
    w: &mut World,
    ch: &mut Chooser,
    phase: Phase<'_>,
    spawn_limit: Option<usize>,
) -> Result<PhaseReport, SimError> {
    let specs: Vec<(usize, usize, String)> = phase
        .agents
        .iter()
        .map(|a| (a.rank, a.block, a.role.clone()))
        .collect();
    for a in &phase.agents {
        if a.rank >= w.fabric.num_ranks {
            return Err(Error::BadAccess {
                rank: a.rank,
                what: "agent rank",
                addr: 0,
                len: 0,
            }
            .into());
        }
    }
    w.violation = None;
    w.begin_phase(
        phase.kind.clone(),
        phase.call,
        &specs,
        &phase.assume_zero,
        phase.rings.clone(),
    )
    .map_err(SimError::Violation)?;
    let (tx, rx) = mpsc::channel::<(usize, Msg)>();
    let call = phase.call;
    let total = phase.agents.len();
    let result = thread::scope(|s| {
        let mut resp = Vec::new();
        let mut refused = None;
        for (i, spec) in phase.agents.into_iter().enumerate() {
            let (rtx, rrx) = mpsc::channel::<Resp>();
            resp.push(rtx);
            let mut ctx = SimCtx {
                index: i,
                me: AgentId {
                    rank: w.agents[i].r.rank,
                    index: w.agents[i].r.index,
                },
                call,
                fabric: w.fabric.clone(),
                tx: tx.clone(),
                rx: rrx,
            };
            let body = spec.body;
            let refuse = spawn_limit.is_some_and(|l| i >= l);
            let spawned = thread::Builder::new()
                .name(format!("sim-agent-{i}"))
                .spawn_scoped(s, move || {
                    if refuse {
                        return;
                    }
                    match ctx.rx.recv() {
                        Ok(Resp::Unit) => {}
                        _ => {
                            let _ = ctx.tx.send((i, Msg::Done(Ok(()))));
                            return;
                        }
                    }
                    let r = catch_unwind(AssertUnwindSafe(|| body(&mut ctx)));
                    let r = r.unwrap_or_else(|p| {
                        let msg = p
                            .downcast_ref::<&str>()
                            .map(|s| (*s).to_owned())
                            .or_else(|| p.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "panic".into());
                        Err(Error::AgentFailed {
                            rank: ctx.me.rank,
                            agent: format!("{}", ctx.me),
                            detail: msg,
                        })
                    });
                    let _ = ctx.tx.send((i, Msg::Done(r)));
                });
            let spawned = match spawned {
                Ok(_) if refuse => Err(std::io::Error::other(
                    "refused by Sim::limit_agent_threads (test hook)",
                )),
                other => other,
            };
            if let Err(e) = spawned {
                refused = Some(Error::AgentSpawnFailed {
                    rank: w.agents[i].r.rank,
                    agent: format!("{} ({})", w.agents[i].r, specs[i].2),
                    started: i,
                    total,
                    detail: e.to_string(),
                });
                break;
            }
        }
        if let Some(e) = refused {
            // The agents already started wait for their first answer: closing their channels
            // lets each of them return at once, and the scope joins them.
            drop(resp);
            return Err(SimError::Core(e));
        }
        drop(tx);
        let r = schedule(w, ch, &resp, &rx);
        // Teardown: answer every remaining agent with an abort until it finishes.
        for (i, r) in resp.iter().enumerate() {
            if !w.agents[i].done {
                let _ = r.send(Resp::Err(Error::PhaseAborted {
                    reason: "phase stopped".into(),
                }));
            }
        }
        while w.agents.iter().any(|a| !a.done) {
            let Ok((j, m)) = rx.recv() else { break };
            match m {
                Msg::Done(_) => w.agents[j].done = true,
                Msg::Req(_) => {
                    let _ = resp[j].send(Resp::Err(Error::PhaseAborted {
                        reason: "phase stopped".into(),
                    }));
                }
            }
        }
        r
    });
    let report = w.end_phase();
    result.map(|()| report)
}

fn schedule(
    w: &mut World,
    ch: &mut Chooser,
    resp: &[mpsc::Sender<Resp>],
    rx: &mpsc::Receiver<(usize, Msg)>,
) -> Result<(), SimError> {
    loop {
        if let Some(v) = w.violation.take() {
            return Err(v.into());
        }
        if let Some(r) = w.finished() {
            return r;
        }
        let ev = w.enabled_events();
        match w.timed_out() {
            Some(Timeout::Fail(v)) => return Err(v.into()),
            Some(Timeout::Expire(i)) => {
                w.agents[i].pending = None;
                w.agents[i].parked_since = None;
                answer(w, resp, rx, i, Resp::Expired)?;
                continue;
            }
            None => {}
        }
        if ev.is_empty() {
            // With faults injected, virtual time jumps to the next thing that can happen.
            if let Some(t) = w.next_time_event() {
                w.now = t;
                continue;
            }
            return Err(w.deadlock().into());
        }
        let e = ch.pick(w, &ev);
        w.now += 1;
        match e {
            Event::Deliver(k) => w.deliver(k),
            Event::Complete(k) => w.complete(k),
            Event::Agent(i) => match w.serve(i) {
                Served::Stay => {}
                Served::Respond(r) => answer(w, resp, rx, i, r)?,
            },
        }
    }
}

/// Answers agent `i` and takes its next request (or its end).
fn answer(
    w: &mut World,
    resp: &[mpsc::Sender<Resp>],
    rx: &mpsc::Receiver<(usize, Msg)>,
    i: usize,
    r: Resp,
) -> Result<(), SimError> {
    if resp[i].send(r).is_err() {
        w.agents[i].done = true;
        return Ok(());
    }
    let (j, m) = rx.recv().map_err(|_| Error::PhaseAborted {
        reason: "agent threads vanished".into(),
    })?;
    debug_assert_eq!(i, j, "only the scheduled agent runs");
    match m {
        Msg::Req(req) => {
            w.agents[j].pending = Some(Pending {
                req,
                prog: Prog::None,
            });
            Ok(())
        }
        Msg::Done(Ok(())) => {
            w.agents[j].done = true;
            Ok(())
        }
        Msg::Done(Err(e)) => {
            w.agents[j].done = true;
            if let Some(v) = w.violation.take() {
                return Err(v.into());
            }
            Err(agent_failed(w, j, e))
        }
    }
}
