//! # ibgda-sys
//!
//! Raw bindings to rdma-core (`libibverbs.so.1`, `libmlx5.so.1`) and GDRCopy (`libgdrapi.so.2`),
//! loaded at run time with libloading: listing devices, port state and link layer, GID table,
//! mlx5 DevX capability, GPU memory registration probes (peer memory or dma-buf), opening
//! GDRCopy. Building needs no system library; a missing library is an
//! [`Error::LibraryNotFound`] listing every place searched ([`search`]).
//!
//! The bindings in [`generated`] are produced offline by `gen/generate.sh` (bindgen; input
//! versions in each file's header) and checked in; `generate.sh --check` verifies them.
//!
//! Two layers: the loaded libraries ([`IbVerbs`], [`Mlx5Dv`], [`GdrApi`]) with thin `unsafe`
//! wrappers over raw pointers, and safe owning handles over them, rust-ibverbs style
//! ([`Device`], [`Context`], [`ProtectionDomain`], [`GdrHandle`]): opened by a constructor,
//! closed on drop in dependency order (each borrows its parent), `as_raw()` as the escape hatch,
//! a failure in drop recorded on the library (`take_drop_error`).
//!
//! ```no_run
//! let verbs = ibgda_sys::IbVerbs::load(None)?;
//! let devices = verbs.get_device_list()?;
//! for dev in devices.iter() {
//!     let ctx = dev.open()?; // closed at the end of the iteration
//!     let port = ctx.query_port(1)?;
//!     println!("{}: state {} link layer {}", dev.name(), port.state, port.link_layer);
//! }
//! # Ok::<(), ibgda_sys::Error>(())
//! ```

mod error;
mod gdrcopy;
pub mod generated;
mod handle;
mod loader;
mod mlx5;
pub mod search;
mod verbs;

pub use error::{Error, Result};
pub use gdrcopy::GdrApi;
pub use generated::gdr::{gdr, gdr_mh_t, gdr_t};
pub use generated::rdma_types::*;
pub use handle::{Context, Device, GdrHandle, ProtectionDomain};
pub use mlx5::{MLX5_CMD_OP_QUERY_HCA_CAP, Mlx5Dv};
pub use verbs::{DeviceList, IbVerbs};

const _: () = assert!(size_of::<ibv_port_attr>() == 52);
const _: () = assert!(std::mem::offset_of!(ibv_port_attr, link_layer) == 46);
const _: () = assert!(std::mem::offset_of!(ibv_port_attr, gid_tbl_len) == 12);
const _: () = assert!(size_of::<ibv_device_attr>() == 232);
const _: () = assert!(size_of::<ibv_gid>() == 16);
const _: () = assert!(size_of::<ibv_gid_entry>() == 32);
const _: () = assert!(size_of::<ibv_mr>() == 48);
const _: () = assert!(std::mem::offset_of!(ibv_mr, lkey) == 36);
const _: () = assert!(size_of::<mlx5dv_context_attr>() == 16);
const _: () = assert!(size_of::<gdr_mh_t>() == 8);
