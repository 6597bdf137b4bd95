//! One rank's symmetric heap: lazily materialised 64 KiB pages with shadow state.
//!
//! Shadow layout, per 16-byte granule (the unit DeepEP aligns token rows to, spec §4):
//! - `valid: u16` — bit `i` set when byte `i` of the granule holds a defined value (written by
//!   the protocol, the host, or zero-initialised); clear means poison;
//! - `stamp: Stamp` — the last write to any byte of the granule: its clock key and epoch (who must
//!   be known to read it), the operation id and the call it belonged to.
//!
//! Only pages that are touched exist: a 2 GiB allocation on a 512 MiB granularity costs nothing
//! until written or read.

use std::collections::BTreeMap;

use ep_core::transport::Region;

/// Page size in bytes.
pub(crate) const PAGE: u64 = 1 << 16;
/// Shadow granule in bytes.
pub(crate) const GRANULE: u64 = 16;
const GRANULES_PER_PAGE: usize = (PAGE / GRANULE) as usize;
/// Byte pattern written over scratch memory between calls.
pub(crate) const POISON_BYTE: u8 = 0xA5;

/// The last write to a granule.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Stamp {
    /// Clock key of the writer (agent slot or RDMA stream); 0 for the host.
    pub(crate) key: u32,
    /// The writer's epoch or the stream's sequence number.
    pub(crate) epoch: u64,
    /// Operation id (agent operation or work request); 0 for the host.
    pub(crate) op: u64,
    /// The call the write belonged to (0: none).
    pub(crate) call: u64,
}

struct Page {
    data: Box<[u8]>,
    valid: Box<[u16]>,
    stamp: Box<[Stamp]>,
}

/// A rank's heap.
pub(crate) struct Heap {
    pages: BTreeMap<u64, Page>,
    shadow: bool,
    zero: Vec<Region>,
}

impl Heap {
    /// An empty heap; `shadow` keeps valid bits and stamps.
    pub(crate) fn new(shadow: bool) -> Heap {
        Heap {
            pages: BTreeMap::new(),
            shadow,
            zero: Vec::new(),
        }
    }

    /// Declares `r` zero-initialised (valid zeros once materialised).
    pub(crate) fn add_zero_region(&mut self, r: Region) {
        // Pages already materialised in `r` (a neighbour allocation touched them): make the
        // granules of `r` valid zeros now.
        let pages: Vec<u64> = self
            .pages
            .range(r.addr.0 / PAGE..=(r.end().max(1) - 1) / PAGE)
            .map(|(&p, _)| p)
            .collect();
        for p in pages {
            let page = self.pages.get_mut(&p).expect("listed");
            let lo = r.addr.0.max(p * PAGE);
            let hi = r.end().min((p + 1) * PAGE);
            for a in lo..hi {
                let i = (a - p * PAGE) as usize;
                page.data[i] = 0;
                if !page.valid.is_empty() {
                    page.valid[i / GRANULE as usize] |= 1 << (i % GRANULE as usize);
                }
            }
        }
        self.zero.push(r);
    }

    /// Bytes materialised (data only).
    pub(crate) fn resident_bytes(&self) -> u64 {
        self.pages.len() as u64 * PAGE
    }

    fn page(&mut self, p: u64) -> &mut Page {
        let shadow = self.shadow;
        let zero = &self.zero;
        self.pages.entry(p).or_insert_with(|| {
            let mut page = Page {
                data: vec![0u8; PAGE as usize].into_boxed_slice(),
                valid: if shadow {
                    vec![0u16; GRANULES_PER_PAGE].into_boxed_slice()
                } else {
                    Box::new([])
                },
                stamp: if shadow {
                    vec![Stamp::default(); GRANULES_PER_PAGE].into_boxed_slice()
                } else {
                    Box::new([])
                },
            };
            if shadow {
                let (lo, hi) = (p * PAGE, (p + 1) * PAGE);
                for z in zero {
                    let a0 = z.addr.0.max(lo);
                    let a1 = z.end().min(hi);
                    for a in a0..a1 {
                        let i = (a - lo) as usize;
                        page.valid[i / GRANULE as usize] |= 1 << (i % GRANULE as usize);
                    }
                }
            }
            page
        })
    }

    /// Calls `f(page_base, offset_in_page, len_in_page, offset_in_request)` for each page piece.
    fn pieces(addr: u64, len: u64, mut f: impl FnMut(u64, usize, usize, usize)) {
        let mut a = addr;
        let end = addr + len;
        while a < end {
            let p = a / PAGE;
            let hi = ((p + 1) * PAGE).min(end);
            f(
                p,
                (a - p * PAGE) as usize,
                (hi - a) as usize,
                (a - addr) as usize,
            );
            a = hi;
        }
    }

    /// Reads bytes (poisoned bytes read as whatever they hold).
    pub(crate) fn read(&mut self, addr: u64, out: &mut [u8]) {
        Self::pieces(addr, out.len() as u64, |p, off, n, at| {
            let page = self.page(p);
            out[at..at + n].copy_from_slice(&page.data[off..off + n]);
        });
    }

    /// Reads bytes without materialising pages (an untouched page reads as the zeros it would be
    /// created with): the host's shared read between phases.
    pub(crate) fn read_shared(&self, addr: u64, out: &mut [u8]) {
        Self::pieces(addr, out.len() as u64, |p, off, n, at| {
            match self.pages.get(&p) {
                Some(page) => out[at..at + n].copy_from_slice(&page.data[off..off + n]),
                None => out[at..at + n].fill(0),
            }
        });
    }

    /// Reads a little-endian u64.
    pub(crate) fn read_u64(&mut self, addr: u64) -> u64 {
        let mut b = [0u8; 8];
        self.read(addr, &mut b);
        u64::from_le_bytes(b)
    }

    /// Reads bytes with their valid bits.
    pub(crate) fn read_with_valid(&mut self, addr: u64, len: u64) -> (Vec<u8>, Vec<bool>) {
        let mut data = vec![0u8; len as usize];
        let mut valid = vec![true; len as usize];
        Self::pieces(addr, len, |p, off, n, at| {
            let page = self.page(p);
            data[at..at + n].copy_from_slice(&page.data[off..off + n]);
            if !page.valid.is_empty() {
                for i in 0..n {
                    let b = off + i;
                    valid[at + i] =
                        page.valid[b / GRANULE as usize] & (1 << (b % GRANULE as usize)) != 0;
                }
            }
        });
        (data, valid)
    }

    /// Writes bytes; `valid` (one flag per byte, or `None` for all valid) and `stamp` go to the
    /// shadow of every granule touched.
    pub(crate) fn write(&mut self, addr: u64, bytes: &[u8], valid: Option<&[bool]>, stamp: Stamp) {
        Self::pieces(addr, bytes.len() as u64, |p, off, n, at| {
            let page = self.page(p);
            page.data[off..off + n].copy_from_slice(&bytes[at..at + n]);
            if !page.valid.is_empty() {
                for i in 0..n {
                    let b = off + i;
                    let g = b / GRANULE as usize;
                    let bit = 1u16 << (b % GRANULE as usize);
                    if valid.is_none_or(|v| v[at + i]) {
                        page.valid[g] |= bit;
                    } else {
                        page.valid[g] &= !bit;
                    }
                    page.stamp[g] = stamp;
                }
            }
        });
    }

    /// Poisons `r` in pages that exist (pages that don't are poison already unless zero regions).
    pub(crate) fn poison(&mut self, r: Region) {
        let pages: Vec<u64> = self
            .pages
            .range(r.addr.0 / PAGE..=(r.end().max(1) - 1) / PAGE)
            .map(|(&p, _)| p)
            .collect();
        for p in pages {
            let page = self.pages.get_mut(&p).expect("listed");
            let lo = r.addr.0.max(p * PAGE);
            let hi = r.end().min((p + 1) * PAGE);
            for a in lo..hi {
                let i = (a - p * PAGE) as usize;
                page.data[i] = POISON_BYTE;
                if !page.valid.is_empty() {
                    let g = i / GRANULE as usize;
                    page.valid[g] &= !(1 << (i % GRANULE as usize));
                    page.stamp[g] = Stamp::default();
                }
            }
        }
    }

    /// Calls `f(granule_addr, all_requested_bytes_valid, stamp)` for each granule `[addr, addr+len)` touches.
    pub(crate) fn granules(&mut self, addr: u64, len: u64, mut f: impl FnMut(u64, bool, Stamp)) {
        if !self.shadow || len == 0 {
            return;
        }
        let end = addr + len;
        let mut g = addr / GRANULE * GRANULE;
        while g < end {
            let p = g / PAGE;
            let page = self.page(p);
            let gi = ((g - p * PAGE) / GRANULE) as usize;
            let lo = addr.max(g) - g;
            let hi = end.min(g + GRANULE) - g;
            let mut mask = 0u16;
            for b in lo..hi {
                mask |= 1 << b;
            }
            f(g, page.valid[gi] & mask == mask, page.stamp[gi]);
            g += GRANULE;
        }
    }

    /// FNV-1a over every materialised page's data and shadow, in address order.
    pub(crate) fn digest(&self, mut h: u64) -> u64 {
        let mut eat = |x: u64| {
            for b in x.to_le_bytes() {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x100_0000_01b3);
            }
        };
        for (&p, page) in &self.pages {
            eat(p);
            for c in page.data.chunks(8) {
                let mut w = [0u8; 8];
                w[..c.len()].copy_from_slice(c);
                eat(u64::from_le_bytes(w));
            }
            for &v in page.valid.iter() {
                eat(u64::from(v));
            }
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ep_core::transport::SymAddr;

    #[test]
    fn lazy_pages_poison_and_zero_regions() {
        let mut h = Heap::new(true);
        h.add_zero_region(Region::new(SymAddr(0), 32));
        let (d, v) = h.read_with_valid(24, 16);
        assert_eq!(d, vec![0; 16]);
        assert_eq!(v[..8], [true; 8]);
        assert_eq!(v[8..], [false; 8]);
        h.write(
            PAGE - 4,
            &[1, 2, 3, 4, 5, 6, 7, 8],
            None,
            Stamp {
                key: 3,
                epoch: 1,
                op: 9,
                call: 1,
            },
        );
        let mut b = [0u8; 8];
        h.read(PAGE - 4, &mut b);
        assert_eq!(b, [1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(h.resident_bytes(), 2 * PAGE);
        let mut seen = Vec::new();
        h.granules(PAGE - 4, 8, |g, ok, s| seen.push((g, ok, s.op)));
        assert_eq!(seen, vec![(PAGE - 16, true, 9), (PAGE, true, 9)]);
        h.poison(Region::new(SymAddr(PAGE - 4), 2));
        let (_, v) = h.read_with_valid(PAGE - 4, 4);
        assert_eq!(v, vec![false, false, true, true]);
    }
}
