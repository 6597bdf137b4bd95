//! Seeded, portable workload generation (ChaCha8): a seed means the same routing everywhere.
