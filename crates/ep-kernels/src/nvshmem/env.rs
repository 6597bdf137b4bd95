//! Applying the NVSHMEM environment plan (spec §1.2 step 2) before NVSHMEM initialises.
//!
//! NVSHMEM reads its variables once, during init, from the process environment. Setting them
//! from a thread while another thread reads the environment is undefined behaviour in glibc, so
//! the plan is applied where no other thread exists: in the environment of each rank process
//! when it is spawned ([`apply_to_command`]). [`set_in_process`] exists for single-threaded
//! launch code and is `unsafe` with that contract.
//!
//! Variables the user already set are respected (never overwritten) and reported.

use std::ffi::OsStr;
use std::process::Command;

/// One variable of the plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvEntry {
    /// Variable name, e.g. `NVSHMEM_QP_DEPTH`.
    pub var: String,
    /// Value the plan wants.
    pub value: String,
    /// Why (spec §1.2's stated reason), for the report.
    pub reason: String,
    /// The plan took this value from the user's environment.
    pub user_set: bool,
}

impl EnvEntry {
    /// A planned entry with a reason.
    pub fn new(
        var: impl Into<String>,
        value: impl Into<String>,
        reason: impl Into<String>,
    ) -> Self {
        Self {
            var: var.into(),
            value: value.into(),
            reason: reason.into(),
            user_set: false,
        }
    }
}

/// The entries of ep-core's plan (`ep_core::config::nvshmem_env_plan`): a user-set entry
/// carries the user's value, so a rank started from another environment still sees it.
pub fn from_plan(plan: &ep_core::config::EnvPlan) -> Vec<EnvEntry> {
    plan.entries
        .iter()
        .map(|e| EnvEntry {
            var: e.name.to_string(),
            value: e.effective().to_string(),
            reason: e.reason.to_string(),
            user_set: e.is_user_set(),
        })
        .collect()
}

/// Plain `(var, value)` pairs become entries without a reason.
pub fn from_pairs<K: AsRef<str>, V: AsRef<str>>(pairs: &[(K, V)]) -> Vec<EnvEntry> {
    pairs
        .iter()
        .map(|(k, v)| EnvEntry::new(k.as_ref(), v.as_ref(), ""))
        .collect()
}

/// Where the value a rank sees came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The plan set it.
    Plan,
    /// The user had set it; kept (it may differ from the plan's value).
    User,
}

/// A variable as applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied {
    /// Variable name.
    pub var: String,
    /// Value the rank sees.
    pub value: String,
    /// Value the plan wanted.
    pub planned: String,
    /// Who decided.
    pub source: Source,
    /// The variable was absent and is set by the apply step (false: already present, kept).
    pub set_here: bool,
}

/// Resolves the plan against an environment lookup: user values win.
pub fn resolve(plan: &[EnvEntry], lookup: impl Fn(&str) -> Option<String>) -> Vec<Applied> {
    plan.iter()
        .map(|e| match lookup(&e.var) {
            Some(user) => Applied {
                var: e.var.clone(),
                value: user,
                planned: e.value.clone(),
                source: Source::User,
                set_here: false,
            },
            None => Applied {
                var: e.var.clone(),
                value: e.value.clone(),
                planned: e.value.clone(),
                source: if e.user_set {
                    Source::User
                } else {
                    Source::Plan
                },
                set_here: true,
            },
        })
        .collect()
}

/// Sets the plan in the environment of a rank process about to be spawned, keeping what the
/// parent's environment (or the command's own `env` calls) already set.
pub fn apply_to_command(cmd: &mut Command, plan: &[EnvEntry]) -> Vec<Applied> {
    let explicit: Vec<(String, Option<String>)> = cmd
        .get_envs()
        .map(|(k, v)| {
            (
                k.to_string_lossy().into_owned(),
                v.map(|v| v.to_string_lossy().into_owned()),
            )
        })
        .collect();
    let applied = resolve(plan, |var| match explicit.iter().find(|(k, _)| k == var) {
        Some((_, v)) => v.clone(),
        None => std::env::var(var).ok(),
    });
    for a in applied.iter().filter(|a| a.set_here) {
        cmd.env(&a.var, &a.value);
    }
    applied
}

/// Sets the plan in this process's environment, keeping variables already set.
///
/// # Safety
/// No other thread of this process may read or write the environment while this runs, nor
/// between it and NVSHMEM's init (glibc's `setenv` is not thread-safe); in practice call it at
/// the start of `main`, before any thread (CUDA's included) is created.
pub unsafe fn set_in_process(plan: &[EnvEntry]) -> Vec<Applied> {
    let applied = resolve(plan, |var| std::env::var(var).ok());
    for a in applied.iter().filter(|a| a.set_here) {
        // SAFETY: the caller guarantees no concurrent environment access (contract above).
        unsafe { std::env::set_var(&a.var, &a.value) };
    }
    applied
}

/// The `NVSHMEM_*` variables of this process, sorted (read-only).
pub fn nvshmem_vars() -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = std::env::vars_os()
        .filter(|(k, _)| k.to_string_lossy().starts_with("NVSHMEM_"))
        .map(|(k, v)| {
            (
                k.to_string_lossy().into_owned(),
                v.to_string_lossy().into_owned(),
            )
        })
        .collect();
    v.sort();
    v
}

/// Reads one variable without allocating a lookup closure.
pub(crate) fn var(name: impl AsRef<OsStr>) -> Option<String> {
    std::env::var(name).ok().filter(|s| !s.is_empty())
}
