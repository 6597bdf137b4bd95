//! The symmetric heap as the host sees it: allocation (every rank's heap grows by the same
//! region), bounds and word checks, host reads and writes, resident bytes and digest, and the
//! per-word visibility clocks (`sync`) that a write without release clears.

use ep_core::Error;
use ep_core::transport::{AllocRequest, Init, Region, SymAddr, SymAlloc};

use super::World;
use crate::memory::{GRANULE, Heap, Stamp};

impl World {
    pub(crate) fn alloc(&mut self, req: AllocRequest) -> Result<SymAlloc, Error> {
        let align = req.align.max(GRANULE).next_power_of_two();
        let addr = self.next_addr.div_ceil(align) * align;
        let avail = self.fabric.heap_bytes.saturating_sub(addr);
        if req.bytes > avail {
            return Err(Error::HeapExhausted {
                requested: req.bytes,
                available: avail,
            });
        }
        self.next_addr = addr + req.bytes;
        let a = SymAlloc {
            name: req.name,
            region: Region::new(SymAddr(addr), req.bytes),
            init: req.init,
        };
        if a.init == Init::Zero {
            for h in &mut self.heaps {
                h.add_zero_region(a.region);
            }
        }
        self.allocs.push(a.clone());
        Ok(a)
    }

    pub(super) fn alloc_of(&self, addr: u64, len: u64) -> Option<&SymAlloc> {
        let i = self.allocs.partition_point(|a| a.region.end() <= addr);
        self.allocs
            .get(i)
            .filter(|a| a.region.addr.0 <= addr && addr + len <= a.region.end())
    }

    pub(super) fn check_bounds(
        &self,
        rank: usize,
        addr: u64,
        len: u64,
        what: &'static str,
    ) -> Result<(), Error> {
        if rank >= self.fabric.num_ranks || self.alloc_of(addr, len.max(1)).is_none() {
            return Err(Error::BadAccess {
                rank,
                what,
                addr,
                len,
            });
        }
        Ok(())
    }

    pub(super) fn check_word(
        &self,
        rank: usize,
        addr: u64,
        what: &'static str,
    ) -> Result<(), Error> {
        if !addr.is_multiple_of(8) {
            return Err(Error::BadAccess {
                rank,
                what,
                addr,
                len: 8,
            });
        }
        self.check_bounds(rank, addr, 8, what)
    }

    pub(crate) fn host_write(&mut self, rank: usize, addr: u64, bytes: &[u8]) -> Result<(), Error> {
        self.check_bounds(rank, addr, bytes.len() as u64, "host write")?;
        self.heaps[rank].write(addr, bytes, None, Stamp::default());
        self.sync_range_clear(rank, addr, bytes.len() as u64);
        Ok(())
    }

    pub(crate) fn host_read(&mut self, rank: usize, addr: u64, len: u64) -> Result<Vec<u8>, Error> {
        let mut v = vec![0u8; len as usize];
        self.host_read_into(rank, addr, &mut v)?;
        Ok(v)
    }

    pub(crate) fn host_read_into(
        &self,
        rank: usize,
        addr: u64,
        out: &mut [u8],
    ) -> Result<(), Error> {
        self.check_bounds(rank, addr, out.len() as u64, "host read")?;
        self.heaps[rank].read_shared(addr, out);
        Ok(())
    }

    pub(crate) fn resident_bytes(&self) -> u64 {
        self.heaps.iter().map(Heap::resident_bytes).sum()
    }

    pub(crate) fn digest(&self) -> u64 {
        self.heaps
            .iter()
            .fold(0xcbf2_9ce4_8422_2325, |h, heap| heap.digest(h))
    }

    pub(super) fn word_now(&mut self, rank: usize, addr: u64) -> (u64, bool) {
        let v = self.heaps[rank].read_u64(addr);
        let mut ok = true;
        self.heaps[rank].granules(addr, 8, |_, valid, _| ok &= valid);
        (v, ok)
    }

    pub(super) fn sync_range_clear(&mut self, rank: usize, addr: u64, len: u64) {
        let lo = addr / 8 * 8;
        let keys: Vec<(usize, u64)> = self
            .sync
            .range((rank, lo)..(rank, addr + len))
            .map(|(&k, _)| k)
            .collect();
        for k in keys {
            self.sync.remove(&k);
        }
    }

    pub(super) fn sync_all_ranks_clear(&mut self, r: Region) {
        for rank in 0..self.fabric.num_ranks {
            self.sync_range_clear(rank, r.addr.0, r.len);
        }
    }
}
