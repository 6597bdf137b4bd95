//! The agent side of the baton: `AgentCtx` calls become requests to the executor.

use std::sync::mpsc::{Receiver, Sender};

use ep_core::transport::{AgentCtx, AgentId, FabricParams, QpIndex, SignalOp, SymAddr, WaitUntil};
use ep_core::{Error, Result};

use crate::proto::{Msg, Post, Req, Resp};

/// An agent's context in the deterministic simulator. Each call hands the baton to the executor
/// and blocks until the executor schedules this agent and serves the call.
pub(crate) struct SimCtx {
    pub(crate) index: usize,
    pub(crate) me: AgentId,
    pub(crate) call: u64,
    pub(crate) fabric: FabricParams,
    pub(crate) tx: Sender<(usize, Msg)>,
    pub(crate) rx: Receiver<Resp>,
}

fn aborted() -> Error {
    Error::PhaseAborted {
        reason: "the simulator stopped the phase".into(),
    }
}

impl SimCtx {
    fn ask(&mut self, r: Req) -> Result<Resp> {
        self.tx
            .send((self.index, Msg::Req(r)))
            .map_err(|_| aborted())?;
        match self.rx.recv().map_err(|_| aborted())? {
            Resp::Err(e) => Err(e),
            x => Ok(x),
        }
    }
    fn unit(&mut self, r: Req) -> Result<()> {
        self.ask(r).map(|_| ())
    }
    fn word(&mut self, r: Req) -> Result<u64> {
        match self.ask(r)? {
            Resp::Word(w) => Ok(w),
            _ => Err(aborted()),
        }
    }
}

impl AgentCtx for SimCtx {
    fn me(&self) -> AgentId {
        self.me
    }
    fn num_ranks(&self) -> usize {
        self.fabric.num_ranks
    }
    fn call(&self) -> u64 {
        self.call
    }
    fn work_requests(&self, dst: SymAddr, src: SymAddr, len: u64) -> u32 {
        self.fabric.work_requests(dst, src, len)
    }
    fn put(
        &mut self,
        peer: usize,
        qp: QpIndex,
        dst: SymAddr,
        src: SymAddr,
        len: u64,
    ) -> Result<()> {
        self.unit(Req::Post(Post::Put {
            peer,
            qp,
            dst,
            src,
            len,
            signal: None,
        }))
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
        self.unit(Req::Post(Post::Put {
            peer,
            qp,
            dst,
            src,
            len,
            signal: Some((signal, op, value)),
        }))
    }
    fn amo_add(&mut self, peer: usize, qp: QpIndex, word: SymAddr, value: u64) -> Result<()> {
        self.unit(Req::Post(Post::Amo {
            peer,
            qp,
            word,
            value,
        }))
    }
    fn fence(&mut self) -> Result<()> {
        self.unit(Req::Fence)
    }
    fn quiet(&mut self) -> Result<()> {
        self.unit(Req::Quiet)
    }
    fn store(&mut self, rank: usize, addr: SymAddr, bytes: &[u8]) -> Result<()> {
        self.unit(Req::Store {
            rank,
            addr,
            bytes: bytes.to_vec(),
            release: false,
        })
    }
    fn store_release(&mut self, rank: usize, addr: SymAddr, value: u64) -> Result<()> {
        self.unit(Req::Store {
            rank,
            addr,
            bytes: value.to_le_bytes().to_vec(),
            release: true,
        })
    }
    fn store_release_after_fence(
        &mut self,
        rank: usize,
        addr: SymAddr,
        value: u64,
        data: Option<(SymAddr, &[u8])>,
    ) -> Result<()> {
        self.unit(Req::StoreReleaseAfterFence {
            rank,
            addr,
            value,
            data: data.map(|(a, b)| (a, b.to_vec())),
        })
    }
    fn load(&mut self, rank: usize, addr: SymAddr, out: &mut [u8]) -> Result<()> {
        match self.ask(Req::Load {
            rank,
            addr,
            len: out.len() as u64,
        })? {
            Resp::Bytes(b) => {
                out.copy_from_slice(&b);
                Ok(())
            }
            _ => Err(aborted()),
        }
    }
    fn load_acquire(&mut self, rank: usize, addr: SymAddr) -> Result<u64> {
        self.word(Req::LoadAcquire { rank, addr })
    }
    fn wait(&mut self, until: &WaitUntil) -> Result<u64> {
        self.word(Req::Wait(until.clone()))
    }
    fn wait_or_expire(&mut self, until: &WaitUntil) -> Result<Option<u64>> {
        match self.ask(Req::WaitOrExpire(until.clone()))? {
            Resp::Word(w) => Ok(Some(w)),
            Resp::Expired => Ok(None),
            _ => Err(aborted()),
        }
    }
    fn block_barrier(&mut self) -> Result<()> {
        self.unit(Req::Barrier)
    }
}
