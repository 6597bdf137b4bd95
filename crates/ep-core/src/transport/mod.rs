//! The `Transport` trait: the host face (collective allocation, reachability, QPs, phases) and
//! the protocol vocabulary both backends implement (`DESIGN.md`, "One logic, two executors").
//!
//! - [`types`]: heap addresses, agents, QPs, reachability, fabric parameters, wait conditions;
//! - [`vocab`]: [`AgentCtx`], the per-agent protocol vocabulary with its ordering and visibility
//!   promises (the memory model);
//! - [`host`]: [`Transport`], the host face, and [`Phase`], what it executes;
//! - [`fault`]: the typed errors faults end in, and what the layer above does with them;
//! - [`violation`]: [`Violation`], a checker's typed finding of a broken rule;
//! - [`device_trace`]: the events a GPU block records in debug builds, for the checker.

pub mod device_trace;
pub mod fault;
pub mod host;
pub mod types;
pub mod violation;
pub mod vocab;

pub use device_trace::{AgentEvents, DeviceEvent, FenceScope, TraceRegion};
pub use fault::{fault_rank, is_fault};
pub use host::{AgentBody, AgentSpec, Phase, PhaseKind, PhaseReport, RingDecl, Transport};
pub use types::{
    AgentId, AllocRequest, Cmp, FabricParams, Init, QpFullPolicy, QpIndex, Reach, Region, SignalOp,
    SymAddr, SymAlloc, Team, WaitUntil, chunk_pieces,
};
pub use violation::{AgentRef, Violation, Waiting};
pub use vocab::AgentCtx;
