//! LogFMT-10 combine partials in their slots (docs/protocol.md §3.12). The codec
//! (`numerics::logfmt`) writes a message — the division metas, then the chunks back to back;
//! the combine moves the same bytes laid out otherwise: each chunk at its raw place in the
//! partial's slot ([`ll_logfmt_chunk_place`]), the metas in the slot's own record
//! (`LlLayout::csend_meta` / `crecv_meta`, word `v` at [`ll_logfmt_meta_word`]). Only that
//! relocation is here, so a decoded partial is the plan's (`PartialPrecision::LogFmt10`) bit for
//! bit, and the slot holds what the kernels' `logfmt_store_unit` writes there.

use std::ops::Range;

use half::bf16;

use super::bytes::get_u32;
use super::layout::{LL_LOGFMT_UNIT_CHUNKS, ll_logfmt_chunk_place, ll_logfmt_meta_word};
use crate::error::Result;
use crate::numerics::logfmt::{self, DIVISION, Layout};

/// Where one chunk of a partial travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    /// Offset in the slot (the chunk's raw place).
    pub(crate) at: u64,
    /// Offset in the codec's message.
    msg: usize,
    /// Bytes (`10/8 · channels` cast, `2 · channels` raw).
    pub(crate) len: u64,
}

impl Piece {
    /// The piece's bytes inside a slot.
    pub(crate) fn range(self) -> Range<usize> {
        self.at as usize..(self.at + self.len) as usize
    }
}

/// One unit of a partial (docs/protocol.md §3.12): its chunks' pieces, put one by one, then the
/// bytes of its division metas in the meta record, put in one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Unit {
    pub(crate) pieces: Vec<Piece>,
    pub(crate) metas: Range<u64>,
}

/// The slot form of the partials of one hidden size.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SlotCodec {
    layout: Layout,
}

impl SlotCodec {
    /// For partials of `hidden` channels; errors unless `hidden` is a positive multiple of 128.
    pub(crate) fn new(hidden: usize) -> Result<Self> {
        Ok(Self {
            layout: Layout::new(hidden)?,
        })
    }

    /// `S = H / 128` meta words.
    pub(crate) fn num_metas(&self) -> usize {
        self.layout.num_divisions()
    }

    /// Bytes of the meta words (`4S`, what travels; the record is `a16(4S)`).
    pub(crate) fn meta_bytes(&self) -> usize {
        ll_logfmt_meta_word(self.num_metas()) as usize
    }

    /// The meta words of a partial from the first [`SlotCodec::meta_bytes`] of `metas`.
    pub(crate) fn meta_words(&self, metas: &[u8]) -> Vec<u32> {
        (0..self.num_metas())
            .map(|v| get_u32(metas, 4 * v))
            .collect()
    }

    /// The pieces of a partial whose metas are `meta`, chunk by chunk.
    pub(crate) fn pieces(&self, meta: &[u32]) -> Vec<Piece> {
        let mut msg = self.layout.data_offset();
        (0..self.layout.num_chunks())
            .map(|k| {
                let channels = self.layout.chunk_channels(k).len();
                let len = Layout::chunk_bytes(channels, self.layout.chunk_cast(meta, k));
                let p = Piece {
                    at: ll_logfmt_chunk_place(k),
                    msg,
                    len: len as u64,
                };
                msg += len;
                p
            })
            .collect()
    }

    /// The units of a partial whose metas are `meta`, in order.
    pub(crate) fn units(&self, meta: &[u32]) -> Vec<Unit> {
        let pieces = self.pieces(meta);
        let k_count = self.layout.num_chunks();
        (0..k_count.div_ceil(LL_LOGFMT_UNIT_CHUNKS))
            .map(|u| {
                let ks = u * LL_LOGFMT_UNIT_CHUNKS..((u + 1) * LL_LOGFMT_UNIT_CHUNKS).min(k_count);
                let first = self.layout.chunk_channels(ks.start).start / DIVISION;
                let last = self.layout.chunk_channels(ks.end - 1).end / DIVISION;
                Unit {
                    pieces: pieces[ks].to_vec(),
                    metas: ll_logfmt_meta_word(first)..ll_logfmt_meta_word(last),
                }
            })
            .collect()
    }

    /// Encodes partial `x` (`H` BF16) into its slot form: the chunks at their places in `slot`
    /// (at least `2H` bytes; the bytes past a cast chunk in its place are left as they are) and
    /// the meta words, little-endian, in `metas` (at least [`SlotCodec::meta_bytes`]). Returns
    /// the meta words.
    pub(crate) fn encode(&self, x: &[bf16], slot: &mut [u8], metas: &mut [u8]) -> Result<Vec<u32>> {
        let mut msg = vec![0u8; self.layout.max_bytes()];
        logfmt::encode_row_into(x, &mut msg)?;
        let n = self.meta_bytes();
        metas[..n].copy_from_slice(&msg[..n]);
        let meta = self.meta_words(&msg);
        for p in self.pieces(&meta) {
            slot[p.range()].copy_from_slice(&msg[p.msg..p.msg + p.len as usize]);
        }
        Ok(meta)
    }

    /// Decodes the partial whose meta bytes are `metas` ([`SlotCodec::meta_bytes`] of them) and
    /// whose pieces are in `slot` at their places: what the codec's decoder gives for the
    /// message (f32, not rounded).
    pub(crate) fn decode(&self, metas: &[u8], slot: &[u8]) -> Result<Vec<f32>> {
        let n = self.meta_bytes();
        let meta = self.meta_words(metas);
        let pieces = self.pieces(&meta);
        let size = pieces
            .last()
            .map_or(self.layout.data_offset(), |p| p.msg + p.len as usize);
        let mut msg = vec![0u8; size];
        msg[..n].copy_from_slice(&metas[..n]);
        for p in pieces {
            msg[p.msg..p.msg + p.len as usize].copy_from_slice(&slot[p.range()]);
        }
        logfmt::decode_row(&msg, self.layout.hidden())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// A row of `h` channels: chunk `k` cast when `cast(k)` (values in ±(2^-12, 0.9)), raw
    /// otherwise (one value of 3.0).
    fn row(rng: &mut ChaCha8Rng, h: usize, cast: impl Fn(usize) -> bool) -> Vec<bf16> {
        (0..h)
            .map(|c| {
                let k = c / logfmt::CHUNK;
                let v = if !cast(k) && c % logfmt::CHUNK == 7 {
                    3.0
                } else {
                    rng.random_range(2f32.powi(-12)..0.9)
                };
                bf16::from_f32(if rng.random() { v } else { -v })
            })
            .collect()
    }

    /// The slot form is the codec's message relocated: pieces at raw places with the codec's
    /// chunk sizes, metas `amax | amin << 16` per division, units of two chunks with their
    /// divisions; decoding it gives the codec's decode bit for bit; bytes past a cast chunk are
    /// neither written nor read (poison there changes nothing).
    #[test]
    fn slot_form_is_the_message_relocated() {
        let mut rng = ChaCha8Rng::seed_from_u64(12);
        for (h, cast) in [
            (
                7168usize,
                &(|k: usize| k % 3 != 1) as &dyn Fn(usize) -> bool,
            ),
            (640, &|k| k == 1),
            (1536, &|_| true),
            (128, &|_| false),
        ] {
            let x = row(&mut rng, h, cast);
            let c = SlotCodec::new(h).unwrap();
            let (mut slot, mut metas) = (vec![0xa5u8; 2 * h], vec![0x5au8; c.meta_bytes() + 4]);
            let meta = c.encode(&x, &mut slot, &mut metas).unwrap();
            assert_eq!(meta, logfmt::row_meta(&x));
            assert_eq!(
                &metas[c.meta_bytes()..],
                &[0x5a; 4],
                "only 4S meta bytes written"
            );
            let msg = logfmt::encode_row(&x).unwrap();
            let pieces = c.pieces(&meta);
            assert_eq!(pieces.len(), h.div_ceil(logfmt::CHUNK));
            for (k, p) in pieces.iter().enumerate() {
                let ch = (h - k * logfmt::CHUNK).min(logfmt::CHUNK);
                assert_eq!(p.at, 1024 * k as u64);
                assert_eq!(p.len as usize, if cast(k) { ch * 10 / 8 } else { 2 * ch });
                assert_eq!(
                    &slot[p.range()],
                    &msg[p.msg..p.msg + p.len as usize],
                    "H {h} chunk {k}"
                );
                // The rest of the place is untouched.
                let place_end = 1024 * k + 2 * ch;
                assert!(slot[p.range().end..place_end].iter().all(|&b| b == 0xa5));
            }
            let units = c.units(&meta);
            assert_eq!(units.len(), h.div_ceil(1024));
            for (u, unit) in units.iter().enumerate() {
                assert_eq!(
                    unit.pieces[..],
                    pieces[2 * u..(2 * u + 2).min(pieces.len())]
                );
                assert_eq!(unit.metas.start, 32 * u as u64);
                assert_eq!(
                    unit.metas.end,
                    (32 * (u as u64 + 1)).min(4 * (h as u64 / 128))
                );
            }
            let want = logfmt::decode_row(&msg, h).unwrap();
            let got = c.decode(&metas, &slot).unwrap();
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
            for p in &pieces {
                slot[p.range().end..(p.at as usize + 1024).min(2 * h)].fill(0xee);
            }
            let again = c.decode(&metas, &slot).unwrap();
            assert!(
                again
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
            );
        }
        assert!(SlotCodec::new(200).is_err());
    }
}
