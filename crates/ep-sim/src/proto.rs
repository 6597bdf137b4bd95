//! Messages between an agent's thread and the executor (the baton protocol).

use ep_core::transport::{QpIndex, SignalOp, SymAddr, WaitUntil};

/// A vocabulary call, sent by the agent; the executor serves it when it schedules the agent.
#[derive(Debug, Clone)]
pub(crate) enum Req {
    /// Implicit first request: the thread waits for permission to start.
    Start,
    /// An RDMA-class post (`put`, `put_signal`, `amo_add`): work requests on a QP.
    Post(Post),
    Fence,
    Quiet,
    Store {
        rank: usize,
        addr: SymAddr,
        bytes: Vec<u8>,
        release: bool,
    },
    /// `store_release_after_fence`: a GPU thread's release (optionally with put data).
    StoreReleaseAfterFence {
        rank: usize,
        addr: SymAddr,
        value: u64,
        data: Option<(SymAddr, Vec<u8>)>,
    },
    Load {
        rank: usize,
        addr: SymAddr,
        len: u64,
    },
    LoadAcquire {
        rank: usize,
        addr: SymAddr,
    },
    Wait(WaitUntil),
    /// A wait whose expiry is answered to the agent (`wait_or_expire`).
    WaitOrExpire(WaitUntil),
    Barrier,
}

/// The requests that post work requests to a QP: the only ones the QP engine plans.
#[derive(Debug, Clone)]
pub(crate) enum Post {
    Put {
        peer: usize,
        qp: QpIndex,
        dst: SymAddr,
        src: SymAddr,
        len: u64,
        signal: Option<(SymAddr, SignalOp, u64)>,
    },
    Amo {
        peer: usize,
        qp: QpIndex,
        word: SymAddr,
        value: u64,
    },
}

impl Post {
    /// The peer and the QP towards it.
    pub(crate) fn target(&self) -> (usize, QpIndex) {
        match *self {
            Post::Put { peer, qp, .. } | Post::Amo { peer, qp, .. } => (peer, qp),
        }
    }
}

impl Req {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Req::Start => "start",
            Req::Post(Post::Put { signal: None, .. }) => "put",
            Req::Post(Post::Put { .. }) => "put_signal",
            Req::Post(Post::Amo { .. }) => "amo_add",
            Req::Fence => "fence",
            Req::Quiet => "quiet",
            Req::Store { release: false, .. } => "store",
            Req::Store { .. } => "store_release",
            Req::StoreReleaseAfterFence { .. } => "store_release_after_fence",
            Req::Load { .. } => "load",
            Req::LoadAcquire { .. } => "load_acquire",
            Req::Wait(_) => "wait",
            Req::WaitOrExpire(_) => "wait_or_expire",
            Req::Barrier => "block_barrier",
        }
    }
}

/// The executor's answer.
#[derive(Debug)]
pub(crate) enum Resp {
    Unit,
    Bytes(Vec<u8>),
    Word(u64),
    /// The wait's bound expired (answer to `WaitOrExpire`).
    Expired,
    Err(ep_core::Error),
}

/// What an agent thread sends.
#[derive(Debug)]
pub(crate) enum Msg {
    Req(Req),
    Done(ep_core::Result<()>),
}
