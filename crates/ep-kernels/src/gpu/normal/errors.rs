//! The device's error record as a typed error (docs/protocol.md §7): which rank, kernel and
//! control word, and whether the group is poisoned.

use std::time::Duration;

use ep_core::protocol::layout::NormalCtrl;

use super::NormalGroup;
use crate::error::{Error, Result};
use crate::gpu::abi::{self, ErrBlock};

impl NormalGroup {
    /// Turns the process's error record into a typed error (after syncing every stream).
    /// Timeouts and layouts that disagree with their membership (rows stored at wrong places)
    /// poison the group; refused inputs (capacity, expert ids) do not: the record is cleared and
    /// the group stays usable.
    pub(super) fn check_device_error(&mut self) -> Result<()> {
        let e = self.dev.err.read();
        if e.status == 0 {
            return Ok(());
        }
        self.sync_streams()?;
        let e = self.dev.err.read();
        let err = self.decode(&e);
        if matches!(e.status, abi::EP_ERR_TIMEOUT | abi::EP_ERR_LAYOUT) {
            self.poison = Some(err.to_string());
        } else {
            self.dev.err.write(ErrBlock::default());
        }
        Err(err)
    }

    fn decode(&self, e: &ErrBlock) -> Error {
        decode_record(e, self.num_ranks(), self.timeout)
    }
}

/// The typed error of a process's error record (`R` ranks, waits bounded by `timeout`).
fn decode_record(e: &ErrBlock, num_ranks: usize, timeout: Duration) -> Error {
    let kernel = match e.kernel {
        abi::EP_KERNEL_DISPATCH => "dispatch",
        abi::EP_KERNEL_COMBINE => "combine",
        abi::EP_KERNEL_LAYOUT => "layout",
        _ => "?",
    };
    match e.status {
        abi::EP_ERR_TIMEOUT => {
            let ctrl = NormalCtrl { num_ranks };
            e.wait_timeout(
                kernel,
                ctrl_word_name(ctrl, e.word_offset),
                ctrl.writer(e.word_offset, e.word_rank as usize),
                timeout,
            )
        }
        abi::EP_ERR_CAPACITY => Error::DeviceCapacity {
            rank: e.word_rank as usize,
            rows: e.last_seen,
            capacity: e.expected,
        },
        abi::EP_ERR_EXPERT => e.expert_out_of_range(),
        abi::EP_ERR_LAYOUT => Error::DeviceLayoutMismatch {
            rank: e.rank as usize,
            dest: e.detail as usize,
            given: e.expected as i64,
            counted: e.last_seen as i64,
        },
        s => Error::Unsupported(format!("unknown device error status {s}")),
    }
}

/// `notify[p][s]`, `head[p][s][e]`, `done[s][c]`, ... for a control-word offset.
fn ctrl_word_name(ctrl: NormalCtrl, off: u64) -> String {
    let r = ctrl.num_ranks;
    for s in 0..r {
        for p in 0..2 {
            if ctrl.notify(p, s) == off {
                return format!("notify[{p}][{s}]");
            }
            for e in 0..r {
                if ctrl.head(p, s, e) == off {
                    return format!("head[{p}][{s}][{e}]");
                }
            }
        }
        if ctrl.ready(s) == off {
            return format!("ready[{s}]");
        }
        if ctrl.y_ready(s) == off {
            return format!("y_ready[{s}]");
        }
        for c in 0..ep_core::protocol::layout::MAX_CHANNELS {
            for h in 0..2 {
                if ctrl.done(s, c, h) == off {
                    return format!("done[{s}][{c}][{h}]");
                }
            }
            if ctrl.pulled(s, c) == off {
                return format!("pulled[{s}][{c}]");
            }
        }
    }
    for p in 0..2 {
        if ctrl.table_ready(p) == off {
            return format!("table_ready[{p}]");
        }
    }
    format!("control word at offset {off}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_control_word_is_named_by_its_offset() {
        for r in [1, 2, 8] {
            let ctrl = NormalCtrl { num_ranks: r };
            for s in 0..r {
                assert_eq!(
                    ctrl_word_name(ctrl, ctrl.notify(1, s)),
                    format!("notify[1][{s}]")
                );
                assert_eq!(
                    ctrl_word_name(ctrl, ctrl.head(0, s, r - 1)),
                    format!("head[0][{s}][{}]", r - 1)
                );
                assert_eq!(ctrl_word_name(ctrl, ctrl.ready(s)), format!("ready[{s}]"));
                assert_eq!(
                    ctrl_word_name(ctrl, ctrl.y_ready(s)),
                    format!("y_ready[{s}]")
                );
                assert_eq!(
                    ctrl_word_name(ctrl, ctrl.done(s, 5, 1)),
                    format!("done[{s}][5][1]")
                );
                assert_eq!(
                    ctrl_word_name(ctrl, ctrl.pulled(s, 63)),
                    format!("pulled[{s}][63]")
                );
            }
            assert_eq!(ctrl_word_name(ctrl, ctrl.table_ready(0)), "table_ready[0]");
            assert!(ctrl_word_name(ctrl, ctrl.bytes() + 16).starts_with("control word at"));
        }
    }

    /// The notify block's record of a layout that disagrees with its membership (EP_ERR_LAYOUT)
    /// is a typed error naming both ranks and both counts.
    #[test]
    fn a_layout_record_is_a_typed_error() {
        let e = ErrBlock {
            status: abi::EP_ERR_LAYOUT,
            rank: 1,
            kernel: abi::EP_KERNEL_DISPATCH,
            word_rank: 3,
            expected: 17,
            last_seen: 19,
            detail: 3,
            ..ErrBlock::default()
        };
        let err = decode_record(&e, 4, Duration::from_secs(1));
        assert!(
            matches!(
                err,
                Error::DeviceLayoutMismatch {
                    rank: 1,
                    dest: 3,
                    given: 17,
                    counted: 19
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("poisoned until reset"), "{err}");
    }

    /// A dispatch CTA that timed out on a `head` word names the word and its writer, the rank
    /// whose counts it waited for.
    #[test]
    fn a_head_word_timeout_names_the_word_and_its_writer() {
        let ctrl = NormalCtrl { num_ranks: 4 };
        let e = ErrBlock {
            status: abi::EP_ERR_TIMEOUT,
            rank: 2,
            kernel: abi::EP_KERNEL_DISPATCH,
            block: 4,
            word_rank: 3,
            word_offset: ctrl.head(1, 3, 0),
            expected: 9 << 32,
            last_seen: 7 << 32,
            ..ErrBlock::default()
        };
        let err = decode_record(&e, 4, Duration::from_secs(1));
        match &err {
            Error::DeviceWaitTimeout {
                rank: 2,
                block: 4,
                word,
                writer: Some(3),
                ..
            } => assert_eq!(word, "head[1][3][0]", "{err}"),
            other => panic!("not the head word's timeout: {other}"),
        }
    }
}
