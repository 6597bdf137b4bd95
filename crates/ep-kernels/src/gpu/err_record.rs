//! The kinds of the device's error record (`ep_err_block`, written by `ep_fail`) that both
//! groups decode alike: a bounded wait that ran out, and an expert id out of range. Which word
//! a wait awaited and who writes it depends on the mode, so the caller names it.

use std::time::Duration;

use super::abi::ErrBlock;
use crate::error::Error;

impl ErrBlock {
    /// `EP_ERR_TIMEOUT`: rank `rank`'s block `block` of `kernel` waited `timeout` for `word`
    /// (written by `writer`) to reach `expected`, and last read `last_seen`.
    pub(crate) fn wait_timeout(
        &self,
        kernel: &'static str,
        word: String,
        writer: Option<usize>,
        timeout: Duration,
    ) -> Error {
        Error::DeviceWaitTimeout {
            rank: self.rank as usize,
            kernel,
            block: self.block as usize,
            word,
            writer,
            expected: self.expected,
            last_seen: self.last_seen,
            timeout,
        }
    }

    /// `EP_ERR_EXPERT`: rank `rank`'s top-k element `detail` holds the id `last_seen`.
    pub(crate) fn expert_out_of_range(&self) -> Error {
        Error::ExpertOutOfRange {
            rank: self.rank as usize,
            index: self.detail,
            expert: self.last_seen as i64,
        }
    }
}
