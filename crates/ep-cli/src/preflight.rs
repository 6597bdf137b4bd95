//! Checks that run before any work, so that a run that cannot succeed fails at once, typed, and
//! says what to change: the shape against the protocol's limits (usage errors), what the run
//! will need in memory, address space and disk against what this machine has, and whether the
//! output paths can be written.
//!
//! The estimate ([`Need::estimate`]) counts the large structures a run holds at its peak: the
//! inputs, the received rows (in the simulator's arena), the outputs and references, the expert
//! outputs and, with `--dump`, the copies the dump makes. It is a model, not a measurement: it
//! aims to be within a small factor of the peak resident set, so that a shape whose memory
//! cannot exist is refused before a byte of it is allocated, and a run that fits is never
//! refused (a run needing less than [`HEADROOM`] of what is available passes).

use std::path::Path;

use ep_core::config::{BufferConfig, Config, LowLatencyCall, NormalCall, NvshmemResources};
use ep_core::plan::low_latency::FRESH_MAPPING_BYTES;
use ep_core::protocol::layout::{MAX_CHANNELS, MAX_LOCAL_EXPERTS};

use crate::workload::{CastError, Defaults, LlCast, Mode, Workload, WorkloadArgs, ll_params};

/// Share of the available memory a run may plan to use (the estimate is a model; the rest is
/// left for what it does not count and for the other processes of the machine).
pub const HEADROOM: f64 = 0.85;

/// Smallest NVSHMEM symmetric-heap chunk (`NVSHMEM_CUMEM_GRANULARITY`) accepted: the CUDA VMM
/// allocation granularity NVSHMEM maps its heap in (2 MiB on NVIDIA GPUs); the value must be a
/// multiple of it.
pub const MIN_GRANULARITY: u64 = 2 << 20;

/// Why a run is refused before it starts.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PreflightError {
    /// Options that cannot work (a zero size, a shape beyond the protocol's limits).
    #[error("{0}")]
    Usage(String),
    /// `--round-scale` / `--ue8m0` where they cannot apply (a usage error).
    #[error(transparent)]
    Cast(#[from] CastError),
    /// The run would need more memory, address space or disk than this machine has.
    #[error(
        "this run needs about {} of {what} ({}), but {have_text}; {fits}",
        gib(*needed),
        breakdown
    )]
    TooLarge {
        /// `memory`, `address space` or `disk space`.
        what: &'static str,
        /// Bytes needed.
        needed: u64,
        /// Bytes available.
        have: u64,
        /// Where `have` comes from, with the figure.
        have_text: String,
        /// What the need is made of.
        breakdown: String,
        /// A smaller shape that fits, or what to do.
        fits: String,
    },
    /// An output path (`--json`, `--dump`, `--dump-inputs`) cannot be written.
    #[error("{option} {}: {why}; pick a writable path (checked before the run starts)", path.display())]
    Output {
        /// The option.
        option: &'static str,
        /// The path.
        path: std::path::PathBuf,
        /// What is wrong.
        why: String,
    },
}

impl PreflightError {
    /// 2 for usage errors, 3 for the others (the machine or the file system refuses the run).
    #[must_use]
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Usage(_) | Self::Cast(_) => 2,
            _ => 3,
        }
    }
}

fn usage(msg: String) -> PreflightError {
    PreflightError::Usage(msg)
}

/// `bytes` in GiB (or MiB below 1 GiB), for messages.
#[must_use]
pub fn gib(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.0} MiB", (bytes as f64 / (1u64 << 20) as f64).ceil())
    }
}

/// Which command runs the shape (they hold different structures).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    /// `ep bench` on the simulator.
    Bench,
    /// `ep layout` (plan and oracle).
    Layout,
}

/// The shape of a run, as the estimate and the limits need it.
#[derive(Clone, Debug, PartialEq)]
pub struct Shape {
    /// The mode.
    pub mode: Mode,
    /// Ranks `R`.
    pub ranks: usize,
    /// Tokens per rank `T` (the largest, for inputs read from files).
    pub tokens: usize,
    /// Hidden size `H`.
    pub hidden: usize,
    /// Top-k `K`.
    pub topk: usize,
    /// Experts `E`.
    pub experts: usize,
    /// FP8 dispatch.
    pub fp8: bool,
    /// Low-latency FP8 scales rounded to powers of two (`--round-scale`).
    pub round_scale: bool,
    /// Low-latency FP8 scales stored as UE8M0 bytes (`--ue8m0`).
    pub use_ue8m0: bool,
    /// SMs of normal mode.
    pub num_sms: usize,
    /// Rows all ranks receive per normal-mode call (one per (token, destination rank)): exact
    /// when the routing is known, else the expectation under uniform routing.
    pub recv_rows: u64,
}

impl Shape {
    /// The shape of a generated workload, before generating it; `None` with `--inputs` (the
    /// files give the shape: use [`Shape::of_workload`] once they are read).
    #[must_use]
    pub fn of_args(args: &WorkloadArgs, defaults: &Defaults) -> Option<Shape> {
        if args.inputs.is_some() {
            return None;
        }
        let ll = args.mode == Mode::LowLatency;
        let ranks = args.ranks.unwrap_or(8);
        let tokens = args.tokens.unwrap_or(if ll { 128 } else { 4096 });
        let experts = args.experts.unwrap_or(if ll { 288 } else { 256 });
        let topk = args.topk.unwrap_or(8);
        Some(Shape {
            mode: args.mode,
            ranks,
            tokens,
            hidden: args.hidden.unwrap_or(defaults.hidden),
            topk,
            experts,
            fp8: args.fp8(defaults, args.fp8),
            round_scale: args.round_scale,
            use_ue8m0: args.use_ue8m0,
            num_sms: args.num_sms,
            recv_rows: expected_recv_rows(ranks, tokens, topk, experts),
        })
    }

    /// The shape of a loaded workload (receive rows counted from its routing).
    #[must_use]
    pub fn of_workload(w: &Workload, num_sms: usize) -> Shape {
        let s = &w.summary;
        let r = s.num_ranks.max(1);
        let per_rank = (w.num_experts / r).max(1);
        let mut rows = 0u64;
        let mut seen = Vec::new();
        for i in &w.inputs {
            for t in 0..i.num_tokens() {
                seen.clear();
                seen.extend(
                    i.topk_idx
                        .row(t)
                        .iter()
                        .filter_map(|&x| usize::try_from(x).ok())
                        .map(|x| x / per_rank),
                );
                seen.sort_unstable();
                seen.dedup();
                rows += seen.len() as u64;
            }
        }
        Shape {
            mode: w.mode,
            ranks: s.num_ranks,
            tokens: s.max_tokens(),
            hidden: s.hidden,
            topk: s.topk,
            experts: w.num_experts,
            fp8: w.fp8,
            round_scale: w.round_scale,
            use_ue8m0: w.use_ue8m0,
            num_sms,
            recv_rows: rows,
        }
    }

    fn local_experts(&self) -> usize {
        self.experts / self.ranks.max(1)
    }

    /// The same shape with `tokens` tokens per rank.
    fn with_tokens(&self, tokens: usize) -> Shape {
        Shape {
            tokens,
            recv_rows: expected_recv_rows(self.ranks, tokens, self.topk, self.experts),
            ..self.clone()
        }
    }

    /// Usage checks, first failure returned, each naming the option: sizes at least 1, experts
    /// divisible by ranks, top-k within the experts, then the protocol's own limits
    /// (`BufferConfig::check_normal` / `check_low_latency`, channels, local experts).
    pub fn check_usage(&self) -> Result<(), PreflightError> {
        for (flag, v) in [
            ("--ranks", self.ranks),
            ("--hidden", self.hidden),
            ("--topk", self.topk),
            ("--experts", self.experts),
        ] {
            if v == 0 {
                return Err(usage(format!("{flag} 0: must be at least 1")));
            }
        }
        let (r, e, k) = (self.ranks, self.experts, self.topk);
        if !e.is_multiple_of(r) {
            return Err(usage(format!(
                "--experts {e} is not a multiple of --ranks {r}: every rank holds the same \
                 number of experts (try --experts {})",
                e.div_ceil(r) * r
            )));
        }
        if k > e {
            return Err(usage(format!(
                "--topk {k} exceeds --experts {e}: a token's experts are distinct"
            )));
        }
        let limit = |what: &str, e: ep_core::Error| usage(format!("{what}: {e}"));
        match self.mode {
            Mode::Normal => {
                let mut cfg = BufferConfig::new(r);
                cfg.num_nvl_bytes = 0;
                let config = Config::new(self.num_sms, 8, 256, 6, 128)
                    .map_err(|x| usage(format!("--num-sms {}: {x}", self.num_sms)))?;
                if config.num_channels() > MAX_CHANNELS {
                    return Err(usage(format!(
                        "--num-sms {}: {} channels exceed the protocol's limit of {MAX_CHANNELS} \
                         (use at most {} SMs)",
                        self.num_sms,
                        config.num_channels(),
                        2 * MAX_CHANNELS
                    )));
                }
                let call = NormalCall {
                    config,
                    hidden: self.hidden,
                    elem_bytes: if self.fp8 { 1 } else { 2 },
                    num_topk: k,
                    expert_alignment: 1,
                    combine: false,
                };
                cfg.check_normal(&call).map_err(|x| {
                    let what = format!(
                        "normal mode with --ranks {r} --hidden {} --topk {k} --num-sms {}{}",
                        self.hidden,
                        self.num_sms,
                        if self.fp8 { " --fp8" } else { "" }
                    );
                    limit(&what, x)
                })?;
            }
            Mode::LowLatency => {
                let cast = LlCast {
                    use_fp8: self.fp8,
                    round_scale: self.round_scale,
                    use_ue8m0: self.use_ue8m0,
                };
                let h = self.hidden;
                // FP8 rows are cast 512 channels at a time (and UE8M0 packs four scales to an
                // int32): said here with the fix, before ep-core's generic message.
                if self.fp8 && h.is_multiple_of(128) && !h.is_multiple_of(512) {
                    let flags = cast.flags();
                    let (what, why, bf16) = if flags.is_empty() {
                        (
                            String::new(),
                            "it casts 512 channels per step",
                            " (or --no-fp8: BF16 rows need a multiple of 128)",
                        )
                    } else {
                        (
                            format!(" with{flags}"),
                            if self.use_ue8m0 {
                                "it casts 512 channels per step and packs four UE8M0 scales \
                                 to an int32"
                            } else {
                                "it casts 512 channels per step"
                            },
                            "",
                        )
                    };
                    return Err(usage(format!(
                        "--hidden {h} is not a multiple of 512, which FP8 low-latency dispatch\
                         {what} needs ({why}): use --hidden {}{bf16}",
                        h.div_ceil(512) * 512
                    )));
                }
                let mut cfg = BufferConfig::new(r);
                cfg.low_latency_mode = true;
                cfg.num_qps_per_rank = self.local_experts().max(1) as u32;
                let params = ll_params(
                    cast,
                    &crate::io::InputsSummary {
                        num_ranks: r,
                        tokens: vec![self.tokens],
                        hidden: self.hidden,
                        topk: k,
                        fp8: false,
                    },
                    e,
                );
                let call = LowLatencyCall {
                    num_max_dispatch_tokens_per_rank: params.num_max_dispatch_tokens_per_rank,
                    hidden: self.hidden,
                    num_experts: e,
                    num_topk: k,
                    use_fp8: params.use_fp8,
                    round_scale: params.round_scale,
                    use_ue8m0: params.use_ue8m0,
                };
                // The simulator models full QPs (posts wait), so any QP depth is a legal (slow)
                // fabric; the depth DeepEP requires is not a usage rule here.
                let nvshmem = NvshmemResources {
                    qp_depth: u32::MAX,
                    num_rc_per_pe: cfg.num_qps_per_rank,
                    cumem_granularity: MIN_GRANULARITY,
                    nic_handler: Default::default(),
                };
                cfg.check_low_latency(&call, &nvshmem).map_err(|x| {
                    let what = format!(
                        "low-latency mode with --ranks {r} --tokens {} --hidden {} --topk {k} \
                         --experts {e}{}",
                        self.tokens,
                        self.hidden,
                        if self.fp8 {
                            format!(" (FP8 dispatch){}", cast.flags())
                        } else {
                            " --no-fp8".into()
                        }
                    );
                    limit(&what, x)
                })?;
            }
        }
        if self.local_experts() > MAX_LOCAL_EXPERTS {
            return Err(usage(format!(
                "--experts {e} over --ranks {r}: {} local experts exceed the protocol's limit of \
                 {MAX_LOCAL_EXPERTS}; use more ranks or fewer experts",
                self.local_experts()
            )));
        }
        Ok(())
    }
}

/// Rows received per normal-mode call over all ranks under uniform routing: `R·T` tokens, each
/// reaching `R·(1 − C(E−L, K)/C(E, K))` ranks in expectation (`L = E/R` experts per rank).
fn expected_recv_rows(ranks: usize, tokens: usize, topk: usize, experts: usize) -> u64 {
    let (r, e) = (ranks.max(1), experts.max(1));
    let l = e / r;
    let mut miss = 1.0f64;
    for i in 0..topk.min(e) {
        let num = e.saturating_sub(l + i) as f64;
        miss *= num / (e - i) as f64;
    }
    let per_token = r as f64 * (1.0 - miss.clamp(0.0, 1.0));
    ((r * tokens) as f64 * per_token).ceil() as u64
}

/// What a run needs at its peak.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Need {
    /// Resident memory, by structure.
    pub memory: Vec<(&'static str, u64)>,
    /// Address space reserved beyond the resident memory (zero pages never written).
    pub reserved: u64,
    /// Disk written by `--dump`.
    pub disk: u64,
}

impl Need {
    /// Resident bytes in all.
    #[must_use]
    pub fn memory_total(&self) -> u64 {
        self.memory.iter().map(|(_, b)| b).sum()
    }

    /// The need of `shape` run by `command` (module docs), with `--dump` when `dump`.
    #[must_use]
    pub fn estimate(shape: &Shape, command: Command, dump: bool) -> Need {
        let (r, t, h, k) = (
            shape.ranks as u64,
            shape.tokens as u64,
            shape.hidden as u64,
            shape.topk as u64,
        );
        let x_bytes = if shape.fp8 && shape.mode == Mode::Normal {
            h + 4 * h.div_ceil(128)
        } else {
            2 * h
        };
        // Inputs: activations plus top-k ids (8 bytes) and weights (4 bytes).
        let inputs = r * t * (x_bytes + 12 * k);
        let mut need = Need::default();
        need.memory.push(("process and scratch", BASE));
        need.memory.push(("inputs", inputs));
        match shape.mode {
            Mode::Normal => {
                let rows = shape.recv_rows;
                let record = x_bytes + 12 * k + 16;
                let combined = r * t * (2 * h + 4 * k);
                match command {
                    Command::Bench => {
                        need.memory.push(("received rows (arena)", rows * record));
                        need.memory.push(("combined outputs", combined));
                    }
                    Command::Layout => {
                        // Plan and oracle outputs, the expert rows and both combines.
                        need.memory
                            .push(("dispatch outputs (plan + oracle)", 2 * rows * record));
                        need.memory.push(("expert rows", rows * 2 * h));
                        need.memory
                            .push(("combined outputs (plan + oracle)", 2 * combined));
                    }
                }
                if dump {
                    // recv_x copied out of the arena, and one rank's rows as float32 at a time.
                    need.memory
                        .push(("dump copies", rows * 2 * h + rows * 4 * h / r.max(1)));
                    need.disk = rows * (4 * h + x_bytes + 12 * k + 8) + r * t * (4 * h + 4 * k);
                }
            }
            Mode::LowLatency => {
                let l = shape.local_experts() as u64;
                // N: T raised until R·N is a multiple of 4 (workload::ll_params).
                let mut n = t.max(1);
                while !(r * n).is_multiple_of(4) {
                    n += 1;
                }
                let rn = r * n;
                // Packed [L, R·N, row] arrays per rank, one allocation each
                // (plan::low_latency::packed_zeros_*), x and FP8 scales, and BF16 expert
                // outputs. The bench holds at most two dispatch outputs (the oracle's of both
                // signs; the first becomes the spare every dispatch reuses) and one set of expert
                // outputs (bench::low_latency); layout is given four dispatch outputs and two
                // sets of expert outputs (it holds the plan's and the oracle's of each).
                let (x_copies, y_copies) = match command {
                    Command::Bench => (2, 1),
                    Command::Layout => (4, 2),
                };
                let data_row = if shape.fp8 { h } else { 2 * h };
                let scale_copies = if shape.fp8 { x_copies } else { 0 };
                let arrays = [
                    (x_copies, data_row),
                    (scale_copies, 4 * h.div_ceil(128)),
                    (y_copies, 2 * h),
                ];
                // Rows a rank's arrays get filled with: its share of the selections.
                let filled = t * k;
                let (mut resident, mut mapped) = (0u64, 0u64);
                for (copies, row) in arrays {
                    let bytes = l * rn * row;
                    let count = r * copies;
                    if bytes < FRESH_MAPPING_BYTES as u64 {
                        // Small arrays are zeroed on the heap: resident in full.
                        resident += count * bytes;
                    } else {
                        // A fresh mapping of exactly the array: only filled rows' pages become
                        // resident.
                        let pages = (row.div_ceil(4096) + 1) * 4096;
                        resident += (r * copies * filled * pages).min(count * bytes);
                    }
                    mapped += count * bytes;
                }
                need.memory.push(("packed expert arrays", resident));
                need.reserved = mapped.saturating_sub(resident);
                if command == Command::Bench {
                    // The simulator's arena materialises whole pages where a row lands.
                    let arena = ep_core::Buffer::<ep_sim::ThreadSim>::low_latency_size_hint(
                        n as usize,
                        shape.hidden,
                        shape.ranks,
                        shape.experts,
                    );
                    // Dispatch rows land in per-(expert, source rank) blocks: a page per block
                    // reached plus the rows; combine partials are contiguous per token.
                    let blocks = (l * r).min(t * k);
                    let per_rank = blocks * SIM_PAGE + t * k * (data_row + 2 * h);
                    need.memory.push((
                        "simulator arena",
                        (r * per_rank).min(arena.saturating_mul(r)),
                    ));
                }
                let combined = r * t * 2 * h;
                let refs = match command {
                    Command::Bench => 4,
                    Command::Layout => 3,
                };
                need.memory
                    .push(("combined outputs and references", refs * combined));
                if dump {
                    // One rank's packed rows as float32 at a time.
                    need.memory.push(("dump copies", l * rn * 4 * h));
                    need.disk = r * l * rn * (4 * h + data_row + 4 * h / 128 + 8) + r * t * 4 * h;
                }
            }
        }
        need
    }

    fn breakdown(&self) -> String {
        self.memory
            .iter()
            .filter(|(_, b)| *b > 0)
            .map(|(what, b)| format!("{what} {}", gib(*b)))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// What a run holds whatever its shape: the binary, the memcpy calibration's buffers, thread
/// stacks and scratch.
const BASE: u64 = 256 << 20;

/// Threads mode's page (`ep_sim`'s `TPAGE`): memory is materialised a page at a time.
const SIM_PAGE: u64 = 1 << 18;

/// What this machine gives a run. (Disk space is not checked: a run with `--dump` says what it
/// will write before it starts, [`dump_line`].)
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Machine {
    /// Memory available: `(bytes, where the figure comes from)`.
    pub memory: Option<(u64, String)>,
    /// The address-space limit (`RLIMIT_AS`), if any.
    pub address_space: Option<u64>,
}

impl Machine {
    /// Reads `/proc/meminfo` (`MemAvailable`), the cgroup's `memory.max` and `RLIMIT_AS`.
    #[must_use]
    pub fn probe() -> Machine {
        let meminfo = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .map(|kb| {
                    (
                        kb * 1024,
                        format!("{} available (MemAvailable)", gib(kb * 1024)),
                    )
                })
        });
        let cgroup = std::fs::read_to_string("/sys/fs/cgroup/memory.max")
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .map(|max| {
                let used = std::fs::read_to_string("/sys/fs/cgroup/memory.current")
                    .ok()
                    .and_then(|s| s.trim().parse::<u64>().ok())
                    .unwrap_or(0);
                let left = max.saturating_sub(used);
                (
                    left,
                    format!("{} left under the cgroup's memory.max", gib(left)),
                )
            });
        let memory = match (meminfo, cgroup) {
            (Some(a), Some(b)) => Some(if b.0 < a.0 { b } else { a }),
            (a, b) => a.or(b),
        };
        Machine {
            memory,
            address_space: address_space_limit(),
        }
    }

    /// Refuses `shape` when its need exceeds what this machine has (module docs); returns the
    /// need otherwise. The error names a smaller shape that fits.
    pub fn check(
        &self,
        shape: &Shape,
        command: Command,
        dump: Option<&Path>,
    ) -> Result<Need, PreflightError> {
        let need = Need::estimate(shape, command, dump.is_some());
        let fits = |have: u64, f: &dyn Fn(&Need) -> u64| -> String {
            let budget = (have as f64 * HEADROOM) as u64;
            let mut lo = 0usize;
            let mut hi = shape.tokens;
            while lo + 1 < hi {
                let mid = lo + (hi - lo) / 2;
                if f(&Need::estimate(
                    &shape.with_tokens(mid),
                    command,
                    dump.is_some(),
                )) <= budget
                {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            if lo >= 1 {
                format!("--tokens {lo} (or fewer ranks, or a smaller --hidden) fits")
            } else {
                "even one token per rank does not fit: use fewer ranks or a smaller --hidden".into()
            }
        };
        if let Some((have, text)) = &self.memory {
            let total = need.memory_total();
            if total as f64 > *have as f64 * HEADROOM {
                return Err(PreflightError::TooLarge {
                    what: "memory",
                    needed: total,
                    have: *have,
                    have_text: format!("this machine has {text}"),
                    breakdown: need.breakdown(),
                    fits: fits(*have, &Need::memory_total),
                });
            }
        }
        if let Some(limit) = self.address_space {
            let total = need.memory_total() + need.reserved;
            if total as f64 > limit as f64 * HEADROOM {
                return Err(PreflightError::TooLarge {
                    what: "address space",
                    needed: total,
                    have: limit,
                    have_text: format!("the address-space limit (ulimit -v) is {}", gib(limit)),
                    breakdown: format!(
                        "{}, zero pages reserved {}",
                        need.breakdown(),
                        gib(need.reserved)
                    ),
                    fits: fits(limit, &|n: &Need| n.memory_total() + n.reserved),
                });
            }
        }
        Ok(need)
    }
}

/// `RLIMIT_AS` when it is set (`Max address space` of `/proc/self/limits`).
fn address_space_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max address space"))?;
    line.trim_start_matches("Max address space")
        .split_whitespace()
        .next()?
        .parse::<u64>()
        .ok()
}

fn existing_ancestor(path: &Path) -> Option<&Path> {
    let mut p = Some(path);
    while let Some(d) = p {
        let d = if d.as_os_str().is_empty() {
            Path::new(".")
        } else {
            d
        };
        if d.exists() {
            return Some(d);
        }
        p = d.parent();
    }
    None
}

/// Checks that `--json PATH` can be written (a file is created and removed again if it did
/// not exist) and that the directories of `--dump` / `--dump-inputs` can be created: each an
/// existing directory or under a writable one, never an existing file.
pub fn check_outputs(
    json: Option<&Path>,
    dirs: &[(&'static str, Option<&Path>)],
) -> Result<(), PreflightError> {
    let bad = |option, path: &Path, why: String| PreflightError::Output {
        option,
        path: path.to_path_buf(),
        why,
    };
    if let Some(path) = json {
        if path.is_dir() {
            return Err(bad("--json", path, "is a directory".into()));
        }
        let existed = path.exists();
        std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(path)
            .map_err(|e| bad("--json", path, format!("cannot be written ({e})")))?;
        if !existed {
            let _ = std::fs::remove_file(path);
        }
    }
    for &(option, dir) in dirs {
        let Some(dir) = dir else { continue };
        if dir.exists() && !dir.is_dir() {
            return Err(bad(option, dir, "exists and is not a directory".into()));
        }
        let Some(base) = existing_ancestor(dir) else {
            return Err(bad(option, dir, "no existing parent directory".into()));
        };
        if !base.is_dir() {
            return Err(bad(
                option,
                dir,
                format!("{} is not a directory", base.display()),
            ));
        }
        let probe = base.join(format!(".ep-write-check-{}", std::process::id()));
        std::fs::create_dir(&probe).map_err(|e| {
            bad(
                option,
                dir,
                format!("{} is not writable ({e})", base.display()),
            )
        })?;
        let _ = std::fs::remove_dir(&probe);
    }
    Ok(())
}

/// `--granularity` must be a realistic NVSHMEM heap chunk: a multiple of [`MIN_GRANULARITY`].
/// (Smaller chunks split every RDMA transfer into more work requests than any real heap would,
/// and the checked simulator's cost grows with them without bound.)
pub fn check_granularity(granularity: u64) -> Result<(), PreflightError> {
    if granularity < MIN_GRANULARITY || !granularity.is_multiple_of(MIN_GRANULARITY) {
        return Err(usage(format!(
            "--granularity {granularity}: NVSHMEM maps its symmetric heap in chunks that are \
             multiples of the CUDA VMM granularity ({MIN_GRANULARITY} bytes, 2 MiB); use a \
             multiple of it (the default is 536870912, 512 MiB)"
        )));
    }
    Ok(())
}

/// The checks of a command's options before its workload is loaded: `--round-scale` /
/// `--ue8m0` where they cannot apply ([`WorkloadArgs::ll_cast`]), output paths, then for a
/// generated workload its shape (usage) and its need against this machine. Returns the need
/// (`None` with `--inputs`: [`after_load`] checks the shape the files give).
pub fn before_load(
    args: &WorkloadArgs,
    defaults: &Defaults,
    command: Command,
    json: Option<&Path>,
) -> Result<Option<Need>, PreflightError> {
    args.ll_cast(defaults)?;
    check_outputs(
        json,
        &[
            ("--dump", args.dump.as_deref()),
            ("--dump-inputs", args.dump_inputs.as_deref()),
        ],
    )?;
    let Some(shape) = Shape::of_args(args, defaults) else {
        return Ok(None);
    };
    shape.check_usage()?;
    Machine::probe()
        .check(&shape, command, args.dump.as_deref())
        .map(Some)
}

/// The same checks for a workload read with `--inputs` (its shape and routing are known now);
/// a generated workload was checked by [`before_load`] and passes through.
pub fn after_load(
    w: &Workload,
    args: &WorkloadArgs,
    command: Command,
) -> Result<Option<Need>, PreflightError> {
    if args.inputs.is_none() {
        return Ok(None);
    }
    let shape = Shape::of_workload(w, args.num_sms);
    shape.check_usage()?;
    Machine::probe()
        .check(&shape, command, args.dump.as_deref())
        .map(Some)
}

/// The line a run with `--dump` prints before it starts: what the dump will take.
#[must_use]
pub fn dump_line(need: &Need, dir: &Path) -> String {
    format!(
        "dump to {}: about {} of disk and {} of memory at the peak of the run",
        dir.display(),
        gib(need.disk),
        gib(need.memory_total())
    )
}
