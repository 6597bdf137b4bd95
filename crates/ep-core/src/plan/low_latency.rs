//! Low-latency dispatch and combine: the exact outputs (spec §1.9, §2.4, §2.5, §2.7).
//!
//! # Dispatch (spec §2.4)
//!
//! Receiver `d`, local expert `l` (global expert `e = d·L + l`) gets one row per `(s, t, k)` with
//! `topk_idx_s[t, k] == e` from every **unmasked** source rank `s`, in a packed `[R·N, H]` array.
//! DeepEP places each source's block by an `atomicAdd` in arrival order and rows in sender
//! slot-claim order, so the order is not part of the semantics. This plan picks one legal,
//! deterministic placement:
//!
//! - blocks in ascending source rank, each starting where the previous one ended (`begin` = the
//!   rows of lower sources), masked sources get an empty block at the running offset;
//! - inside a block, rows in ascending token `t`, then ascending top-k slot `k` (a token that
//!   names the same expert twice gets two rows).
//!
//! Compare outputs with [`canonicalize`], which drops the placement. Rows past
//! `packed_recv_count[l]` are zero here (garbage in DeepEP), `src_info` past the count is `-1`.
//!
//! # Combine (spec §2.5)
//!
//! `combined_me[t] = bf16(acc)` with `acc = 0` and, for `k = 0..K` in order, skipping `e_k < 0`
//! and experts on masked ranks, `acc = fma(f32(y_owner[e_k % L][row of (me, t)]), w[t, k], acc)`.
//! DeepEP writes `acc += f32(y) * w`; nvcc contracts that into one fused multiply-add (its default
//! `--fmad=true`), so the FMA is what the GPU computes, and what we compute, bit for bit. The row
//! of `(me, t)` is looked up in the owner's handle (block of source `me`, `src_info == t`); if a
//! token chose the same expert twice, DeepEP's combine reads one slot written by both rows, so the
//! result is defined only when both rows' outputs agree — we take the lowest row.
//!
//! # Masking (spec §2.7)
//!
//! `masked_ranks[r]` = rank `r` is masked on every rank (a shared view of the mask buffer). A
//! masked rank sends nothing, receives nothing and has no outputs (`None`); unmasked receivers
//! get empty blocks from it, and combine drops top-k entries whose expert lives on it.

use half::bf16;

use crate::error::{Error, Result};
use crate::numerics::{fp8, logfmt};
use crate::routing::{Activations, InputShapes, RankInputs, validate_routing};
use crate::tensor::{Tensor2, Tensor3};

/// Largest top-k low-latency kernels support (spec §0, `kNumMaxTopK`).
pub const LL_MAX_TOPK: usize = 11;
/// `H` must be a multiple of this (spec §1.9: `H % 128 == 0`, which implies `H % 16 == 0`).
pub const LL_HIDDEN_MULTIPLE: usize = 128;
/// With FP8, `H` must be a multiple of this (spec §1.9).
pub const LL_FP8_HIDDEN_MULTIPLE: usize = 512;
/// `R · N` must be a multiple of this (spec §1.9, "TMA").
pub const LL_PACKED_ROWS_MULTIPLE: usize = 4;

/// The arguments of a low-latency dispatch/combine pair besides the tensors (spec §1.9).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LlParams {
    /// `N`: the most tokens any rank dispatches in one call; sizes every receive block.
    pub num_max_dispatch_tokens_per_rank: usize,
    /// `E`, a multiple of the rank count.
    pub num_experts: usize,
    /// Cast rows to FP8 e4m3 with per-128-channel scales.
    pub use_fp8: bool,
    /// Round scales up to powers of two.
    pub round_scale: bool,
    /// Store scales as packed UE8M0 bytes; requires `round_scale`.
    pub use_ue8m0: bool,
    /// `masked_ranks[r]`: rank `r` is masked (spec §2.7). Empty = no rank masked; otherwise one
    /// entry per rank.
    pub masked_ranks: Vec<bool>,
}

impl LlParams {
    /// BF16 dispatch with `N` and `E`, no rank masked.
    pub fn new(num_max_dispatch_tokens_per_rank: usize, num_experts: usize) -> Self {
        Self {
            num_max_dispatch_tokens_per_rank,
            num_experts,
            use_fp8: false,
            round_scale: false,
            use_ue8m0: false,
            masked_ranks: Vec::new(),
        }
    }

    /// Switches to FP8 dispatch with the given scale options.
    pub fn with_fp8(mut self, round_scale: bool, use_ue8m0: bool) -> Self {
        self.use_fp8 = true;
        self.round_scale = round_scale;
        self.use_ue8m0 = use_ue8m0;
        self
    }

    /// Sets the masked ranks (one entry per rank).
    pub fn with_masked_ranks(mut self, masked_ranks: Vec<bool>) -> Self {
        self.masked_ranks = masked_ranks;
        self
    }

    /// Whether rank `r` is masked.
    pub fn is_masked(&self, r: usize) -> bool {
        self.masked_ranks.get(r).copied().unwrap_or(false)
    }
}

/// Dimensions of a validated low-latency call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlShape {
    /// `R`.
    pub num_ranks: usize,
    /// `L = E / R`.
    pub num_local_experts: usize,
    /// `H`.
    pub hidden: usize,
    /// `N`.
    pub num_max_dispatch_tokens_per_rank: usize,
}

impl LlShape {
    /// Rows of each local expert's packed array: `R · N`.
    pub fn rows_per_expert(&self) -> usize {
        self.num_ranks * self.num_max_dispatch_tokens_per_rank
    }
}

/// Packs a layout-range entry: `(begin << 32) | count` (spec §2.4; low 32 bits = count).
pub fn pack_layout_range(begin: u32, count: u32) -> i64 {
    ((u64::from(begin) << 32) | u64::from(count)) as i64
}

/// Unpacks a layout-range entry into `(begin, count)`.
pub fn unpack_layout_range(value: i64) -> (u32, u32) {
    let v = value as u64;
    ((v >> 32) as u32, v as u32)
}

/// The received rows of one rank, `[L, R·N, ...]` (spec §2.4).
///
/// DeepEP allocates the scales as `[L, H/128, R·N]` (or `[L, H/512, R·N]` int32) and returns the
/// transpose; here they are stored logically, `[L, R·N, H/128]`, row-major. See
/// [`scales_column_major`] for DeepEP's memory order.
#[derive(Clone, Debug, PartialEq)]
pub enum LlRecvX {
    /// `packed_recv_x` BF16: `[L, R·N, H]`.
    Bf16(Tensor3<bf16>),
    /// FP8 rows with float32 scales.
    Fp8 {
        /// e4m3 bytes, `[L, R·N, H]`.
        data: Tensor3<u8>,
        /// `scale_inv` per 128 channels, `[L, R·N, H/128]`.
        scales: Tensor3<f32>,
    },
    /// FP8 rows with UE8M0 scales.
    Fp8Ue8m0 {
        /// e4m3 bytes, `[L, R·N, H]`.
        data: Tensor3<u8>,
        /// Packed UE8M0 scales, `[L, R·N, H/512]`: scale `i` in word `i / 4`, byte `i % 4`
        /// (least significant first).
        scales: Tensor3<i32>,
    },
}

/// The format of received rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LlFormat {
    /// BF16 rows.
    Bf16,
    /// FP8 rows, float32 scales.
    Fp8,
    /// FP8 rows, UE8M0 scales.
    Fp8Ue8m0,
}

impl LlRecvX {
    /// The format of these rows.
    pub fn format(&self) -> LlFormat {
        match self {
            Self::Bf16(_) => LlFormat::Bf16,
            Self::Fp8 { .. } => LlFormat::Fp8,
            Self::Fp8Ue8m0 { .. } => LlFormat::Fp8Ue8m0,
        }
    }

    /// Number of local experts.
    pub fn num_local_experts(&self) -> usize {
        self.data_shape().0
    }

    /// `(L, R·N, H)` of the data (without the scales).
    pub fn data_shape(&self) -> (usize, usize, usize) {
        match self {
            Self::Bf16(x) => x.shape(),
            Self::Fp8 { data, .. } | Self::Fp8Ue8m0 { data, .. } => data.shape(),
        }
    }

    /// `(rows, hidden)` of local expert `l`'s array, if it exists.
    fn dims(&self, l: usize) -> Option<(usize, usize)> {
        let (n, rows, hidden) = self.data_shape();
        (l < n).then_some((rows, hidden))
    }

    /// Row `row` of local expert `l` as f32: BF16 widened, FP8 dequantised (`f32(e4m3) ·
    /// scale_inv`, UE8M0 bytes unpacked first). `None` if out of range or malformed.
    pub fn row_f32(&self, l: usize, row: usize) -> Option<Vec<f32>> {
        let (rows, _) = self.dims(l)?;
        if row >= rows {
            return None;
        }
        match self {
            Self::Bf16(x) => Some(x.row(l, row).iter().map(|v| v.to_f32()).collect()),
            Self::Fp8 { data, scales } => {
                fp8::dequantize_row(data.row(l, row), row_of(scales, l, row)?).ok()
            }
            Self::Fp8Ue8m0 { data, scales } => {
                let q = data.row(l, row);
                let s =
                    fp8::unpack_ue8m0(row_of(scales, l, row)?, q.len() / fp8::FP8_BLOCK).ok()?;
                fp8::dequantize_row(q, &s).ok()
            }
        }
    }

    /// Row `row` of local expert `l` as raw bits: data bytes (BF16 little-endian) and one u32 per
    /// scale (f32 bits, or the UE8M0 byte). `None` if out of range or malformed.
    pub fn row_bits(&self, l: usize, row: usize) -> Option<(Vec<u8>, Vec<u32>)> {
        let (rows, hidden) = self.dims(l)?;
        if row >= rows {
            return None;
        }
        match self {
            Self::Bf16(x) => Some((
                x.row(l, row)
                    .iter()
                    .flat_map(|v| v.to_bits().to_le_bytes())
                    .collect(),
                Vec::new(),
            )),
            Self::Fp8 { data, scales } => {
                let s = row_of(scales, l, row)?;
                Some((
                    data.row(l, row).to_vec(),
                    s.iter().map(|v| v.to_bits()).collect(),
                ))
            }
            Self::Fp8Ue8m0 { data, scales } => {
                let s = row_of(scales, l, row)?;
                let bytes = (0..hidden / fp8::FP8_BLOCK)
                    .map(|i| fp8::ue8m0_unpack_byte(s, i).map(u32::from))
                    .collect::<Option<Vec<u32>>>()?;
                Some((data.row(l, row).to_vec(), bytes))
            }
        }
    }
}

/// Row `row` of matrix `l`, `None` outside `t` (scales need not match their data's shape).
fn row_of<T>(t: &Tensor3<T>, l: usize, row: usize) -> Option<&[T]> {
    (l < t.matrices() && row < t.rows()).then(|| t.row(l, row))
}

/// Zeroed blocks of at least this many bytes come from fresh mappings of their own size, whose
/// pages are the kernel's zero page until written: glibc maps a request afresh from its mmap
/// threshold up (unless a free heap block already fits it), and the threshold is never above
/// 32 MiB (`DEFAULT_MMAP_THRESHOLD_MAX` on 64-bit: the ceiling of the dynamic threshold, and of
/// what `mallopt(M_MMAP_THRESHOLD)` accepts); the `ep` binary sets it to exactly this
/// (`ep_sim::alloc::tune_system_allocator`). Smaller zeroed blocks may come from the heap, where
/// `calloc` clears reused memory: resident in full.
pub const FRESH_MAPPING_BYTES: usize = 32 << 20;

/// Zeroed `[L, rows, cols]` arrays for the mostly empty packed layout: one allocation of exactly
/// `L · rows · cols` elements, so that from [`FRESH_MAPPING_BYTES`] up the system allocator maps
/// fresh zero pages and only the rows written are ever touched (address space reserved: what the
/// arrays occupy, and no more). Keep such arrays alive and reuse them: a freed block may be
/// recycled by a caching allocator, which must then zero all of it.
#[must_use]
pub fn packed_zeros_u8(experts: usize, rows: usize, cols: usize) -> Tensor3<u8> {
    Tensor3::filled(experts, rows, cols, 0)
}

/// [`packed_zeros_u8`] for BF16 (`+0`).
#[must_use]
pub fn packed_zeros_bf16(experts: usize, rows: usize, cols: usize) -> Tensor3<bf16> {
    Tensor3::zeros(experts, rows, cols)
}

/// [`packed_zeros_u8`] for float32 scales.
#[must_use]
pub fn packed_zeros_f32(experts: usize, rows: usize, cols: usize) -> Tensor3<f32> {
    Tensor3::filled(experts, rows, cols, 0.0)
}

/// [`packed_zeros_u8`] for packed UE8M0 scales.
#[must_use]
pub fn packed_zeros_i32(experts: usize, rows: usize, cols: usize) -> Tensor3<i32> {
    Tensor3::filled(experts, rows, cols, 0)
}

/// DeepEP's memory order of one local expert's scales: the logical `[R·N, S]` array stored
/// column-major (`[S, R·N]` row-major, "for TMA", spec §2.4).
pub fn scales_column_major<T: Clone>(scales: &Tensor2<T>) -> Vec<T> {
    let mut out = Vec::with_capacity(scales.rows() * scales.cols());
    for c in 0..scales.cols() {
        for r in 0..scales.rows() {
            out.push(scales.get(r, c));
        }
    }
    out
}

/// What combine needs from a dispatch (DeepEP's handle `(src_info, layout_range, N, H, E)`).
#[derive(Clone, Debug, PartialEq)]
pub struct LlHandle {
    /// `packed_recv_src_info [L, R·N]`: source token index of each valid row.
    pub src_info: Tensor2<i32>,
    /// `packed_recv_layout_range [L, R]`: `(begin << 32) | count` per source.
    pub layout_range: Tensor2<i64>,
    /// `N`.
    pub num_max_dispatch_tokens_per_rank: usize,
    /// `H`.
    pub hidden: usize,
    /// `E`.
    pub num_experts: usize,
}

impl LlHandle {
    /// `(begin, count)` of source `s`'s block at local expert `l`; `None` outside the
    /// `[L, R]` layout.
    pub fn block(&self, l: usize, s: usize) -> Option<(usize, usize)> {
        if l >= self.layout_range.rows() || s >= self.layout_range.cols() {
            return None;
        }
        let (b, c) = unpack_layout_range(self.layout_range.get(l, s));
        Some((b as usize, c as usize))
    }
}

/// The outputs of a low-latency dispatch on one (unmasked) receiver (spec §2.4).
#[derive(Clone, Debug, PartialEq)]
pub struct LlDispatchOutput {
    /// `packed_recv_x` (and scales).
    pub recv_x: LlRecvX,
    /// `packed_recv_count [L]`: rows received per local expert.
    pub recv_count: Vec<i32>,
    /// The handle: `src_info`, `layout_range`, `N`, `H`, `E`.
    pub handle: LlHandle,
}

/// Checks a low-latency dispatch's arguments (the API-level asserts of spec §1.9, plus what
/// makes the outputs well defined) and returns its dimensions: the shape-level rules
/// ([`validate_dispatch_shapes`]) of every rank first, then the per-token ones
/// ([`validate_dispatch_routing`]).
///
/// Checked: at least one rank; `masked_ranks` empty or one per rank; `E` a positive multiple
/// of `R`; `use_ue8m0 ⇒ round_scale`; `R·N % 4 == 0`; per rank: BF16 `x`, consistent shapes
/// ([`InputShapes::check`]), expert ids in `[-1, E)`, `T ≤ N`, `K ≤ 11`, the same `H`
/// everywhere, `H` a positive multiple of 128 (512 with FP8), and at most `N` entries to any
/// one expert.
/// Not checked here: the kernels' list of compiled `H` values, the QP depth and `N ≤ 1024`
/// (configuration checks, `crate::config`).
pub fn validate_dispatch(inputs: &[RankInputs], params: &LlParams) -> Result<LlShape> {
    let shapes: Vec<InputShapes> = inputs.iter().map(RankInputs::shapes).collect();
    let shape = validate_dispatch_shapes(&shapes, params)?;
    validate_dispatch_routing(inputs, params)?;
    Ok(shape)
}

/// The shape-level half of [`validate_dispatch`], over each rank's input shapes (whatever holds
/// the tensors): the call's scalars, `H`, and per rank BF16 `x` of that `H`, consistent shapes,
/// `T ≤ N` and `K ≤ 11`. Reads no tensor contents.
pub fn validate_dispatch_shapes(shapes: &[InputShapes], params: &LlParams) -> Result<LlShape> {
    let ranks: Vec<usize> = (0..shapes.len()).collect();
    validate_local_dispatch_shapes(shapes.len(), &ranks, shapes, params)
}

/// [`validate_dispatch_shapes`] of a process that holds some of the `num_ranks` ranks:
/// `shapes[i]` are rank `ranks[i]`'s (every rank holds the same `H` — the kernels of the
/// others check theirs).
pub fn validate_local_dispatch_shapes(
    num_ranks: usize,
    ranks: &[usize],
    shapes: &[InputShapes],
    params: &LlParams,
) -> Result<LlShape> {
    validate_params(num_ranks, params)?;
    if shapes.is_empty() || shapes.len() != ranks.len() {
        return Err(Error::RankCountMismatch {
            expected: ranks.len(),
            found: shapes.len(),
        });
    }
    let hidden = shapes[0].x.1;
    validate_hidden(hidden, params.use_fp8)?;
    let n = params.num_max_dispatch_tokens_per_rank;
    for (&rank, sh) in ranks.iter().zip(shapes) {
        if sh.fp8 {
            return Err(Error::LlExpectsBf16 { rank });
        }
        if sh.x.1 != hidden {
            return Err(Error::ShapeMismatch {
                what: "hidden size across ranks",
                expected: format!("{hidden} (rank {})", ranks[0]),
                found: format!("{} (rank {rank})", sh.x.1),
            });
        }
        sh.check(rank, true)?;
        validate_rank(sh, rank, n)?;
    }
    Ok(LlShape {
        num_ranks,
        num_local_experts: params.num_experts / num_ranks,
        hidden,
        num_max_dispatch_tokens_per_rank: n,
    })
}

/// The per-token half of [`validate_dispatch`]: every expert id in `[-1, E)`, and at most `N`
/// entries of a rank to any one expert. Call after [`validate_dispatch_shapes`].
pub fn validate_dispatch_routing(inputs: &[RankInputs], params: &LlParams) -> Result<()> {
    let n = params.num_max_dispatch_tokens_per_rank;
    for (rank, inp) in inputs.iter().enumerate() {
        validate_routing(&inp.topk_idx, params.num_experts, rank)?;
        // A rank sends each of its (t, k) entries for expert e into one of e's N slots for it.
        let mut per_expert = vec![0usize; params.num_experts];
        for &e in inp.topk_idx.data() {
            if let Ok(e) = usize::try_from(e) {
                per_expert[e] += 1;
            }
        }
        if let Some((expert, &count)) = per_expert.iter().enumerate().find(|&(_, &c)| c > n) {
            return Err(Error::LlSlotOverflow {
                rank,
                expert,
                count,
                num_max_dispatch_tokens_per_rank: n,
            });
        }
    }
    Ok(())
}

/// Checks of the call's scalars, shared by dispatch and combine (and by the GPU backend, which
/// refuses the same shapes before any launch).
pub fn validate_params(r: usize, params: &LlParams) -> Result<()> {
    if r == 0 {
        return Err(Error::InvalidRankCount {
            num_ranks: 0,
            need: "at least one rank",
        });
    }
    if !params.masked_ranks.is_empty() && params.masked_ranks.len() != r {
        return Err(Error::RankCountMismatch {
            expected: r,
            found: params.masked_ranks.len(),
        });
    }
    let e = params.num_experts;
    if e == 0 {
        return Err(Error::InvalidConfig {
            field: "num_experts",
            value: "0".into(),
            fix: "pass at least one expert per rank".into(),
        });
    }
    if !e.is_multiple_of(r) {
        return Err(Error::ExpertsNotDivisible {
            num_experts: e,
            num_ranks: r,
        });
    }
    if params.use_ue8m0 && !params.round_scale {
        return Err(Error::Ue8m0WithoutRoundScale);
    }
    let n = params.num_max_dispatch_tokens_per_rank;
    if !(r * n).is_multiple_of(LL_PACKED_ROWS_MULTIPLE) {
        return Err(Error::PackedRowsMisaligned {
            num_ranks: r,
            num_max_dispatch_tokens_per_rank: n,
        });
    }
    Ok(())
}

/// `H` a positive multiple of 128, and of 512 with FP8 (spec §1.9).
pub fn validate_hidden(hidden: usize, use_fp8: bool) -> Result<()> {
    if hidden == 0 || !hidden.is_multiple_of(LL_HIDDEN_MULTIPLE) {
        return Err(Error::HiddenMisaligned {
            what: "hidden",
            value: hidden,
            multiple: LL_HIDDEN_MULTIPLE,
            why: "low-latency rows are moved in 128-channel blocks",
        });
    }
    if use_fp8 && !hidden.is_multiple_of(LL_FP8_HIDDEN_MULTIPLE) {
        return Err(Error::HiddenMisaligned {
            what: "hidden",
            value: hidden,
            multiple: LL_FP8_HIDDEN_MULTIPLE,
            why: "FP8 low-latency dispatch packs scales four to an int32",
        });
    }
    Ok(())
}

/// Per-rank checks shared by dispatch and combine: `T ≤ N`, `K ≤ 11`.
fn validate_rank(sh: &InputShapes, rank: usize, n: usize) -> Result<()> {
    let (num_tokens, _) = sh.x;
    let num_topk = sh.topk_idx.map_or(0, |(_, k)| k);
    if num_tokens > n {
        return Err(Error::LlTooManyTokens {
            rank,
            num_tokens,
            num_max_dispatch_tokens_per_rank: n,
        });
    }
    if num_topk > LL_MAX_TOPK {
        return Err(Error::TopkTooLarge {
            num_topk,
            max: LL_MAX_TOPK,
            mode: "low-latency",
        });
    }
    Ok(())
}

/// Low-latency dispatch on every rank: `out[d]` is receiver `d`'s outputs, `None` if `d` is
/// masked.
pub fn dispatch(inputs: &[RankInputs], params: &LlParams) -> Result<Vec<Option<LlDispatchOutput>>> {
    let shape = validate_dispatch(inputs, params)?;
    let mut casts = SourceCasts::new(inputs, params);
    (0..shape.num_ranks)
        .map(|d| dispatch_one(inputs, params, shape, d, &mut casts))
        .collect()
}

/// Low-latency dispatch as seen by receiver `rank` alone (`None` if it is masked).
pub fn dispatch_rank(
    inputs: &[RankInputs],
    params: &LlParams,
    rank: usize,
) -> Result<Option<LlDispatchOutput>> {
    let shape = validate_dispatch(inputs, params)?;
    if rank >= shape.num_ranks {
        return Err(Error::RankOutOfRange {
            rank,
            num_ranks: shape.num_ranks,
        });
    }
    let mut casts = SourceCasts::new(inputs, params);
    dispatch_one(inputs, params, shape, rank, &mut casts)
}

/// One token's FP8 cast: e4m3 bytes and `scale_inv` per 128 channels.
type TokenCast = (Vec<u8>, Vec<f32>);

/// The FP8 cast of each source token, done at most once (the sender casts a token once and
/// sends the same bytes to all its experts, spec §3.6).
struct SourceCasts<'a> {
    inputs: &'a [RankInputs],
    round_scale: bool,
    cache: Vec<Vec<Option<TokenCast>>>,
}

impl<'a> SourceCasts<'a> {
    fn new(inputs: &'a [RankInputs], params: &LlParams) -> Self {
        Self {
            inputs,
            round_scale: params.round_scale,
            cache: inputs.iter().map(|i| vec![None; i.num_tokens()]).collect(),
        }
    }

    /// `(bytes, scale_inv)` of token `t` of rank `s`; inputs are validated BF16.
    fn get(&mut self, s: usize, t: usize) -> Result<&TokenCast> {
        let slot = &mut self.cache[s][t];
        if slot.is_none() {
            let Activations::Bf16(x) = &self.inputs[s].x else {
                return Err(Error::LlExpectsBf16 { rank: s });
            };
            let row = x.row(t);
            let mut q = vec![0u8; row.len()];
            let mut sc = vec![0f32; row.len() / fp8::FP8_BLOCK];
            fp8::cast_row(row, self.round_scale, &mut q, &mut sc)?;
            *slot = Some((q, sc));
        }
        // Filled just above.
        slot.as_ref().ok_or(Error::LlExpectsBf16 { rank: s })
    }
}

fn dispatch_one(
    inputs: &[RankInputs],
    params: &LlParams,
    shape: LlShape,
    d: usize,
    casts: &mut SourceCasts<'_>,
) -> Result<Option<LlDispatchOutput>> {
    if params.is_masked(d) {
        return Ok(None);
    }
    let (r, l_count, h) = (shape.num_ranks, shape.num_local_experts, shape.hidden);
    let rows = shape.rows_per_expert();
    let scales_per_row = h / fp8::FP8_BLOCK;
    let packs_per_row = scales_per_row.div_ceil(fp8::UE8M0_PER_PACK);

    let mut recv_x = match (params.use_fp8, params.use_ue8m0) {
        (false, _) => LlRecvX::Bf16(Tensor3::filled(l_count, rows, h, bf16::ZERO)),
        (true, false) => LlRecvX::Fp8 {
            data: Tensor3::filled(l_count, rows, h, 0u8),
            scales: Tensor3::filled(l_count, rows, scales_per_row, 0f32),
        },
        (true, true) => LlRecvX::Fp8Ue8m0 {
            data: Tensor3::filled(l_count, rows, h, 0u8),
            scales: Tensor3::filled(l_count, rows, packs_per_row, 0i32),
        },
    };
    let mut src_info = Tensor2::filled(l_count, rows, -1i32);
    let mut layout_range = Tensor2::filled(l_count, r, 0i64);
    // Running end of each local expert's filled rows: blocks go in ascending source order.
    let mut next_row = vec![0usize; l_count];

    for (s, inp) in inputs.iter().enumerate() {
        let mut counts = vec![0usize; l_count];
        if !params.is_masked(s) {
            for t in 0..inp.num_tokens() {
                for &e in inp.topk_idx.row(t) {
                    let Ok(e) = usize::try_from(e) else { continue };
                    if e / l_count != d {
                        continue;
                    }
                    let l = e % l_count;
                    let row = next_row[l] + counts[l];
                    counts[l] += 1;
                    src_info.set(l, row, t as i32);
                    match &mut recv_x {
                        LlRecvX::Bf16(x) => {
                            if let Activations::Bf16(src) = &inp.x {
                                x.row_mut(l, row).copy_from_slice(src.row(t));
                            }
                        }
                        LlRecvX::Fp8 { data, scales } => {
                            let (q, sc) = casts.get(s, t)?;
                            data.row_mut(l, row).copy_from_slice(q);
                            scales.row_mut(l, row).copy_from_slice(sc);
                        }
                        LlRecvX::Fp8Ue8m0 { data, scales } => {
                            let (q, sc) = casts.get(s, t)?;
                            data.row_mut(l, row).copy_from_slice(q);
                            scales.row_mut(l, row).copy_from_slice(&fp8::pack_ue8m0(sc));
                        }
                    }
                }
            }
        }
        for l in 0..l_count {
            // Both fit in 32 bits: at most R·N rows per expert (checked per source against N).
            layout_range.set(
                l,
                s,
                pack_layout_range(next_row[l] as u32, counts[l] as u32),
            );
            next_row[l] += counts[l];
        }
    }

    Ok(Some(LlDispatchOutput {
        recv_x,
        recv_count: next_row.iter().map(|&c| c as i32).collect(),
        handle: LlHandle {
            src_info,
            layout_range,
            num_max_dispatch_tokens_per_rank: shape.num_max_dispatch_tokens_per_rank,
            hidden: h,
            num_experts: params.num_experts,
        },
    }))
}

/// One received row without its position: `src_info`, data bits and scale bits.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LlCanonicalRow {
    /// Source token index.
    pub src_info: i32,
    /// Row data: FP8 bytes, or BF16 bits little-endian.
    pub data: Vec<u8>,
    /// One entry per 128 channels: f32 scale bits, or the UE8M0 byte; empty for BF16.
    pub scales: Vec<u32>,
}

/// One local expert's received rows, grouped by source and sorted.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LlCanonicalExpert {
    /// `packed_recv_count[l]`.
    pub count: i32,
    /// `per_source[s]`: the rows of source `s`'s block, sorted (by `src_info`, then bits, so
    /// duplicate rows of one token compare equal in any order).
    pub per_source: Vec<Vec<LlCanonicalRow>>,
}

/// A placement-free form of a receiver's dispatch outputs: two outputs are equivalent under
/// the spec's multiset semantics (§2.4) iff their canonical forms are equal. Begin offsets and
/// rows past the count are dropped.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LlCanonical {
    /// Format of the rows.
    pub format: LlFormat,
    /// Per local expert.
    pub experts: Vec<LlCanonicalExpert>,
}

impl LlCanonical {
    /// A short description of the first difference from `other`, or `None` if equal; for test
    /// failure messages that would otherwise print whole arrays.
    pub fn first_difference(&self, other: &Self) -> Option<String> {
        if self.format != other.format {
            return Some(format!("format {:?} vs {:?}", self.format, other.format));
        }
        if self.experts.len() != other.experts.len() {
            return Some(format!(
                "{} vs {} local experts",
                self.experts.len(),
                other.experts.len()
            ));
        }
        for (l, (a, b)) in self.experts.iter().zip(&other.experts).enumerate() {
            if a.count != b.count {
                return Some(format!(
                    "local expert {l}: count {} vs {}",
                    a.count, b.count
                ));
            }
            for (s, (ra, rb)) in a.per_source.iter().zip(&b.per_source).enumerate() {
                if ra.len() != rb.len() {
                    return Some(format!(
                        "local expert {l}, source {s}: {} vs {} rows",
                        ra.len(),
                        rb.len()
                    ));
                }
                for (i, (x, y)) in ra.iter().zip(rb).enumerate() {
                    if x != y {
                        return Some(format!(
                            "local expert {l}, source {s}, sorted row {i}: src_info {} vs {}, \
                             data equal: {}, scales {:?} vs {:?}",
                            x.src_info,
                            y.src_info,
                            x.data == y.data,
                            x.scales,
                            y.scales
                        ));
                    }
                }
            }
            if a.per_source.len() != b.per_source.len() {
                return Some(format!("local expert {l}: source counts differ"));
            }
        }
        None
    }
}

/// The canonical form of one receiver's outputs, checking that the layout is a valid packing:
/// every block inside `[0, R·N)`, blocks disjoint, tiling `[0, packed_recv_count[l])`.
pub fn canonicalize(out: &LlDispatchOutput) -> Result<LlCanonical> {
    let handle = &out.handle;
    let l_count = out.recv_x.num_local_experts();
    let r = handle.layout_range.cols();
    let rows = r * handle.num_max_dispatch_tokens_per_rank;
    let bad = |l: usize, s: usize, detail: String| Error::LlInvalidLayout {
        local_expert: l,
        source_rank: s,
        detail,
    };
    if handle.layout_range.rows() != l_count
        || out.recv_count.len() != l_count
        || handle.src_info.shape() != (l_count, rows)
    {
        return Err(bad(
            0,
            usize::MAX,
            format!(
                "shapes: layout_range {:?}, recv_count {}, src_info {:?} for {l_count} local \
                 experts and {rows} rows",
                handle.layout_range.shape(),
                out.recv_count.len(),
                handle.src_info.shape()
            ),
        ));
    }
    let mut experts = Vec::with_capacity(l_count);
    for l in 0..l_count {
        if out.recv_x.dims(l).map(|(n, _)| n) != Some(rows) {
            return Err(bad(
                l,
                usize::MAX,
                format!("packed_recv_x does not have {rows} rows"),
            ));
        }
        let count = out.recv_count[l];
        let Ok(count_rows) = usize::try_from(count) else {
            return Err(bad(l, usize::MAX, format!("negative count {count}")));
        };
        let mut blocks: Vec<(usize, usize, usize)> = (0..r)
            .map(|s| {
                // In range: the layout's shape was checked above.
                let (b, c) = handle.block(l, s).unwrap_or((0, 0));
                (b, c, s)
            })
            .collect();
        let total: usize = blocks.iter().map(|b| b.1).sum();
        if total != count_rows {
            return Err(bad(
                l,
                usize::MAX,
                format!("block counts sum to {total}, packed_recv_count is {count}"),
            ));
        }
        blocks.sort_unstable();
        let mut end = 0usize;
        for &(b, c, s) in blocks.iter().filter(|b| b.1 > 0) {
            if b < end || b + c > count_rows {
                return Err(bad(
                    l,
                    s,
                    format!(
                        "block [{b}, {}) overlaps another or passes the count {count}",
                        b + c
                    ),
                ));
            }
            end = b + c;
        }
        let mut per_source = vec![Vec::new(); r];
        for &(b, c, s) in &blocks {
            for row in b..b + c {
                let (data, scales) = out
                    .recv_x
                    .row_bits(l, row)
                    .ok_or_else(|| bad(l, s, format!("row {row} has malformed data or scales")))?;
                per_source[s].push(LlCanonicalRow {
                    src_info: handle.src_info.get(l, row),
                    data,
                    scales,
                });
            }
            per_source[s].sort_unstable();
        }
        experts.push(LlCanonicalExpert { count, per_source });
    }
    Ok(LlCanonical {
        format: out.recv_x.format(),
        experts,
    })
}

/// Runs an "expert" over a receiver's packed rows: `f(l, row_f32)` gives the BF16 output row of
/// each valid row (inputs as [`LlRecvX::row_f32`]); rows past the count are zero. The result is
/// the `[L, R·N, H]` combine input of spec §2.5.
pub fn map_rows(
    out: &LlDispatchOutput,
    mut f: impl FnMut(usize, &[f32]) -> Vec<bf16>,
) -> Result<Tensor3<bf16>> {
    let h = out.handle.hidden;
    let rows = out.handle.src_info.cols();
    let mut y = Tensor3::zeros(out.recv_count.len(), rows, h);
    for (l, &count) in out.recv_count.iter().enumerate() {
        for row in 0..usize::try_from(count).unwrap_or(0).min(rows) {
            let x = out
                .recv_x
                .row_f32(l, row)
                .ok_or_else(|| Error::LlInvalidLayout {
                    local_expert: l,
                    source_rank: usize::MAX,
                    detail: format!("row {row} is malformed"),
                })?;
            let v = f(l, &x);
            if v.len() != h {
                return Err(Error::ShapeMismatch {
                    what: "expert output row",
                    expected: format!("{h} values"),
                    found: format!("{} values", v.len()),
                });
            }
            y.row_mut(l, row).copy_from_slice(&v);
        }
    }
    Ok(y)
}

/// `acc[i] = fma(f32(y[i]), w, acc[i])` over the row (combine's accumulation, spec §2.5),
/// exactly rounded (`f32::mul_add`).
pub(crate) fn fma_row(acc: &mut [f32], y: &[bf16], w: f32) {
    for (a, v) in acc.iter_mut().zip(y) {
        *a = v.to_f32().mul_add(w, *a);
    }
}

/// Where each `(token, top-k entry)` of a combining rank reads its expert output.
struct RowLookup {
    /// `rows[owner][l][t]`: the lowest row of `(me, t)` in owner's block for `me`, if any.
    rows: Vec<Vec<Vec<Option<usize>>>>,
}

/// Validates combine's arguments and returns the shape (`H` from the handles).
fn validate_combine(
    inputs: &[RankInputs],
    handles: &[Option<LlHandle>],
    expert_out: &[Option<Tensor3<bf16>>],
    params: &LlParams,
) -> Result<LlShape> {
    let r = inputs.len();
    validate_params(r, params)?;
    for len in [handles.len(), expert_out.len()] {
        if len != r {
            return Err(Error::RankCountMismatch {
                expected: r,
                found: len,
            });
        }
    }
    let n = params.num_max_dispatch_tokens_per_rank;
    for (rank, inp) in inputs.iter().enumerate() {
        // Combine does not read x; topk_idx and topk_weights must agree.
        if inp.topk_weights.shape() != inp.topk_idx.shape() {
            return Err(Error::ShapeMismatch {
                what: "topk_weights versus topk_idx",
                expected: format!("{:?} (rank {rank})", inp.topk_idx.shape()),
                found: format!("{:?}", inp.topk_weights.shape()),
            });
        }
        validate_routing(&inp.topk_idx, params.num_experts, rank)?;
        validate_rank(&inp.shapes(), rank, n)?;
    }
    let l_count = params.num_experts / r;
    let rows = r * n;
    // Combine takes BF16 expert outputs whatever the dispatch format was; all-masked calls
    // have no handle and produce nothing, so any valid H will do.
    let hidden = handles
        .iter()
        .flatten()
        .map(|h| h.hidden)
        .next()
        .unwrap_or(LL_HIDDEN_MULTIPLE);
    validate_hidden(hidden, false)?;
    for owner in (0..r).filter(|&o| !params.is_masked(o)) {
        let (Some(h), Some(y)) = (&handles[owner], &expert_out[owner]) else {
            return Err(Error::ShapeMismatch {
                what: "combine handle / expert outputs",
                expected: format!("a handle and outputs for unmasked rank {owner}"),
                found: "None".into(),
            });
        };
        if h.num_max_dispatch_tokens_per_rank != n
            || h.num_experts != params.num_experts
            || h.hidden != hidden
            || h.src_info.shape() != (l_count, rows)
            || h.layout_range.shape() != (l_count, r)
        {
            return Err(Error::ShapeMismatch {
                what: "combine handle",
                expected: format!(
                    "N {n}, E {}, H {hidden}, src_info [{l_count}, {rows}], layout_range \
                     [{l_count}, {r}]",
                    params.num_experts
                ),
                found: format!(
                    "N {}, E {}, H {}, src_info {:?}, layout_range {:?} (rank {owner})",
                    h.num_max_dispatch_tokens_per_rank,
                    h.num_experts,
                    h.hidden,
                    h.src_info.shape(),
                    h.layout_range.shape()
                ),
            });
        }
        if y.shape() != (l_count, rows, hidden) {
            return Err(Error::ShapeMismatch {
                what: "combine expert outputs",
                expected: format!("[{l_count}, {rows}, {hidden}]"),
                found: format!("{:?} (rank {owner})", y.shape()),
            });
        }
    }
    Ok(LlShape {
        num_ranks: r,
        num_local_experts: l_count,
        hidden,
        num_max_dispatch_tokens_per_rank: n,
    })
}

fn row_lookup(me: usize, t_me: usize, handles: &[Option<LlHandle>], shape: LlShape) -> RowLookup {
    let rows = handles
        .iter()
        .map(|h| match h {
            None => Vec::new(),
            Some(h) => (0..shape.num_local_experts)
                .map(|l| {
                    let mut by_token = vec![None; t_me];
                    // Validated shapes: the block exists.
                    let (b, c) = h.block(l, me).unwrap_or((0, 0));
                    let end = (b + c).min(h.src_info.cols());
                    for row in b.min(end)..end {
                        if let Ok(t) = usize::try_from(h.src_info.get(l, row))
                            && t < t_me
                            && by_token[t].is_none()
                        {
                            by_token[t] = Some(row);
                        }
                    }
                    by_token
                })
                .collect(),
        })
        .collect();
    RowLookup { rows }
}

/// How [`combine_reduced_on_expert_rank`] carries each owner rank's partial sum back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PartialPrecision {
    /// Partials travel as f32 (one rounding at the end, like DeepEP but in another order).
    F32,
    /// Partials are rounded to BF16 before travelling (two roundings).
    Bf16,
    /// Partials are rounded to BF16, then travel LogFMT-10 encoded (spec §2.6, `use_logfmt`;
    /// [`crate::numerics::logfmt`]); the owner sums the decoded f32 values.
    LogFmt10,
}

/// Low-latency combine on every rank (spec §2.5): `out[me]` is `[T_me, H]` BF16, `None` if `me`
/// is masked. `expert_out[d]` is rank `d`'s `[L, R·N, H]` expert outputs in its packed layout,
/// `handles[d]` its dispatch handle (both `None` only for masked ranks); `inputs` supply each
/// rank's `topk_idx` and `topk_weights` (their `x` is not used).
pub fn combine(
    inputs: &[RankInputs],
    handles: &[Option<LlHandle>],
    expert_out: &[Option<Tensor3<bf16>>],
    params: &LlParams,
) -> Result<Vec<Option<Tensor2<bf16>>>> {
    combine_impl(inputs, handles, expert_out, params, None)
}

/// Combine with ep-rs's reduction order (DESIGN.md: "reduces a token's expert outputs on the
/// expert's rank"): for each owner rank `d` in ascending order, `p_d = Σ` over the token's
/// entries on `d` (in `k` order, FMA as in [`combine`]), optionally rounded to BF16 (and
/// LogFMT-10 encoded and decoded with `LogFmt10`); then `combined = bf16(Σ_d p_d)` with f32 adds
/// in ascending `d`. Differs from [`combine`] by rounding only: both are within a few f32 ulps of
/// each other before the final BF16 rounding with [`PartialPrecision::F32`], and within one BF16
/// rounding per owner with `Bf16`; `LogFmt10` adds LogFMT's per-value error to `Bf16`'s.
pub fn combine_reduced_on_expert_rank(
    inputs: &[RankInputs],
    handles: &[Option<LlHandle>],
    expert_out: &[Option<Tensor3<bf16>>],
    params: &LlParams,
    partials: PartialPrecision,
) -> Result<Vec<Option<Tensor2<bf16>>>> {
    combine_impl(inputs, handles, expert_out, params, Some(partials))
}

fn combine_impl(
    inputs: &[RankInputs],
    handles: &[Option<LlHandle>],
    expert_out: &[Option<Tensor3<bf16>>],
    params: &LlParams,
    partials: Option<PartialPrecision>,
) -> Result<Vec<Option<Tensor2<bf16>>>> {
    let shape = validate_combine(inputs, handles, expert_out, params)?;
    let (l_count, h) = (shape.num_local_experts, shape.hidden);
    let mut outs = Vec::with_capacity(inputs.len());
    for (me, inp) in inputs.iter().enumerate() {
        if params.is_masked(me) {
            outs.push(None);
            continue;
        }
        let lookup = row_lookup(me, inp.num_tokens(), handles, shape);
        let mut out = Tensor2::filled(inp.num_tokens(), h, bf16::ZERO);
        // Per owner partial sums (only used for the ep-rs order).
        let mut partial = vec![vec![0f32; h]; if partials.is_some() { inputs.len() } else { 0 }];
        let mut acc = vec![0f32; h];
        for t in 0..inp.num_tokens() {
            acc.iter_mut().for_each(|a| *a = 0.0);
            partial
                .iter_mut()
                .for_each(|p| p.iter_mut().for_each(|a| *a = 0.0));
            let mut touched = vec![false; partial.len()];
            for (k, &e) in inp.topk_idx.row(t).iter().enumerate() {
                let Ok(e) = usize::try_from(e) else { continue };
                let (owner, l) = (e / l_count, e % l_count);
                if params.is_masked(owner) {
                    continue;
                }
                let row = lookup.rows[owner][l][t].ok_or(Error::LlMissingRow {
                    rank: me,
                    token: t,
                    expert: e,
                    owner,
                })?;
                let w = inp.topk_weights.get(t, k);
                // Checked by validate_combine: unmasked owners have outputs.
                let y = expert_out[owner].as_ref().map(|y| y.row(l, row)).ok_or(
                    Error::LlMissingRow {
                        rank: me,
                        token: t,
                        expert: e,
                        owner,
                    },
                )?;
                let target = if partials.is_some() {
                    touched[owner] = true;
                    &mut partial[owner]
                } else {
                    &mut acc
                };
                fma_row(target, y, w);
            }
            if let Some(precision) = partials {
                for (p, _) in partial.iter().zip(&touched).filter(|(_, t)| **t) {
                    if precision == PartialPrecision::LogFmt10 {
                        let row: Vec<bf16> = p.iter().map(|&v| bf16::from_f32(v)).collect();
                        let decoded = logfmt::decode_row(&logfmt::encode_row(&row)?, h)?;
                        for (a, v) in acc.iter_mut().zip(decoded) {
                            *a += v;
                        }
                        continue;
                    }
                    for (a, &v) in acc.iter_mut().zip(p) {
                        let v = match precision {
                            PartialPrecision::Bf16 => bf16::from_f32(v).to_f32(),
                            PartialPrecision::F32 | PartialPrecision::LogFmt10 => v,
                        };
                        *a += v;
                    }
                }
            }
            for (o, &a) in out.row_mut(t).iter_mut().zip(&acc) {
                *o = bf16::from_f32(a);
            }
        }
        outs.push(Some(out));
    }
    Ok(outs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_arrays_allocate_exactly_what_they_hold() {
        // One block per array, of its size: no capacity past `L · rows · cols`, which would
        // be address space reserved and never used.
        let (l, rows, cols) = (3, 1024, 1536);
        assert_eq!(
            packed_zeros_u8(l, rows, cols).into_data().capacity(),
            l * rows * cols
        );
        assert_eq!(
            packed_zeros_bf16(l, rows, cols).into_data().capacity(),
            l * rows * cols
        );
        assert_eq!(
            packed_zeros_f32(l, rows, 12).into_data().capacity(),
            l * rows * 12
        );
        let z = packed_zeros_i32(l, rows, 3);
        assert!(z.data().iter().all(|&v| v == 0));
        assert_eq!(z.into_data().capacity(), l * rows * 3);
    }
}
