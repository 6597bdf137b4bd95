//! # ibgda-sys
//!
//! Raw bindings to rdma-core (`libibverbs.so.1`, `libmlx5.so.1`) and GDRCopy (`libgdrapi.so.2`),
//! loaded at run time with libloading: listing devices, port state and link layer, GID table,
//! mlx5 DevX capability, GPU memory registration probes, opening GDRCopy. Building needs no
//! system library; a missing library is an `Err`.
