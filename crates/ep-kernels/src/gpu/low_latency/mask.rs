//! Shrink mode on an [`LlGroup`](super::LlGroup) (docs/protocol.md §3.8, §7.3): the rank mask,
//! set by the host or by a receive part whose wait ran out.

use super::LlGroup;
use crate::error::{Error, Result};

impl LlGroup {
    /// Shrink mode (DeepEP's `enable_shrink`, spec §2.7, docs/protocol.md §3.8): a source whose
    /// signal never comes within the timeout is masked by the rank that waited for it (its
    /// messages count as none, exactly as a masked rank's) instead of failing the call; the next
    /// [`LlGroup::sync`] adopts every rank's device mask for the group ([`LlGroup::query_mask`]),
    /// and later calls skip the rank. Off by default: a missing rank is then a typed
    /// [`Error::DeviceWaitTimeout`].
    pub fn set_shrink(&mut self, on: bool) {
        self.shrink = on;
    }

    /// The ranks the kernels masked on their own (shrink mode), merged into the group's mask.
    pub(super) fn adopt_device_masks(&mut self) -> Result<()> {
        let r = self.num_ranks();
        let mut changed = false;
        for k in &self.ranks {
            let mut bytes = vec![0u8; 4 * r];
            k.mask.read(0, &mut bytes)?;
            for (m, w) in self.mask.iter_mut().zip(bytes.chunks_exact(4)) {
                if !*m && w != [0, 0, 0, 0] {
                    *m = true;
                    changed = true;
                }
            }
        }
        if changed {
            self.write_mask()?;
        }
        Ok(())
    }

    /// `low_latency_update_mask_buffer(rank, mask)`: masks (or unmasks) `rank` for the
    /// following calls of every rank (spec §2.7).
    pub fn update_mask(&mut self, rank: usize, masked: bool) -> Result<()> {
        self.not_capturing("update_mask")?;
        if rank >= self.num_ranks() {
            return Err(Error::RankOutOfRange {
                rank,
                num_ranks: self.num_ranks(),
            });
        }
        self.mask[rank] = masked;
        self.write_mask()
    }

    /// `low_latency_query_mask_buffer`: which ranks are masked.
    pub fn query_mask(&self) -> Vec<bool> {
        self.mask.clone()
    }

    /// Sets the mask to `mask` (one entry per rank) when it differs (a `Buffer`'s operation
    /// carries its mask; the device words follow it).
    pub(crate) fn set_mask(&mut self, mask: &[bool]) -> Result<()> {
        self.not_capturing("set_mask")?;
        if mask.len() != self.num_ranks() {
            return Err(Error::RankCountMismatch {
                expected: self.num_ranks(),
                found: mask.len(),
            });
        }
        if self.mask == mask {
            return Ok(());
        }
        self.mask = mask.to_vec();
        self.write_mask()
    }

    /// `low_latency_clean_mask_buffer`: unmasks every rank.
    pub fn clean_mask(&mut self) -> Result<()> {
        self.not_capturing("clean_mask")?;
        self.mask.iter_mut().for_each(|m| *m = false);
        self.write_mask()
    }

    pub(super) fn write_mask(&mut self) -> Result<()> {
        self.sync_streams()?;
        let bytes: Vec<u8> = self
            .mask
            .iter()
            .flat_map(|&m| i32::from(m).to_le_bytes())
            .collect();
        for r in &self.ranks {
            r.mask.write(0, &bytes)?;
        }
        // A masked rank's kernels are not launched, so its epoch words fell behind: every mask
        // change sets them to the counter (the streams are idle), and a graph replays only
        // under the mask it was captured with (docs/protocol.md §3.10).
        self.write_epochs()
    }
}
