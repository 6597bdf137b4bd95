//! Setup checks behind `ep doctor`: driver keys, GDRCopy, NVSHMEM, NICs, GPUs, limits; every
//! check reads its files under a sysroot so verdicts are testable from fixture trees.
