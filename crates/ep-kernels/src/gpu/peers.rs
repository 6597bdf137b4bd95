//! The arenas of ranks in other processes (docs/protocol.md §2.7): each process exports its
//! local ranks' `normal.ctrl` and `normal.data` ([`IpcExport`]), the processes all-gather the
//! descriptions over an [`Exchange`], and each maps the others' ([`IpcMapping`]), so that every
//! world rank has an address here for the kernels' peer table.
//!
//! A description (little endian): `b"EPARENA1"`, world `u32`, num_sms `u32`, ctrl bytes `u64`,
//! data bytes `u64`, count `u32`, then per local rank its world rank `u32` and the ctrl and data
//! exports ([`IpcExport::BYTES`] each).

use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::ipc::{IpcExport, IpcMapping};
use super::mem::DevBuf;
use crate::error::{Error, Result};
use crate::exchange::Exchange;

const MAGIC: &[u8; 8] = b"EPARENA1";
const HEAD: usize = 8 + 4 + 4 + 8 + 8 + 4;
const PER_RANK: usize = 4 + 2 * IpcExport::BYTES;

/// What every process must agree on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Shape {
    pub(crate) world: usize,
    pub(crate) num_sms: usize,
    pub(crate) ctrl_bytes: u64,
    pub(crate) data_bytes: u64,
}

/// One process's description: the shape and its ranks' exports.
#[derive(Debug)]
struct Desc {
    shape: Shape,
    ranks: Vec<(usize, IpcExport, IpcExport)>,
}

impl Desc {
    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HEAD + PER_RANK * self.ranks.len());
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&(self.shape.world as u32).to_le_bytes());
        b.extend_from_slice(&(self.shape.num_sms as u32).to_le_bytes());
        b.extend_from_slice(&self.shape.ctrl_bytes.to_le_bytes());
        b.extend_from_slice(&self.shape.data_bytes.to_le_bytes());
        b.extend_from_slice(&(self.ranks.len() as u32).to_le_bytes());
        for (r, c, d) in &self.ranks {
            b.extend_from_slice(&(*r as u32).to_le_bytes());
            b.extend_from_slice(&c.to_bytes());
            b.extend_from_slice(&d.to_bytes());
        }
        b
    }

    fn decode(process: usize, b: &[u8]) -> Result<Self> {
        let bad = |reason: String| Error::PeerArena { process, reason };
        let mut rd = Reader(b);
        if rd.take(8) != Some(MAGIC.as_slice()) {
            return Err(bad(format!(
                "{} bytes that are not an arena description",
                b.len()
            )));
        }
        let short = || bad(format!("a truncated description ({} bytes)", b.len()));
        let world = rd.u32().ok_or_else(short)? as usize;
        let num_sms = rd.u32().ok_or_else(short)? as usize;
        let ctrl_bytes = rd.u64().ok_or_else(short)?;
        let data_bytes = rd.u64().ok_or_else(short)?;
        let count = rd.u32().ok_or_else(short)? as usize;
        if rd.0.len() != count * PER_RANK {
            return Err(short());
        }
        let mut ranks = Vec::with_capacity(count);
        for _ in 0..count {
            let r = rd.u32().ok_or_else(short)? as usize;
            let c = rd.take(IpcExport::BYTES).and_then(IpcExport::from_bytes);
            let d = rd.take(IpcExport::BYTES).and_then(IpcExport::from_bytes);
            let (Some(c), Some(d)) = (c, d) else {
                return Err(short());
            };
            ranks.push((r, c, d));
        }
        Ok(Self {
            shape: Shape {
                world,
                num_sms,
                ctrl_bytes,
                data_bytes,
            },
            ranks,
        })
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (a, b) = self.0.split_at_checked(n)?;
        self.0 = b;
        Some(a)
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
}

/// A rank of another process, mapped here.
#[derive(Debug)]
pub(crate) struct Peer {
    pub(crate) world_rank: usize,
    pub(crate) ctrl: IpcMapping,
    pub(crate) data: IpcMapping,
}

/// Checks every process's description against ours and the world's coverage (each world rank
/// in exactly one process); returns the ranks of the other processes to map.
fn check_all(
    me: usize,
    shape: Shape,
    descs: &[Desc],
) -> Result<Vec<(usize, IpcExport, IpcExport)>> {
    let mut owner: Vec<Option<usize>> = vec![None; shape.world];
    let mut to_map = Vec::new();
    for (p, d) in descs.iter().enumerate() {
        let bad = |reason: String| Error::PeerArena { process: p, reason };
        if d.shape != shape {
            return Err(bad(format!("{:?}, this process has {shape:?}", d.shape)));
        }
        for &(r, c, dd) in &d.ranks {
            let Some(slot) = owner.get_mut(r) else {
                return Err(bad(format!("rank {r} in a world of {}", shape.world)));
            };
            if let Some(q) = *slot {
                return Err(bad(format!("rank {r}, which process {q} holds too")));
            }
            *slot = Some(p);
            if c.len() != shape.ctrl_bytes || dd.len() != shape.data_bytes {
                return Err(bad(format!(
                    "rank {r}'s arena has {} + {} bytes, expected {} + {}",
                    c.len(),
                    dd.len(),
                    shape.ctrl_bytes,
                    shape.data_bytes
                )));
            }
            if p != me {
                to_map.push((r, c, dd));
            }
        }
    }
    let missing: Vec<usize> = (0..shape.world).filter(|&r| owner[r].is_none()).collect();
    if !missing.is_empty() {
        return Err(Error::PeerArena {
            process: me,
            reason: format!("no process holds ranks {missing:?}"),
        });
    }
    Ok(to_map)
}

/// Exports `local` (world rank, ctrl, data), all-gathers every process's description, maps the
/// other processes' ranks, and returns them once every process has mapped its peers (a
/// barrier: nobody's kernels run before every peer table is complete).
pub(crate) fn map_peers(
    ex: &mut dyn Exchange,
    ctx: &Arc<CudaContext>,
    shape: Shape,
    local: &[(usize, &DevBuf, &DevBuf)],
) -> Result<Vec<Peer>> {
    let mine = Desc {
        shape,
        ranks: local
            .iter()
            .map(|&(r, c, d)| Ok((r, IpcExport::of(c)?, IpcExport::of(d)?)))
            .collect::<Result<_>>()?,
    };
    let blobs = ex.all_gather(&mine.encode())?;
    let descs: Vec<Desc> = blobs
        .iter()
        .enumerate()
        .map(|(p, b)| Desc::decode(p, b))
        .collect::<Result<_>>()?;
    let me = ex.rank() as usize;
    let mut peers = Vec::new();
    for (r, c, d) in check_all(me, shape, &descs)? {
        peers.push(Peer {
            world_rank: r,
            ctrl: IpcMapping::open(ctx, &c)?,
            data: IpcMapping::open(ctx, &d)?,
        });
    }
    ex.barrier()?;
    Ok(peers)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn export(seed: u8, len: u64) -> IpcExport {
        let mut b = [0u8; IpcExport::BYTES];
        for (i, x) in b.iter_mut().enumerate() {
            *x = seed.wrapping_add(i as u8);
        }
        b[IpcExport::BYTES - 8..].copy_from_slice(&len.to_le_bytes());
        IpcExport::from_bytes(&b).unwrap()
    }

    const SHAPE: Shape = Shape {
        world: 3,
        num_sms: 8,
        ctrl_bytes: 4096,
        data_bytes: 1 << 20,
    };

    fn desc(ranks: &[usize]) -> Desc {
        Desc {
            shape: SHAPE,
            ranks: ranks
                .iter()
                .map(|&r| (r, export(r as u8, 4096), export(100 + r as u8, 1 << 20)))
                .collect(),
        }
    }

    #[test]
    fn a_description_round_trips_and_garbage_is_a_typed_error() {
        let d = desc(&[0, 2]);
        let b = d.encode();
        let back = Desc::decode(1, &b).unwrap();
        assert_eq!(back.shape, d.shape);
        assert_eq!(back.ranks, d.ranks);
        for cut in [0, 7, HEAD, b.len() - 1] {
            assert!(matches!(
                Desc::decode(4, &b[..cut]),
                Err(Error::PeerArena { process: 4, .. })
            ));
        }
        let mut longer = b.clone();
        longer.push(0);
        assert!(Desc::decode(0, &longer).is_err());
    }

    #[test]
    fn every_world_rank_must_be_held_by_exactly_one_process() {
        let to_map = check_all(0, SHAPE, &[desc(&[0, 2]), desc(&[1])]).unwrap();
        assert_eq!(to_map.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1]);
        let to_map = check_all(1, SHAPE, &[desc(&[0, 2]), desc(&[1])]).unwrap();
        assert_eq!(to_map.iter().map(|t| t.0).collect::<Vec<_>>(), vec![0, 2]);
        let e = check_all(0, SHAPE, &[desc(&[0]), desc(&[1])]).unwrap_err();
        assert!(e.to_string().contains("ranks [2]"), "{e}");
        let e = check_all(0, SHAPE, &[desc(&[0, 1]), desc(&[1, 2])]).unwrap_err();
        assert!(e.to_string().contains("process 0 holds too"), "{e}");
        let e = check_all(0, SHAPE, &[desc(&[0, 1]), desc(&[5])]).unwrap_err();
        assert!(e.to_string().contains("rank 5 in a world of 3"), "{e}");
    }

    #[test]
    fn processes_must_agree_on_the_shape_and_arena_sizes() {
        let mut other = desc(&[1, 2]);
        other.shape.num_sms = 10;
        let e = check_all(0, SHAPE, &[desc(&[0]), other]).unwrap_err();
        assert!(matches!(e, Error::PeerArena { process: 1, .. }), "{e}");
        let mut other = desc(&[1, 2]);
        other.ranks[1].2 = export(9, 1 << 19);
        let e = check_all(0, SHAPE, &[desc(&[0]), other]).unwrap_err();
        assert!(e.to_string().contains("rank 2's arena"), "{e}");
    }
}
