//! One entry of a port's GID table: read from sysfs by [`crate::gather`] ([`crate::PortFacts`])
//! and from rdma-core by the caller ([`crate::VerbsPort`]). Its own module so that the sysfs facts
//! and the live facts both depend on it and not on each other.

use serde::{Deserialize, Serialize};

/// One GID table entry.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GidEntry {
    /// Index in the GID table.
    pub index: u32,
    /// The GID as sysfs prints it.
    pub gid: String,
    /// `gid_attrs/types/N`: `IB/RoCE v1` or `RoCE v2`.
    pub kind: Option<String>,
    /// `gid_attrs/ndevs/N`: the netdev carrying it.
    pub ndev: Option<String>,
}

impl GidEntry {
    /// `0000:0000:0000:0000:0000:ffff:xxxx:xxxx` (an IPv4 address).
    pub fn is_ipv4_mapped(&self) -> bool {
        self.gid.starts_with("0000:0000:0000:0000:0000:ffff:")
    }
}
