//! Threads-mode memory: per allocation, a table of lazily allocated 256 KiB pages, each behind its
//! own lock. Data moves with one `copy_from_slice` per page piece while that page's lock is held
//! (no per-byte bookkeeping, no per-operation allocation); a copy between two pages takes both
//! locks in a global order (rank, allocation, page), so concurrent puts cannot deadlock.
//!
//! Protocol races (two agents writing the same bytes) serialise on the page lock: they never
//! become Rust data races. Pages read as zeros until first written (poison is not tracked here).

use std::sync::{Mutex, MutexGuard};

use ep_core::transport::Region;

/// Page size of threads mode.
pub(crate) const TPAGE: u64 = 1 << 18;

type Page = Mutex<Option<Box<[u8]>>>;

fn lock(p: &Page) -> MutexGuard<'_, Option<Box<[u8]>>> {
    p.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One allocation's pages on one rank.
struct Segment {
    region: Region,
    pages: Box<[Page]>,
}

impl Segment {
    fn page_len(&self, i: usize) -> usize {
        (self.region.len - i as u64 * TPAGE).min(TPAGE) as usize
    }
}

/// One rank's memory in threads mode.
#[derive(Default)]
pub(crate) struct TMem {
    segs: Vec<Segment>,
}

/// A located piece: (segment index, page index, offset in page, length).
type Piece = (usize, usize, usize, usize);

impl TMem {
    /// Adds an allocation (regions are added in increasing address order).
    pub(crate) fn add(&mut self, region: Region) {
        let n = region.len.div_ceil(TPAGE) as usize;
        self.segs.push(Segment {
            region,
            pages: (0..n).map(|_| Mutex::new(None)).collect(),
        });
    }

    /// The segment holding `[addr, addr + len)` entirely, if any.
    pub(crate) fn segment(&self, addr: u64, len: u64) -> Option<usize> {
        let i = self.segs.partition_point(|s| s.region.end() <= addr);
        let s = self.segs.get(i)?;
        (s.region.addr.0 <= addr && addr + len.max(1) <= s.region.end()).then_some(i)
    }

    /// Calls `f` for each page piece of `[addr, addr + len)` in segment `seg`.
    fn pieces(&self, seg: usize, addr: u64, len: u64, mut f: impl FnMut(Piece, usize)) {
        let base = self.segs[seg].region.addr.0;
        let mut off = addr - base;
        let end = off + len;
        let mut at = 0usize;
        while off < end {
            let p = (off / TPAGE) as usize;
            let in_page = (off % TPAGE) as usize;
            let n = ((p as u64 + 1) * TPAGE).min(end) - off;
            f((seg, p, in_page, n as usize), at);
            off += n;
            at += n as usize;
        }
    }

    fn page(&self, seg: usize, p: usize) -> &Page {
        &self.segs[seg].pages[p]
    }

    fn materialise<'a>(&self, seg: usize, p: usize, g: &'a mut Option<Box<[u8]>>) -> &'a mut [u8] {
        let n = self.segs[seg].page_len(p);
        g.get_or_insert_with(|| vec![0u8; n].into_boxed_slice())
    }

    /// Writes `bytes` at `addr` (bounds checked by the caller: `seg` holds it).
    pub(crate) fn write(&self, seg: usize, addr: u64, bytes: &[u8]) {
        self.pieces(seg, addr, bytes.len() as u64, |(s, p, o, n), at| {
            let mut g = lock(self.page(s, p));
            self.materialise(s, p, &mut g)[o..o + n].copy_from_slice(&bytes[at..at + n]);
        });
    }

    /// Reads into `out` from `addr`.
    pub(crate) fn read(&self, seg: usize, addr: u64, out: &mut [u8]) {
        self.pieces(seg, addr, out.len() as u64, |(s, p, o, n), at| {
            let g = lock(self.page(s, p));
            match g.as_deref() {
                Some(d) => out[at..at + n].copy_from_slice(&d[o..o + n]),
                None => out[at..at + n].fill(0),
            }
        });
    }

    /// Hands `[addr, addr + len)` to `f` page piece by page piece, each under its page's lock
    /// (an untouched page as zeros), without copying.
    pub(crate) fn visit(&self, seg: usize, addr: u64, len: u64, f: &mut dyn FnMut(&[u8])) {
        static ZEROS: [u8; 4096] = [0; 4096];
        self.pieces(seg, addr, len, |(s, p, o, n), _| {
            let g = lock(self.page(s, p));
            match g.as_deref() {
                Some(d) => f(&d[o..o + n]),
                None => {
                    for k in (0..n).step_by(ZEROS.len()) {
                        f(&ZEROS[..ZEROS.len().min(n - k)]);
                    }
                }
            }
        });
    }

    /// Reads a little-endian u64 (8-byte aligned words never straddle a page).
    pub(crate) fn read_u64(&self, seg: usize, addr: u64) -> u64 {
        let mut b = [0u8; 8];
        self.read(seg, addr, &mut b);
        u64::from_le_bytes(b)
    }

    /// Applies `f` to the word at `addr` under its page lock and returns the new value.
    pub(crate) fn update_u64(&self, seg: usize, addr: u64, f: impl FnOnce(u64) -> u64) -> u64 {
        let base = self.segs[seg].region.addr.0;
        let off = addr - base;
        let (p, o) = ((off / TPAGE) as usize, (off % TPAGE) as usize);
        debug_assert!(
            o + 8 <= self.segs[seg].page_len(p),
            "aligned words stay in a page"
        );
        let mut g = lock(self.page(seg, p));
        let d = self.materialise(seg, p, &mut g);
        let new = f(u64::from_le_bytes(d[o..o + 8].try_into().expect("8 bytes")));
        d[o..o + 8].copy_from_slice(&new.to_le_bytes());
        new
    }
}

/// Copies `len` bytes from `src` (rank `sr`, segment `ss`, address `sa`) to `dst` (rank `dr`,
/// segment `ds`, address `da`), page piece by page piece, holding both pages' locks in the global
/// order (rank, segment, page) for each piece.
pub(crate) fn copy(
    (src, sr, ss, sa): (&TMem, usize, usize, u64),
    (dst, dr, ds, da): (&TMem, usize, usize, u64),
    len: u64,
) {
    let mut done = 0u64;
    while done < len {
        let (so, dof) = (
            sa + done - src.segs[ss].region.addr.0,
            da + done - dst.segs[ds].region.addr.0,
        );
        let n = (len - done)
            .min(TPAGE - so % TPAGE)
            .min(TPAGE - dof % TPAGE) as usize;
        let (sp, spo) = ((so / TPAGE) as usize, (so % TPAGE) as usize);
        let (dp, dpo) = ((dof / TPAGE) as usize, (dof % TPAGE) as usize);
        let skey = (sr, ss, sp);
        let dkey = (dr, ds, dp);
        if skey == dkey {
            let mut g = lock(dst.page(ds, dp));
            let d = dst.materialise(ds, dp, &mut g);
            d.copy_within(spo..spo + n, dpo);
        } else {
            // Lock in the global order; the source may be an untouched page (zeros).
            let (mut gs, mut gd);
            if skey < dkey {
                gs = lock(src.page(ss, sp));
                gd = lock(dst.page(ds, dp));
            } else {
                gd = lock(dst.page(ds, dp));
                gs = lock(src.page(ss, sp));
            }
            let d = dst.materialise(ds, dp, &mut gd);
            match gs.as_deref_mut() {
                Some(s) => d[dpo..dpo + n].copy_from_slice(&s[spo..spo + n]),
                None => d[dpo..dpo + n].fill(0),
            }
        }
        done += n as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ep_core::transport::SymAddr;

    #[test]
    fn pieces_straddle_pages_and_copies_lock_in_order() {
        let mut a = TMem::default();
        let mut b = TMem::default();
        let r = Region::new(SymAddr(128), 3 * TPAGE + 100);
        a.add(r);
        b.add(r);
        let seg = a.segment(128, 10).expect("segment");
        assert!(a.segment(0, 8).is_none());
        assert!(a.segment(r.end() - 4, 8).is_none());
        let data: Vec<u8> = (0..2 * TPAGE as usize + 77)
            .map(|i| (i * 7) as u8)
            .collect();
        a.write(seg, 1000, &data);
        let mut back = vec![0u8; data.len()];
        a.read(seg, 1000, &mut back);
        assert_eq!(back, data);
        copy((&a, 0, seg, 1000), (&b, 1, seg, 5000), data.len() as u64);
        b.read(seg, 5000, &mut back);
        assert_eq!(back, data);
        // Overlapping copy within one rank (same pages): memmove semantics per piece.
        copy((&b, 1, seg, 5000), (&b, 1, seg, 5008), 64);
        let mut w = [0u8; 8];
        b.read(seg, 5008, &mut w);
        assert_eq!(w[..], data[..8]);
        assert_eq!(a.update_u64(seg, 128, |v| v + 5), 5);
        assert_eq!(a.read_u64(seg, 128), 5);
    }
}
