//! Vector clocks over agents and RDMA streams.
//!
//! A clock key is either an agent slot `(rank, index)` (its own epoch advances at every release
//! point) or an RDMA stream `(rank, index, target, qp)` (its value is the sequence number of the
//! last work request of that stream known to be delivered). Streams are delivered in order
//! (DESIGN.md: one agent, one peer, one QP), so knowing sequence `n` means knowing every work
//! request of the stream up to `n`.

use std::collections::BTreeMap;

/// The key reserved for the host and initial memory: always visible.
pub(crate) const HOST_KEY: u32 = 0;

/// What a clock key stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum KeyDesc {
    /// The host (key 0).
    Host,
    /// Agent slot `index` on `rank` (reused across phases; its epochs keep increasing).
    Agent { rank: usize, index: usize },
    /// Work requests posted by agent slot `(rank, index)` to `target` on `qp`.
    Stream {
        rank: usize,
        index: usize,
        target: usize,
        qp: u16,
    },
}

/// Interns clock keys.
#[derive(Debug, Default)]
pub(crate) struct Keys {
    descs: Vec<KeyDesc>,
    ids: BTreeMap<KeyDesc, u32>,
}

impl Keys {
    pub(crate) fn new() -> Keys {
        let mut k = Keys::default();
        k.id(KeyDesc::Host);
        k
    }
    /// The id of `d`, interning it on first use.
    pub(crate) fn id(&mut self, d: KeyDesc) -> u32 {
        if let Some(&i) = self.ids.get(&d) {
            return i;
        }
        let i = self.descs.len() as u32;
        self.descs.push(d);
        self.ids.insert(d, i);
        i
    }
    pub(crate) fn desc(&self, id: u32) -> KeyDesc {
        self.descs[id as usize]
    }
}

/// A sparse vector clock: key → value, missing keys are 0.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct VClock(BTreeMap<u32, u64>);

impl VClock {
    pub(crate) fn get(&self, k: u32) -> u64 {
        if k == HOST_KEY {
            u64::MAX
        } else {
            self.0.get(&k).copied().unwrap_or(0)
        }
    }
    pub(crate) fn set(&mut self, k: u32, v: u64) {
        self.0.insert(k, v);
    }
    /// Raises `k` to at least `v`.
    pub(crate) fn raise(&mut self, k: u32, v: u64) {
        let e = self.0.entry(k).or_insert(0);
        if *e < v {
            *e = v;
        }
    }
    /// Pointwise maximum.
    pub(crate) fn join(&mut self, o: &VClock) {
        for (&k, &v) in &o.0 {
            self.raise(k, v);
        }
    }
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.0.iter().map(|(&k, &v)| (k, v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn join_is_pointwise_max_and_host_always_known() {
        let mut a = VClock::default();
        a.set(1, 3);
        a.set(2, 1);
        let mut b = VClock::default();
        b.set(2, 5);
        b.set(3, 1);
        a.join(&b);
        assert_eq!((a.get(1), a.get(2), a.get(3), a.get(4)), (3, 5, 1, 0));
        assert_eq!(a.get(HOST_KEY), u64::MAX);
    }
}
