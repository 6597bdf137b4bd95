//! Options shared by `ep layout` and `ep bench`: the mode, the workload (generated from a seed or
//! read from `.npy` files) and where to dump it. One definition, flattened into both commands'
//! arguments, and one loader ([`load`]) that both call.

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use ep_core::numerics::fp8;
use ep_core::plan::low_latency::{self as ll, LlParams};
use ep_core::routing::Activations;
use ep_core::workload::{Routing, WorkloadSpec};
use ep_core::{RankInputs, Tensor2};
use half::bf16;
use serde_json::json;

use crate::io::{self, InputsSummary, IoError, RunInfo};

/// SMs of DeepEP's normal-mode tests (spec §6.2): 12 channels.
pub const DEFAULT_NUM_SMS: usize = 24;

/// Which dispatch/combine family to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Normal (high-throughput) intranode mode.
    Normal,
    /// Low-latency mode.
    LowLatency,
}

impl Mode {
    /// `normal` or `low-latency`.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Normal => "normal",
            Self::LowLatency => "low-latency",
        }
    }
}

/// The workload options of `ep layout` and `ep bench`. Defaults are DeepEP's test settings
/// (spec §6.2, §6.4) unless a command says otherwise ([`Defaults`]).
#[derive(Clone, Debug, Args)]
pub struct WorkloadArgs {
    /// Mode to run.
    #[arg(long, value_enum, default_value_t = Mode::Normal)]
    pub mode: Mode,
    /// EP size (ranks) [default: 8; with --inputs: the number of rank directories].
    #[arg(long)]
    pub ranks: Option<usize>,
    /// Tokens per rank [default: 4096 normal, 128 low-latency; with --inputs: from the files].
    #[arg(long)]
    pub tokens: Option<usize>,
    /// Hidden size [default: 7168 for ep bench, 512 for ep layout, whose layout does not depend
    /// on it; with --inputs: from the files].
    #[arg(long)]
    pub hidden: Option<usize>,
    /// Top-k [default: 8; with --inputs: from the files].
    #[arg(long)]
    pub topk: Option<usize>,
    /// Experts [default: 256 normal, 288 low-latency; required with --inputs].
    #[arg(long)]
    pub experts: Option<usize>,
    /// Seed of the workload (ChaCha8; the same seed gives the same inputs on every machine).
    #[arg(long, default_value_t = 0, conflicts_with = "inputs")]
    pub seed: u64,
    /// Top-k slots per rank set to -1 [default: 0 normal, 10 low-latency, as DeepEP's tests].
    #[arg(long, conflicts_with = "inputs")]
    pub masked: Option<usize>,
    /// Expert choice of the generated workload: uniform, zipf:S (expert popularity follows a
    /// Zipf law with exponent S) or hot:F (a fraction F of tokens put expert 0 first).
    #[arg(long, default_value = "uniform", conflicts_with = "inputs")]
    pub routing: Routing,
    /// FP8: low-latency dispatch casts to e4m3 with per-128-channel scales (the default of
    /// low-latency mode, as DeepEP benchmarks it); normal mode dispatches FP8 inputs (generated
    /// with DeepEP's per_token_cast_to_fp8, or x_fp8.npy).
    #[arg(long, conflicts_with = "no_fp8")]
    pub fp8: bool,
    /// BF16 low-latency dispatch (turns off low-latency mode's FP8 default).
    #[arg(long)]
    pub no_fp8: bool,
    /// Low-latency FP8 dispatch: round every per-128-channel scale up to a power of two
    /// (DeepEP's round_scale; the scales stay float32). Refused in normal mode and with --no-fp8.
    #[arg(long)]
    pub round_scale: bool,
    /// Low-latency FP8 dispatch: store the scales as UE8M0 exponent bytes, four per int32
    /// (packed_recv_x_scales [.., H/512]; DeepEP's use_ue8m0). Requires --round-scale (not
    /// implied: DeepEP's use_ue8m0 requires round_scale) and a hidden size that is a multiple of
    /// 512; refused in normal mode and with --no-fp8.
    #[arg(long = "ue8m0")]
    pub use_ue8m0: bool,
    /// SMs given to normal mode: its channels are SMs / 2, as DeepEP's Config(24, 8, 256) in
    /// its tests.
    #[arg(long, default_value_t = DEFAULT_NUM_SMS)]
    pub num_sms: usize,
    /// Read every rank's inputs from DIR/rank{r}/{topk_idx,topk_weights,x}.npy (or x_fp8.npy +
    /// x_scales.npy) instead of generating them; ranks, tokens, hidden and top-k come from the
    /// files, --experts is required.
    #[arg(long, value_name = "DIR")]
    pub inputs: Option<PathBuf>,
    /// Write the inputs in the --inputs format (replay them later with --inputs DIR).
    #[arg(long, value_name = "DIR")]
    pub dump_inputs: Option<PathBuf>,
    /// Write every output as .npy under the spec's names, plus manifest.json with the digest.
    #[arg(long, value_name = "DIR")]
    pub dump: Option<PathBuf>,
}

/// What a command defaults differently.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Defaults {
    /// Hidden size of a generated workload.
    pub hidden: usize,
    /// Whether low-latency dispatch is FP8 unless `--no-fp8`.
    pub low_latency_fp8: bool,
}

/// A loaded workload: every rank's inputs and what describes them.
#[derive(Debug)]
pub struct Workload {
    /// The mode.
    pub mode: Mode,
    /// Every rank's inputs, rank order.
    pub inputs: Vec<RankInputs>,
    /// Experts `E`.
    pub num_experts: usize,
    /// Shapes of the inputs.
    pub summary: InputsSummary,
    /// FP8 dispatch: FP8 inputs in normal mode, the cast in low-latency mode.
    pub fp8: bool,
    /// `--round-scale`: low-latency FP8 scales rounded to powers of two (false otherwise).
    pub round_scale: bool,
    /// `--ue8m0`: low-latency FP8 scales stored as UE8M0 bytes (false otherwise).
    pub use_ue8m0: bool,
    /// Top-k slots set to -1 per rank of a generated workload (`None` for files).
    pub masked_per_rank: Option<usize>,
    /// Seed, routing, input directory and options, for manifests.
    pub info: RunInfo,
    /// One line describing the workload (mode, shapes, seed or directory, workload digest).
    pub description: String,
}

/// How low-latency dispatch casts its rows: DeepEP's `use_fp8`, `round_scale` and `use_ue8m0`
/// (spec §1.9). All false in normal mode, and the last two false unless FP8.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LlCast {
    /// Cast to e4m3 with per-128-channel scales (`--fp8`, low-latency mode's default).
    pub use_fp8: bool,
    /// Scales rounded up to powers of two (`--round-scale`).
    pub round_scale: bool,
    /// Scales stored as packed UE8M0 bytes (`--ue8m0`; requires `round_scale`).
    pub use_ue8m0: bool,
}

impl LlCast {
    /// `params` with this cast: [`LlParams::with_fp8`] when FP8, unchanged (BF16) otherwise.
    #[must_use]
    pub fn apply(self, params: LlParams) -> LlParams {
        if self.use_fp8 {
            params.with_fp8(self.round_scale, self.use_ue8m0)
        } else {
            params
        }
    }

    /// The options that select this cast, for messages: ` --round-scale --ue8m0` (empty for a
    /// plain FP8 or BF16 cast).
    #[must_use]
    pub fn flags(self) -> String {
        let mut s = String::new();
        if self.round_scale {
            s.push_str(" --round-scale");
        }
        if self.use_ue8m0 {
            s.push_str(" --ue8m0");
        }
        s
    }
}

/// `--round-scale` / `--ue8m0` where they cannot apply: usage errors (exit 2).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CastError {
    /// Given in normal mode, which dispatches its inputs as they are (no cast).
    #[error(
        "{flag} shapes the FP8 cast of low-latency dispatch; normal mode dispatches its inputs \
         as they are (BF16, or FP8 with --fp8 / x_fp8.npy): add --mode low-latency or drop {flag}"
    )]
    NormalMode {
        /// `--round-scale` or `--ue8m0`.
        flag: &'static str,
    },
    /// Given with BF16 low-latency dispatch (`--no-fp8`), whose rows carry no scales.
    #[error(
        "{flag} shapes the FP8 cast of low-latency dispatch, but --no-fp8 makes it BF16 (no \
         scales to round or pack): drop --no-fp8 or drop {flag}"
    )]
    Bf16 {
        /// `--round-scale` or `--ue8m0`.
        flag: &'static str,
    },
    /// `--ue8m0` without `--round-scale` (DeepEP: `use_ue8m0` requires `round_scale`).
    #[error(
        "--ue8m0 requires --round-scale: UE8M0 bytes hold only power-of-two scales (DeepEP's \
         use_ue8m0 requires round_scale); add --round-scale"
    )]
    Ue8m0WithoutRoundScale,
}

/// Errors of the shared options.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OptionsError {
    /// `--inputs` without `--experts`.
    #[error(
        "--experts is required with --inputs (the files do not say how many experts there are)"
    )]
    ExpertsRequired,
    /// Inputs that cannot be read, or that disagree with the options given beside them.
    #[error(transparent)]
    Io(#[from] IoError),
    /// The workload spec is invalid (ep-core says why): a usage error.
    #[error("cannot generate the workload")]
    Generate(#[source] ep_core::Error),
    /// `--round-scale` / `--ue8m0` where they cannot apply: a usage error.
    #[error(transparent)]
    Cast(#[from] CastError),
    /// `--dump-inputs` failed.
    #[error("writing the inputs to {}", dir.display())]
    WriteInputs {
        /// The directory.
        dir: PathBuf,
        /// What failed.
        #[source]
        source: IoError,
    },
}

impl WorkloadArgs {
    /// Whether dispatch is FP8 for inputs of kind `inputs_fp8` (normal mode: the inputs decide;
    /// low-latency: `--fp8`, `--no-fp8`, else the command's default).
    #[must_use]
    pub fn fp8(&self, defaults: &Defaults, inputs_fp8: bool) -> bool {
        match self.mode {
            Mode::Normal => inputs_fp8,
            Mode::LowLatency => self.fp8 || (defaults.low_latency_fp8 && !self.no_fp8),
        }
    }

    /// The low-latency cast these options select, refusing `--round-scale` / `--ue8m0` where
    /// they cannot apply: normal mode, BF16 low-latency dispatch, `--ue8m0` alone. (The hidden
    /// size FP8 needs, a multiple of 512, is a shape check: `preflight::Shape::check_usage`.)
    /// Normal mode gives the all-false cast.
    pub fn ll_cast(&self, defaults: &Defaults) -> Result<LlCast, CastError> {
        let fp8 = self.mode == Mode::LowLatency && self.fp8(defaults, false);
        for (flag, on) in [
            ("--round-scale", self.round_scale),
            ("--ue8m0", self.use_ue8m0),
        ] {
            if !on {
                continue;
            }
            if self.mode == Mode::Normal {
                return Err(CastError::NormalMode { flag });
            }
            if !fp8 {
                return Err(CastError::Bf16 { flag });
            }
        }
        if self.use_ue8m0 && !self.round_scale {
            return Err(CastError::Ue8m0WithoutRoundScale);
        }
        Ok(LlCast {
            use_fp8: fp8,
            round_scale: self.round_scale,
            use_ue8m0: self.use_ue8m0,
        })
    }
}

impl Workload {
    /// The low-latency cast of this workload (`use_fp8`, `round_scale`, `use_ue8m0`; all false
    /// in normal mode). Backends building their own `LlParams` or kernel arguments take them
    /// from here: `w.ll_cast().apply(LlParams::new(n, e))`.
    #[must_use]
    pub fn ll_cast(&self) -> LlCast {
        match self.mode {
            Mode::Normal => LlCast::default(),
            Mode::LowLatency => LlCast {
                use_fp8: self.fp8,
                round_scale: self.round_scale,
                use_ue8m0: self.use_ue8m0,
            },
        }
    }
}

/// Generates `spec` with one thread per core, rank by rank (`WorkloadSpec::generate_rank`
/// equals `generate()[rank]`, so the result does not depend on the thread count).
pub fn generate(spec: &WorkloadSpec) -> ep_core::Result<Vec<RankInputs>> {
    spec.validate()?;
    crate::ranks::per_rank(spec.num_ranks, |r| spec.generate_rank(r))
        .into_iter()
        .collect()
}

/// Loads the workload the options describe: reads `--inputs` (checking the options given beside
/// them against the files) or generates one, then writes `--dump-inputs` if asked.
pub fn load(args: &WorkloadArgs, defaults: &Defaults) -> Result<Workload, OptionsError> {
    let ll_mode = args.mode == Mode::LowLatency;
    let mode_name = args.mode.name();
    let cast = args.ll_cast(defaults)?;
    let w = match &args.inputs {
        Some(dir) => {
            let experts = args.experts.ok_or(OptionsError::ExpertsRequired)?;
            let inputs = io::read_inputs(dir, experts)?;
            let s = io::summarize(&inputs);
            check_options(args, dir, &s)?;
            let fp8 = args.fp8(defaults, s.fp8);
            let description = format!(
                "{mode_name} mode, inputs {}: {} ranks, {} tokens/rank, hidden {}, top-{}, \
                 {experts} experts, {} (workload digest {:016x})",
                dir.display(),
                s.num_ranks,
                tokens_text(&s.tokens),
                s.hidden,
                s.topk,
                if s.fp8 { "FP8" } else { "BF16" },
                ep_core::workload::digest(&inputs),
            );
            let info = RunInfo {
                inputs: Some(dir.display().to_string()),
                ..RunInfo::default()
            };
            Workload {
                mode: args.mode,
                inputs,
                num_experts: experts,
                summary: s,
                fp8,
                round_scale: cast.round_scale,
                use_ue8m0: cast.use_ue8m0,
                masked_per_rank: None,
                info,
                description,
            }
        }
        None => {
            let ranks = args.ranks.unwrap_or(8);
            let tokens = args.tokens.unwrap_or(if ll_mode { 128 } else { 4096 });
            let experts = args.experts.unwrap_or(if ll_mode { 288 } else { 256 });
            let mut spec = WorkloadSpec::new(
                ranks,
                tokens,
                args.hidden.unwrap_or(defaults.hidden),
                args.topk.unwrap_or(8),
                experts,
                args.seed,
            );
            spec.masked_per_rank = args.masked.unwrap_or(if ll_mode { 10 } else { 0 });
            spec.routing = args.routing;
            // Low-latency casts on dispatch; normal mode dispatches FP8 inputs as they are.
            spec.fp8 = args.fp8 && !ll_mode;
            let inputs = generate(&spec).map_err(OptionsError::Generate)?;
            let routing = match args.routing {
                Routing::Uniform => String::new(),
                r => format!(", routing {r}"),
            };
            let description = format!(
                "{mode_name} mode, {ranks} ranks, {tokens} tokens/rank, hidden {}, top-{}, \
                 {experts} experts, {} masked slots/rank{routing}, seed {} (workload digest \
                 {:016x})",
                spec.hidden,
                spec.num_topk,
                spec.masked_per_rank,
                args.seed,
                ep_core::workload::digest(&inputs),
            );
            let info = RunInfo {
                seed: Some(args.seed),
                routing: Some(args.routing.to_string()),
                options: json!({ "masked_per_rank": spec.masked_per_rank })
                    .as_object()
                    .cloned()
                    .unwrap_or_default(),
                ..RunInfo::default()
            };
            let s = io::summarize(&inputs);
            let fp8 = args.fp8(defaults, s.fp8);
            Workload {
                mode: args.mode,
                inputs,
                num_experts: experts,
                summary: s,
                fp8,
                round_scale: cast.round_scale,
                use_ue8m0: cast.use_ue8m0,
                masked_per_rank: Some(spec.masked_per_rank),
                info,
                description,
            }
        }
    };
    if let Some(dir) = &args.dump_inputs {
        io::write_inputs(dir, &w.inputs).map_err(|source| OptionsError::WriteInputs {
            dir: dir.clone(),
            source,
        })?;
    }
    Ok(w)
}

/// `T` of every rank: one number when they agree, `min..max` otherwise.
#[must_use]
pub fn tokens_text(tokens: &[usize]) -> String {
    let (lo, hi) = (
        tokens.iter().min().copied().unwrap_or(0),
        tokens.iter().max().copied().unwrap_or(0),
    );
    if lo == hi {
        lo.to_string()
    } else {
        format!("{lo}..{hi}")
    }
}

/// Options given beside `--inputs` must agree with the files.
fn check_options(args: &WorkloadArgs, dir: &Path, s: &InputsSummary) -> Result<(), IoError> {
    let rank0 = io::rank_dir(dir, 0);
    let x_file = rank0.join(if s.fp8 { "x_fp8.npy" } else { "x.npy" });
    let idx_file = rank0.join("topk_idx.npy");
    let t0 = s.tokens.first().copied().unwrap_or(0) as u64;
    let mismatch =
        |path: PathBuf, shape: Vec<u64>, expected: String, option: String| IoError::ShapeMismatch {
            path,
            shape,
            expected,
            why: format!("{option} was given"),
        };
    if let Some(r) = args.ranks
        && r != s.num_ranks
    {
        return Err(IoError::RankCountMismatch {
            dir: dir.to_path_buf(),
            found: s.num_ranks,
            expected: r,
        });
    }
    if let Some(t) = args.tokens
        && let Some(r) = s.tokens.iter().position(|&x| x != t)
    {
        let path = io::rank_dir(dir, r).join("topk_idx.npy");
        return Err(mismatch(
            path,
            vec![s.tokens[r] as u64, s.topk as u64],
            format!("[{t}, K]"),
            format!("--tokens {t}"),
        ));
    }
    if let Some(h) = args.hidden
        && h != s.hidden
    {
        return Err(mismatch(
            x_file,
            vec![t0, s.hidden as u64],
            format!("[T, {h}]"),
            format!("--hidden {h}"),
        ));
    }
    if let Some(k) = args.topk
        && k != s.topk
    {
        return Err(mismatch(
            idx_file,
            vec![t0, s.topk as u64],
            format!("[T, {k}]"),
            format!("--topk {k}"),
        ));
    }
    if args.fp8 && args.mode == Mode::Normal && !s.fp8 {
        return Err(IoError::AmbiguousActivations {
            path: rank0,
            detail: "--fp8 was given but the inputs are BF16 (x.npy); drop --fp8 or provide \
                     x_fp8.npy + x_scales.npy"
                .into(),
        });
    }
    Ok(())
}

/// Low-latency parameters: `N` = the tokens per rank, or with inputs from files the largest
/// `T`, raised until `R * N` is a multiple of 4 (spec §1.9); the dispatch cast as `cast` says
/// ([`WorkloadArgs::ll_cast`], [`Workload::ll_cast`]).
#[must_use]
pub fn ll_params(cast: LlCast, s: &InputsSummary, experts: usize) -> LlParams {
    let mut n = s.max_tokens().max(1);
    while !(s.num_ranks * n).is_multiple_of(ll::LL_PACKED_ROWS_MULTIPLE) {
        n += 1;
    }
    cast.apply(LlParams::new(n, experts))
}

/// The "expert" of the round trips: identity, as BF16 (FP8 rows dequantised first).
pub fn expert_rows(x: &Activations) -> ep_core::Result<Tensor2<bf16>> {
    Ok(match x {
        Activations::Bf16(x) => x.clone(),
        Activations::Fp8 { data, scales } => {
            let f = fp8::dequantize(data, scales)?;
            Tensor2::from_fn(f.rows(), f.cols(), |r, c| bf16::from_f32(f.get(r, c)))
        }
    })
}
