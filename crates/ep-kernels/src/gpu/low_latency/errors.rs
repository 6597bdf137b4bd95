//! The device's error record as a typed error for an [`LlGroup`](super::LlGroup): which rank,
//! kernel and signal word, and its writer.

use super::LlGroup;
use crate::error::Error;
use crate::gpu::abi::{self, ErrBlock};

impl LlGroup {
    pub(super) fn decode(&self, e: &ErrBlock) -> Error {
        let kernel = match e.kernel {
            abi::EP_KERNEL_LL_DISPATCH => "low-latency dispatch",
            abi::EP_KERNEL_LL_COMBINE => "low-latency combine",
            _ => "?",
        };
        let word = |off: u64| signal_name(self.num_ranks() as u64, off);
        match e.status {
            abi::EP_ERR_TIMEOUT => {
                let (name, writer) = word(e.word_offset);
                e.wait_timeout(kernel, name, writer, self.timeout)
            }
            abi::EP_ERR_EXPERT => e.expert_out_of_range(),
            abi::EP_ERR_EPOCH | abi::EP_ERR_COUNT => Error::Unsupported(format!(
                "rank {} ({kernel}): signal {} from rank {} holds {:#x}, expected {} {:#x}: \
                 the ranks' calls are out of step (a rank skipped or repeated a call); reset() every rank",
                e.rank,
                word(e.word_offset).0,
                e.detail,
                e.last_seen,
                if e.status == abi::EP_ERR_EPOCH {
                    "epoch of"
                } else {
                    "count"
                },
                e.expected
            )),
            s => Error::Unsupported(format!("unknown device error status {s}")),
        }
    }
}

/// The name of the signal word at `off` in `ll.signals` and the rank that writes it.
fn signal_name(r: u64, off: u64) -> (String, Option<usize>) {
    match ep_core::protocol::layout::ll_signal_of(r as usize, off) {
        Some((combine, half, w, b)) => {
            let name = if combine { "comb_sig" } else { "disp_sig" };
            (format!("{name}[{half}][{w}][{b}]"), Some(w))
        }
        None => (format!("ll.signals+{off}"), None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signal_words_are_named_with_their_writer() {
        use ep_core::protocol::layout::{ll_combine_signal, ll_dispatch_signal, ll_signal_bytes};
        let r = 4usize;
        let name = |off| signal_name(r as u64, off);
        for (off, want, writer) in [
            (ll_dispatch_signal(r, 0, 0, 0), "disp_sig[0][0][0]", 0),
            (ll_dispatch_signal(r, 0, 3, 7), "disp_sig[0][3][7]", 3),
            (ll_dispatch_signal(r, 1, 1, 63), "disp_sig[1][1][63]", 1),
            (ll_combine_signal(r, 0, 1, 0), "comb_sig[0][1][0]", 1),
            (ll_combine_signal(r, 1, 3, 9), "comb_sig[1][3][9]", 3),
        ] {
            assert_eq!(name(off), (want.into(), Some(writer)));
        }
        assert_eq!(name(ll_signal_bytes(r)).1, None);
    }
}
