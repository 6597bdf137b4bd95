//! Per-rank statistics of an [`LlGroup`](super::LlGroup): DeepEP's cumulative received tokens per
//! local expert and wait times.

use super::LlGroup;
use super::types::LlStats;
use crate::error::Result;

impl LlGroup {
    /// Per-rank statistics since the last [`LlGroup::clear_stats`] (synchronises).
    pub fn stats(&mut self) -> Result<Vec<LlStats>> {
        self.not_capturing("stats")?;
        self.sync()?;
        self.ranks
            .iter()
            .map(|r| {
                let mut recv = vec![0u8; r.recv_stats.len()];
                r.recv_stats.read(0, &mut recv)?;
                let mut wait = vec![0u8; r.wait_stats.len()];
                r.wait_stats.read(0, &mut wait)?;
                Ok(LlStats {
                    local_expert_recv: recv
                        .chunks_exact(4)
                        .map(|c| i32::from_le_bytes(c.try_into().unwrap_or_default()))
                        .collect(),
                    wait_ns: wait
                        .chunks_exact(8)
                        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
                        .collect(),
                })
            })
            .collect()
    }

    /// Zeroes the statistics.
    pub fn clear_stats(&mut self) -> Result<()> {
        self.not_capturing("clear_stats")?;
        for r in &self.ranks {
            r.recv_stats
                .memset_async(&r.stream, 0, 0, r.recv_stats.len())?;
            r.wait_stats
                .memset_async(&r.stream, 0, 0, r.wait_stats.len())?;
        }
        self.sync_streams()
    }
}
