//! Configuration: DeepEP's `Config` and size hints (spec §1.4, §1.5, §1.9), `BufferConfig`
//! (spec §1.1) with validation, and the NVSHMEM environment plan (spec §1.2).
