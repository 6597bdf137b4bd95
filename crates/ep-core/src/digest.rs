//! Canonical digests of dispatch and combine outputs: one BLAKE3 hash per rank and one over the
//! run, equal for equal *semantics* (spec §2), whatever backend, machine or legal placement
//! produced them — the simulator and a GPU run of the same inputs must give the same digest,
//! run after run (DeepEP's tests compare `hash_tensor` across repeats the same way).
//!
//! # Canonical form
//!
//! What a backend may legally do differently is left out; everything the spec defines is in.
//!
//! Normal mode (intranode, spec §2.2), rank `d`, `n` = rows actually received
//! (`handle.num_recv_tokens`):
//! - `recv_x` rows `0..n` only: worst-token padding (`num_worst_tokens > 0`, spec §1.8) is
//!   garbage in DeepEP and excluded; FP8 as raw e4m3 bytes plus the scales;
//! - `recv_topk_idx`, `recv_topk_weights` rows `0..n` (when top-k was passed);
//! - `num_recv_tokens_per_expert_list` (empty with worst-token sizing);
//! - `rank_prefix_matrix` column `d` only (the only column DeepEP defines on rank `d`);
//! - `channel_prefix_matrix`, `recv_channel_prefix_matrix`, `recv_src_idx` rows `0..n`;
//! - `send_head` with every negative entry read as `-1`: dispatch returns `-1` for "not sent",
//!   combine rewrites those entries in place to other negative values (spec §3.4, §7.1), so the
//!   digest is the same before and after a combine;
//! - `combined_x` and `combined_topk_weights` (when given).
//!
//! Low-latency mode (spec §2.4, §2.5), rank `d`: a masked rank is the tag `masked` alone;
//! otherwise the canonical form of [`crate::plan::low_latency::canonicalize`] — the format, then
//! per local expert its `packed_recv_count` and, per source rank, the **multiset** of its rows
//! (`src_info`, data bits, scale bits; sorted), so block offsets (`layout_range` begins), the
//! order of rows inside a block and rows past the count are all excluded — then `combined_x`.
//!
//! Floats are hashed by their bit patterns (BF16 as `u16`, f32 as `u32`), never by value.
//!
//! # Byte format, version [`FORMAT_VERSION`] = 2
//!
//! Version 2 is version 1's byte stream under `v2` tags, hashed with BLAKE3 (256-bit output)
//! instead of SHA-256: three times faster on the same core, which matters when a run digests
//! gigabytes of received rows.
//!
//! All integers little-endian. A rank digest is BLAKE3 of:
//! 1. the ASCII tag `ep-rs/outputs/v2/`, the mode tag (`normal-intranode` or `low-latency`),
//!    a `0` byte, the rank as `u64`;
//! 2. then fields in the order listed above. A field is its name (`u8` length + ASCII bytes),
//!    then either `0xff` (absent: no top-k, no combine) or its number of dimensions (`u8`), each
//!    dimension as `u64`, and its elements row-major: `i32`/`i64` as themselves, f32 and BF16 by
//!    their bits, bytes as they are.
//!
//!    Low-latency outputs start with a field `format` of dimensions `[L]` holding one byte
//!    (`0` BF16, `1` FP8 with f32 scales, `2` FP8 with UE8M0 scales); then, per local expert, a
//!    field `expert` of dimensions `[R]` holding its `i32` count, followed, per source, by the
//!    `u64` row count and per sorted row: `src_info` (`i32`), data length (`u64`) and bytes,
//!    scale count (`u64`) and one `u32` each.
//!
//! The run digest is BLAKE3 of `ep-rs/outputs/v2/total/`, the mode tag, a `0` byte, the rank
//! count as `u64`, and the rank digests' 32 bytes in rank order.
//!
//! Any change to this format bumps [`FORMAT_VERSION`] and the tags; the golden digest in
//! `tests/digest.rs` pins it.

use std::fmt;

use half::bf16;

use crate::error::{Error, Result};
use crate::plan::combine::CombineOutput;
use crate::plan::intranode::{InPlaceDispatch, IntranodeDispatch};
use crate::plan::low_latency::{LlDispatchOutput, LlFormat, canonicalize};
use crate::routing::Activations;
use crate::tensor::Tensor2;

/// Version of the canonical byte format above; recorded next to every digest.
pub const FORMAT_VERSION: u32 = 2;

/// Mode tag of normal-mode intranode outputs.
const NORMAL: &str = "normal-intranode";
/// Mode tag of low-latency outputs.
const LOW_LATENCY: &str = "low-latency";

/// A 256-bit BLAKE3 digest; prints as 64 lowercase hex digits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Digest(pub [u8; 32]);

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// The digests of a run: one per rank (rank order) and the total over them.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RunDigest {
    /// Per-rank digests.
    pub ranks: Vec<Digest>,
    /// Digest of the whole run (mode, rank count, rank digests).
    pub total: Digest,
}

/// Feeds the canonical byte format into BLAKE3, through a buffer: elements are encoded into it
/// and hashed 64 KiB at a time (one `update` per element costs several times the hashing).
struct Writer {
    hash: blake3::Hasher,
    buf: Vec<u8>,
}

/// Bytes buffered before hashing.
const WRITER_BUF: usize = 1 << 16;

impl Writer {
    fn new(tag: &str, mode: &str, index: u64) -> Self {
        let mut w = Self {
            hash: blake3::Hasher::new(),
            buf: Vec::with_capacity(WRITER_BUF),
        };
        w.bytes(tag.as_bytes());
        w.bytes(mode.as_bytes());
        w.bytes(&[0u8]);
        w.u64(index);
        w
    }

    fn flush(&mut self) {
        self.hash.update(&self.buf);
        self.buf.clear();
    }

    fn bytes(&mut self, b: &[u8]) {
        if self.buf.len() + b.len() > WRITER_BUF {
            self.flush();
        }
        if b.len() >= WRITER_BUF {
            self.hash.update(b);
        } else {
            self.buf.extend_from_slice(b);
        }
    }

    /// Encodes `v` with `enc` (`N` bytes each), a buffer's worth at a time.
    fn elements<T: Copy, const N: usize>(&mut self, v: &[T], enc: impl Fn(T) -> [u8; N]) {
        for chunk in v.chunks(WRITER_BUF / N) {
            if self.buf.len() + chunk.len() * N > WRITER_BUF {
                self.flush();
            }
            let start = self.buf.len();
            self.buf.resize(start + chunk.len() * N, 0);
            for (o, &x) in self.buf[start..].chunks_exact_mut(N).zip(chunk) {
                o.copy_from_slice(&enc(x));
            }
        }
    }

    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }

    fn header(&mut self, name: &str, dims: &[usize]) {
        self.bytes(&[name.len() as u8]);
        self.bytes(name.as_bytes());
        self.bytes(&[dims.len() as u8]);
        for &d in dims {
            self.u64(d as u64);
        }
    }

    fn absent(&mut self, name: &str) {
        self.bytes(&[name.len() as u8]);
        self.bytes(name.as_bytes());
        self.bytes(&[0xffu8]);
    }

    fn i32s(&mut self, name: &str, dims: &[usize], v: impl IntoIterator<Item = i32>) {
        self.header(name, dims);
        for x in v {
            self.bytes(&x.to_le_bytes());
        }
    }

    fn i32_slice(&mut self, name: &str, dims: &[usize], v: &[i32]) {
        self.header(name, dims);
        self.elements(v, i32::to_le_bytes);
    }

    fn i64s(&mut self, name: &str, dims: &[usize], v: &[i64]) {
        self.header(name, dims);
        self.elements(v, i64::to_le_bytes);
    }

    fn f32s(&mut self, name: &str, dims: &[usize], v: &[f32]) {
        self.header(name, dims);
        self.elements(v, |x: f32| x.to_bits().to_le_bytes());
    }

    fn bf16s(&mut self, name: &str, dims: &[usize], v: &[bf16]) {
        self.header(name, dims);
        self.elements(v, |x: bf16| x.to_bits().to_le_bytes());
    }

    fn finish(mut self) -> Digest {
        self.flush();
        Digest(*self.hash.finalize().as_bytes())
    }
}

/// First `n` rows of a tensor's data (`n` checked by the caller).
fn head<T>(t: &Tensor2<T>, n: usize) -> &[T] {
    &t.data()[..n * t.cols()]
}

fn check_rows(rank: usize, what: &'static str, rows: usize, n: usize) -> Result<()> {
    if rows < n {
        return Err(Error::ShapeMismatch {
            what,
            expected: format!("at least {n} rows (received count on rank {rank})"),
            found: format!("{rows} rows"),
        });
    }
    Ok(())
}

/// Digest of rank `rank`'s normal-mode (intranode) outputs: its dispatch and, when given, its
/// combine. `rank` selects the defined column of `rank_prefix_matrix`.
pub fn normal_rank(
    rank: usize,
    dispatch: &IntranodeDispatch,
    combine: Option<&CombineOutput>,
) -> Result<Digest> {
    let h = &dispatch.handle;
    let n = h.num_recv_tokens;
    let r = h.rank_prefix_matrix.rows();
    if rank >= h.rank_prefix_matrix.cols() {
        return Err(Error::RankOutOfRange { rank, num_ranks: r });
    }
    let mut w = Writer::new("ep-rs/outputs/v2/", NORMAL, rank as u64);
    match &dispatch.recv_x {
        Activations::Bf16(x) => {
            check_rows(rank, "recv_x", x.rows(), n)?;
            w.bf16s("recv_x", &[n, x.cols()], head(x, n));
        }
        Activations::Fp8 { data, scales } => {
            check_rows(rank, "recv_x", data.rows(), n)?;
            check_rows(rank, "recv_x_scales", scales.rows(), n)?;
            w.header("recv_x_fp8", &[n, data.cols()]);
            w.bytes(head(data, n));
            w.f32s("recv_x_scales", &[n, scales.cols()], head(scales, n));
        }
    }
    normal_rest(w, rank, &InPlaceDispatch::of(dispatch), combine)
}

/// The digest of one rank's normal-mode outputs fed row by row: for BF16 rows that stay in a
/// buffer's arena ([`crate::Buffer::scan_recv_rows`]); equal to [`normal_rank`] of the same
/// outputs.
pub struct NormalRankStream {
    rank: usize,
    rows: usize,
    cols: usize,
    /// FP8 rows: the scales per row (kept, in order, for the field after the data), `None` for
    /// BF16.
    scales: Option<(usize, Vec<u8>)>,
    fed: usize,
    w: Writer,
}

impl NormalRankStream {
    /// Starts the digest of `rank` whose BF16 `recv_x` has `rows` rows (`num_recv_tokens`: the
    /// digest covers no tail row) of `cols` columns.
    #[must_use]
    pub fn bf16(rank: usize, rows: usize, cols: usize) -> Self {
        let mut w = Writer::new("ep-rs/outputs/v2/", NORMAL, rank as u64);
        w.header("recv_x", &[rows, cols]);
        Self {
            rank,
            rows,
            cols,
            scales: None,
            fed: 0,
            w,
        }
    }

    /// Starts the digest of `rank` whose FP8 `recv_x` has `rows` rows of `cols` e4m3 bytes and
    /// `num_scales` f32 scales each.
    #[must_use]
    pub fn fp8(rank: usize, rows: usize, cols: usize, num_scales: usize) -> Self {
        let mut w = Writer::new("ep-rs/outputs/v2/", NORMAL, rank as u64);
        w.header("recv_x_fp8", &[rows, cols]);
        Self {
            rank,
            rows,
            cols,
            scales: Some((num_scales, Vec::with_capacity(rows * num_scales * 4))),
            fed: 0,
            w,
        }
    }

    /// Feeds the next row as its dispatch record (docs/protocol.md §2.1): BF16 — its `2·cols`
    /// bytes of little-endian bits (the rest is ignored); FP8 — its `cols` e4m3 bytes, and the
    /// little-endian f32 scales at the record's scales offset (`a16(cols)`).
    pub fn row(&mut self, record: &[u8]) {
        match &mut self.scales {
            None => self.w.bytes(&record[..2 * self.cols]),
            Some((s, kept)) => {
                self.w.bytes(&record[..self.cols]);
                let so = crate::protocol::layout::align16(self.cols as u64) as usize;
                kept.extend_from_slice(&record[so..so + 4 * *s]);
            }
        }
        self.fed += 1;
    }

    /// The digest, with everything of the dispatch but `recv_x` and the combine; an error when
    /// the rows fed are not `rows` or `rows` is not the dispatch's `num_recv_tokens`.
    pub fn finish(
        mut self,
        dispatch: &InPlaceDispatch,
        combine: Option<&CombineOutput>,
    ) -> Result<Digest> {
        let n = dispatch.handle.num_recv_tokens;
        if self.fed != self.rows || self.rows != n {
            return Err(Error::ShapeMismatch {
                what: "recv_x rows fed to the digest",
                expected: format!("{n} rows (received count on rank {})", self.rank),
                found: format!("{} rows announced, {} fed", self.rows, self.fed),
            });
        }
        if let Some((s, kept)) = self.scales.take() {
            self.w.header("recv_x_scales", &[n, s]);
            self.w.bytes(&kept);
        }
        normal_rest(self.w, self.rank, dispatch, combine)
    }
}

/// Everything of a rank's normal-mode digest after `recv_x`.
fn normal_rest(
    mut w: Writer,
    rank: usize,
    dispatch: &InPlaceDispatch,
    combine: Option<&CombineOutput>,
) -> Result<Digest> {
    let h = &dispatch.handle;
    let n = h.num_recv_tokens;
    let r = h.rank_prefix_matrix.rows();
    match &dispatch.recv_topk_idx {
        Some(t) => {
            check_rows(rank, "recv_topk_idx", t.rows(), n)?;
            w.i64s("recv_topk_idx", &[n, t.cols()], head(t, n));
        }
        None => w.absent("recv_topk_idx"),
    }
    match &dispatch.recv_topk_weights {
        Some(t) => {
            check_rows(rank, "recv_topk_weights", t.rows(), n)?;
            w.f32s("recv_topk_weights", &[n, t.cols()], head(t, n));
        }
        None => w.absent("recv_topk_weights"),
    }
    let list = &dispatch.num_recv_tokens_per_expert_list;
    w.i32s(
        "num_recv_tokens_per_expert_list",
        &[list.len()],
        list.iter().copied(),
    );
    w.i32s(
        "rank_prefix_matrix[:, rank]",
        &[r],
        (0..r).map(|i| h.rank_prefix_matrix.get(i, rank)),
    );
    for (name, m) in [
        ("channel_prefix_matrix", &h.channel_prefix_matrix),
        ("recv_channel_prefix_matrix", &h.recv_channel_prefix_matrix),
    ] {
        w.i32_slice(name, &[m.rows(), m.cols()], m.data());
    }
    check_rows(rank, "recv_src_idx", h.recv_src_idx.len(), n)?;
    w.i32_slice("recv_src_idx", &[n], &h.recv_src_idx[..n]);
    let sh = &h.send_head;
    w.i32s(
        "send_head",
        &[sh.rows(), sh.cols()],
        sh.data().iter().map(|&v| v.max(-1)),
    );
    match combine {
        Some(c) => {
            let x = &c.combined_x;
            w.bf16s("combined_x", &[x.rows(), x.cols()], x.data());
            match &c.combined_topk_weights {
                Some(t) => w.f32s("combined_topk_weights", &[t.rows(), t.cols()], t.data()),
                None => w.absent("combined_topk_weights"),
            }
        }
        None => {
            w.absent("combined_x");
            w.absent("combined_topk_weights");
        }
    }
    Ok(w.finish())
}

/// Digests of every rank's normal-mode outputs; `combine` is empty (dispatch only) or one per
/// rank.
pub fn normal(dispatch: &[IntranodeDispatch], combine: &[CombineOutput]) -> Result<RunDigest> {
    if !combine.is_empty() && combine.len() != dispatch.len() {
        return Err(Error::RankCountMismatch {
            expected: dispatch.len(),
            found: combine.len(),
        });
    }
    let ranks = per_rank(dispatch.len(), |r| {
        normal_rank(r, &dispatch[r], combine.get(r))
    })?;
    Ok(total(NORMAL, ranks))
}

/// The run digest of per-rank normal-mode digests ([`normal_rank`], rank order): what
/// [`normal`] returns, for callers that digest one rank at a time.
#[must_use]
pub fn normal_total(ranks: Vec<Digest>) -> RunDigest {
    total(NORMAL, ranks)
}

/// Digest of rank `rank`'s low-latency outputs: its dispatch (`None` = masked rank) and, when
/// given, its `combined_x`.
pub fn low_latency_rank(
    rank: usize,
    dispatch: Option<&LlDispatchOutput>,
    combined_x: Option<&Tensor2<bf16>>,
) -> Result<Digest> {
    let mut w = Writer::new("ep-rs/outputs/v2/", LOW_LATENCY, rank as u64);
    let Some(out) = dispatch else {
        w.absent("masked");
        return Ok(w.finish());
    };
    let canon = canonicalize(out)?;
    let format: u8 = match canon.format {
        LlFormat::Bf16 => 0,
        LlFormat::Fp8 => 1,
        LlFormat::Fp8Ue8m0 => 2,
    };
    w.header("format", &[canon.experts.len()]);
    w.bytes(&[format]);
    for e in &canon.experts {
        w.i32s("expert", &[e.per_source.len()], [e.count]);
        for rows in &e.per_source {
            w.u64(rows.len() as u64);
            for row in rows {
                w.bytes(&row.src_info.to_le_bytes());
                w.u64(row.data.len() as u64);
                w.bytes(&row.data);
                w.u64(row.scales.len() as u64);
                for s in &row.scales {
                    w.bytes(&s.to_le_bytes());
                }
            }
        }
    }
    match combined_x {
        Some(x) => w.bf16s("combined_x", &[x.rows(), x.cols()], x.data()),
        None => w.absent("combined_x"),
    }
    Ok(w.finish())
}

/// Digests of every rank's low-latency outputs (`None` = masked rank); `combined_x` is empty
/// (dispatch only) or one per rank.
pub fn low_latency(
    dispatch: &[Option<LlDispatchOutput>],
    combined_x: &[Option<Tensor2<bf16>>],
) -> Result<RunDigest> {
    if !combined_x.is_empty() && combined_x.len() != dispatch.len() {
        return Err(Error::RankCountMismatch {
            expected: dispatch.len(),
            found: combined_x.len(),
        });
    }
    let ranks = per_rank(dispatch.len(), |r| {
        low_latency_rank(
            r,
            dispatch[r].as_ref(),
            combined_x.get(r).and_then(Option::as_ref),
        )
    })?;
    Ok(total(LOW_LATENCY, ranks))
}

/// `f(0..n)` on all cores (rank digests are independent; the result is in rank order, so the
/// same whatever the thread count).
fn per_rank(n: usize, f: impl Fn(usize) -> Result<Digest> + Sync) -> Result<Vec<Digest>> {
    let threads = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .clamp(1, n.max(1));
    if threads == 1 {
        return (0..n).map(f).collect();
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let (f, next) = (&f, &next);
    let work = move || {
        let mut mine = Vec::new();
        loop {
            let r = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if r >= n {
                return mine;
            }
            mine.push((r, f(r)));
        }
    };
    let mut out: Vec<Option<Result<Digest>>> = (0..n).map(|_| None).collect();
    std::thread::scope(|s| {
        // The caller takes ranks too: ranks of a thread the system refuses are still digested.
        let workers: Vec<_> = (1..threads)
            .filter_map(|_| std::thread::Builder::new().spawn_scoped(s, work).ok())
            .collect();
        for (r, d) in work() {
            out[r] = Some(d);
        }
        for w in workers {
            for (r, d) in w.join().unwrap_or_else(|p| std::panic::resume_unwind(p)) {
                out[r] = Some(d);
            }
        }
    });
    // Every rank below n was taken by exactly one worker (the counter hands each out once).
    out.into_iter().flatten().collect()
}

fn total(mode: &str, ranks: Vec<Digest>) -> RunDigest {
    let mut w = Writer::new("ep-rs/outputs/v2/total/", mode, ranks.len() as u64);
    for d in &ranks {
        w.bytes(&d.0);
    }
    RunDigest {
        total: w.finish(),
        ranks,
    }
}
