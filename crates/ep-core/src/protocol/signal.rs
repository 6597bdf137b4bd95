//! Signal encodings (docs/protocol.md §1.1): every signal word carries the call it belongs to, so
//! stale values never satisfy a wait and no word is reset between calls.
//!
//! Bit layout of a counted word (u64, little-endian): bits 63..32 = call number (epoch), bits
//! 31..0 = a count — the low-latency signals (messages) and normal mode's `head` words (tokens
//! to a rank). The other normal-mode words hold the call number itself. Mirrored by
//! `crates/ep-kernels/include/ep_protocol.cuh`.

use crate::error::{Error, Result};
use crate::transport::{Cmp, SymAddr, WaitUntil};

/// Normal-mode epoch word value of call `call`.
#[must_use]
pub const fn epoch_word(call: u64) -> u64 {
    call
}

/// A counted word: `(call << 32) | count`. `count` must fit in 32 bits; `call` in 32 bits (a
/// `Buffer` makes fewer than 2^32 calls).
#[must_use]
pub const fn counted(call: u64, count: u32) -> u64 {
    (call << 32) | count as u64
}

/// Low-latency signal value: the counted word of `count` messages (at most `N <= 1024`).
#[must_use]
pub const fn ll_encode(call: u64, count: u32) -> u64 {
    counted(call, count)
}

/// The smallest value a waiter of call `call` accepts: `call << 32` (`>=`), since any value of
/// an earlier call is below it.
#[must_use]
pub const fn ll_threshold(call: u64) -> u64 {
    call << 32
}

/// The call number (epoch) of a low-latency signal value.
#[must_use]
pub const fn ll_epoch(value: u64) -> u64 {
    value >> 32
}

/// The message count of a low-latency signal value.
#[must_use]
pub const fn ll_count(value: u64) -> u32 {
    (value & 0xffff_ffff) as u32
}

/// Whether `value` is the signal of exactly call `call`.
#[must_use]
pub const fn ll_is_call(value: u64, call: u64) -> bool {
    ll_epoch(value) == call
}

/// The wait for a counted word of call `call` (`word` in `rank`'s memory): `>= call << 32`,
/// which no earlier call's value satisfies. Its value goes through [`counted_value`].
pub(crate) fn counted_until(rank: usize, word: SymAddr, call: u64, what: String) -> WaitUntil {
    WaitUntil {
        rank,
        word,
        cmp: Cmp::Ge,
        value: ll_threshold(call),
        what,
    }
}

/// The count of `v`, the value a [`counted_until`] wait of call `call` returned; a later call's
/// word is [`Error::SignalEpochMismatch`].
pub(crate) fn counted_value(until: &WaitUntil, call: u64, v: u64) -> Result<u32> {
    if ll_epoch(v) != call {
        return Err(Error::SignalEpochMismatch {
            rank: until.rank,
            word: until.word.0,
            call,
            found: ll_epoch(v),
        });
    }
    Ok(ll_count(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_values_stay_below_the_threshold() {
        for call in 1..50u64 {
            for c in [0u32, 1, 1024, u32::MAX] {
                let v = ll_encode(call, c);
                assert!(v >= ll_threshold(call));
                assert!(v < ll_threshold(call + 1));
                assert_eq!((ll_epoch(v), ll_count(v)), (call, c));
                assert!(ll_is_call(v, call) && !ll_is_call(v, call + 1));
            }
        }
    }
}
