//! Normal-mode calls whose rows stay in the arena (docs/protocol.md §2.6): a dispatch that hands
//! back everything but `recv_x`, host reads of the received rows, host writes of expert outputs
//! over them, and a combine that pulls the expert outputs from the dispatch rows in place. This
//! is how the GPU backend works (no copy out of the arena); on the simulator it saves a copy of
//! every received row and a second region of the arena.

use half::bf16;

use super::{Buffer, NormalDispatchArgs};
use crate::error::{Error, Result};
use crate::executor::{CombineFrom, Executor, ExpertJob, Host, InArenaRows, Tensors};
use crate::plan::combine::CombineOutput;
use crate::plan::intranode::{InPlaceDispatch, IntranodeHandle};
use crate::plan::layout::DispatchLayout;
use crate::protocol::bytes::{put_bf16_row, put_f32s};
use crate::protocol::layout::RowFormat;
use crate::protocol::normal::{self, Expert, parse_x};
use crate::routing::{Activations, RankInputs};
use crate::tensor::Tensor2;

/// What the last in-place dispatch left in the arena.
#[derive(Clone, Debug)]
pub(super) struct InPlaceRows {
    /// The call that wrote them.
    pub(super) call: u64,
    pub(super) fmt: RowFormat,
    pub(super) with_topk: bool,
    /// Rows per rank.
    pub(super) rows: Vec<usize>,
}

/// Record bytes moved per host write.
const WRITE_CHUNK_BYTES: usize = 1 << 20;

impl<E: Executor<T = Host>> Buffer<E> {
    /// [`Buffer::dispatch`] with the received rows left in the arena (docs/protocol.md §2.6):
    /// the same outputs but `recv_x`, which stays readable with [`Buffer::read_recv_x`] until
    /// the next dispatch of any kind, and which [`Buffer::combine_in_place`] combines.
    pub fn dispatch_in_place(
        &mut self,
        inputs: &[RankInputs],
        layouts: &[DispatchLayout],
        num_experts: usize,
        args: &NormalDispatchArgs,
    ) -> Result<Vec<InPlaceDispatch>> {
        let out = self.run_dispatch(inputs, layouts, num_experts, args, true)?;
        self.in_place = Some(InPlaceRows {
            call: self.last_call,
            fmt: self.last_dispatch_fmt(inputs, args.with_topk),
            with_topk: args.with_topk,
            rows: out.iter().map(|(d, _)| d.num_rows).collect(),
        });
        Ok(out.into_iter().map(|(d, _)| d).collect())
    }

    /// The rows the last in-place dispatch left on `rank`, or a typed error saying why none are.
    fn in_place_rows(&self, rank: usize) -> Result<&InPlaceRows> {
        self.check_poison()?;
        let st = self.in_place.as_ref().ok_or_else(|| {
            Error::Unsupported(
                "no in-place rows: call Buffer::dispatch_in_place first (a later dispatch of \
                 another kind, or a reset, replaces them)"
                    .into(),
            )
        })?;
        if rank >= st.rows.len() {
            return Err(Error::RankOutOfRange {
                rank,
                num_ranks: st.rows.len(),
            });
        }
        Ok(st)
    }

    /// The format of the in-place rows, when `rows` lies within those of `rank`.
    fn checked_rows(&self, rank: usize, rows: &std::ops::Range<usize>) -> Result<RowFormat> {
        let st = self.in_place_rows(rank)?;
        if rows.end > st.rows[rank] || rows.start > rows.end {
            return Err(Error::ShapeMismatch {
                what: "rows read from the arena",
                expected: format!("rows within [0, {}) on rank {rank}", st.rows[rank]),
                found: format!("[{}, {})", rows.start, rows.end),
            });
        }
        Ok(st.fmt)
    }

    /// Reads rows `first .. first + out.num_tokens()` of `rank`'s `recv_x`, left in the arena
    /// by the last [`Buffer::dispatch_in_place`] (or overwritten since with
    /// [`Buffer::write_expert_x`]), into `out` (the dispatch's activation kind and hidden size).
    pub fn read_recv_x(&self, rank: usize, first: usize, out: &mut Activations) -> Result<()> {
        let st = self.in_place_rows(rank)?;
        let fmt = st.fmt;
        let n = out.num_tokens();
        let kind_ok = match out {
            Activations::Bf16(x) => fmt.elem_bytes == 2 && x.cols() == fmt.hidden,
            Activations::Fp8 { data, scales } => {
                fmt.elem_bytes == 1 && data.cols() == fmt.hidden && scales.cols() == fmt.num_scales
            }
        };
        if !kind_ok {
            return Err(Error::ShapeMismatch {
                what: "read_recv_x output (activation kind and hidden size of the dispatch)",
                expected: format!(
                    "{} rows of {} {}",
                    n,
                    fmt.hidden,
                    if fmt.elem_bytes == 2 {
                        "BF16"
                    } else {
                        "e4m3 + scales"
                    }
                ),
                found: format!(
                    "{} with {} columns",
                    if matches!(out, Activations::Bf16(_)) {
                        "BF16"
                    } else {
                        "FP8"
                    },
                    out.hidden()
                ),
            });
        }
        self.scan_recv_rows(rank, first..first + n, |j, rec| {
            parse_x(rec, j - first, fmt, out);
        })
    }

    /// Calls `f(j, record)` for each row `j` in `rows` of `rank`'s `recv_x` left in the arena,
    /// in order: `record` starts with the row's x bytes (BF16 little-endian bits, or e4m3 bytes
    /// followed at `RowFormat::scales_offset` by the f32 scales), as docs/protocol.md §2.1 lays
    /// out a dispatch record. Without copying where the transport lends its memory
    /// ([`Transport::visit_local`]; a record split between two of its pieces is joined in a
    /// small buffer), and through `&self`, so that several host threads may scan different
    /// ranks at once.
    ///
    /// [`Transport::visit_local`]: crate::transport::Transport::visit_local
    pub fn scan_recv_rows(
        &self,
        rank: usize,
        rows: std::ops::Range<usize>,
        mut f: impl FnMut(usize, &[u8]),
    ) -> Result<()> {
        let drec = self.checked_rows(rank, &rows)?.dispatch_record() as usize;
        let arena = self.normal_arena()?;
        let at = arena.data.at(arena
            .data_layout()
            .dispatch_row(rows.start as u64, drec as u64));
        let mut j = rows.start;
        let mut carry: Vec<u8> = Vec::with_capacity(drec);
        self.transport.visit_local(
            rank,
            at,
            (rows.len() * drec) as u64,
            &mut |mut piece: &[u8]| {
                if !carry.is_empty() {
                    let take = (drec - carry.len()).min(piece.len());
                    carry.extend_from_slice(&piece[..take]);
                    piece = &piece[take..];
                    if carry.len() == drec {
                        f(j, &carry);
                        j += 1;
                        carry.clear();
                    }
                }
                let whole = piece.len() / drec * drec;
                for rec in piece[..whole].chunks_exact(drec) {
                    f(j, rec);
                    j += 1;
                }
                carry.extend_from_slice(&piece[whole..]);
            },
        )
    }

    /// Overwrites rows `first .. first + y.rows()` of `rank`'s `recv_x` in the arena with
    /// expert outputs `y` (BF16, the dispatch's hidden size), the input of the next
    /// [`Buffer::combine_in_place`]. Needs BF16 dispatch rows (an FP8 row has no room for a
    /// BF16 output: use [`Buffer::combine`]).
    pub fn write_expert_x(&mut self, rank: usize, first: usize, y: &Tensor2<bf16>) -> Result<()> {
        let st = self.in_place_rows(rank)?;
        let fmt = st.fmt;
        Self::check_bf16_rows(fmt)?;
        if y.cols() != fmt.hidden || first + y.rows() > st.rows[rank] {
            return Err(Error::ShapeMismatch {
                what: "write_expert_x rows",
                expected: format!(
                    "rows within [0, {}) of {} columns on rank {rank}",
                    st.rows[rank], fmt.hidden
                ),
                found: format!("[{first}, {}) of {} columns", first + y.rows(), y.cols()),
            });
        }
        let arena = self.normal_arena()?.clone();
        let data = arena.data_layout();
        let drec = fmt.dispatch_record();
        let mut row = vec![0u8; 2 * fmt.hidden];
        for i in 0..y.rows() {
            put_bf16_row(&mut row, y.row(i));
            let at = arena.data.at(data.dispatch_row((first + i) as u64, drec));
            self.transport.write_local(rank, at, &row)?;
        }
        Ok(())
    }

    fn check_bf16_rows(fmt: RowFormat) -> Result<()> {
        if fmt.elem_bytes != 2 {
            return Err(Error::Unsupported(
                "in-place combine reads BF16 rows, and these dispatch rows are FP8: dequantise \
                 into a tensor and call Buffer::combine"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Normal combine of the expert outputs left in the arena (docs/protocol.md §2.6): row `j`
    /// of rank `d`'s last [`Buffer::dispatch_in_place`] (or what [`Buffer::write_expert_x`]
    /// wrote over it) with its dispatched top-k weights; `bias[s]` are rank `s`'s 0–2 biases
    /// (`[T_s, H]`, may be empty for every rank). Equals [`Buffer::combine`] with `x` = those
    /// rows and `topk_weights` = the dispatch's `recv_topk_weights` (when dispatched).
    pub fn combine_in_place(
        &mut self,
        handles: &[IntranodeHandle],
        bias: &[&[Tensor2<bf16>]],
    ) -> Result<Vec<CombineOutput>> {
        let st = self.check_in_place_combine(handles, bias)?;
        Self::check_bf16_rows(st.fmt)?;
        let k = if st.with_topk { st.fmt.num_topk } else { 0 };
        let source = normal::CombineSource::DispatchRows { fmt: st.fmt, bias };
        self.run_combine(
            handles,
            CombineFrom::InArena(InArenaRows(source)),
            (st.fmt.hidden, k),
            st.with_topk,
        )
    }

    /// The combine-row format that goes with the last in-place dispatch: BF16 rows of its
    /// hidden size and room for its `K` weights (docs/protocol.md §2.1, §2.6).
    fn combine_rows_format(st: &InPlaceRows) -> RowFormat {
        RowFormat {
            hidden: st.fmt.hidden,
            elem_bytes: 2,
            num_scales: 0,
            num_topk: st.fmt.num_topk,
        }
    }

    /// Writes expert outputs `y` (BF16 `[n, H]`, the dispatch's hidden size) and, optionally,
    /// their weights (`[n, K]`, the dispatch's `K`) as rows `first .. first + n` of `rank`'s
    /// combine rows (docs/protocol.md §2.1): the expert GEMM writing its output into the
    /// buffer, which [`Buffer::combine_from_rows`] then combines. Works for FP8 dispatches too
    /// (the combine rows are BF16 whatever the dispatch format).
    pub fn write_combine_rows(
        &mut self,
        rank: usize,
        first: usize,
        y: &Tensor2<bf16>,
        weights: Option<&Tensor2<f32>>,
    ) -> Result<()> {
        let st = self.in_place_rows(rank)?;
        let fmt = Self::combine_rows_format(st);
        let n = y.rows();
        let k_ok = weights.is_none_or(|w| w.shape() == (n, fmt.num_topk) && st.with_topk);
        if y.cols() != fmt.hidden || first + n > st.rows[rank] || !k_ok {
            return Err(Error::ShapeMismatch {
                what: "write_combine_rows rows and weights",
                expected: format!(
                    "rows within [0, {}) of {} columns on rank {rank}, weights of {} columns \
                     (only when top-k was dispatched)",
                    st.rows[rank], fmt.hidden, fmt.num_topk
                ),
                found: format!(
                    "[{first}, {}) of {} columns, weights {:?}",
                    first + n,
                    y.cols(),
                    weights.map(Tensor2::shape)
                ),
            });
        }
        let arena = self.normal_arena()?.clone();
        let data = arena.data_layout();
        let yrec = fmt.combine_record() as usize;
        Self::check_capacity(&arena, st.rows[rank], yrec as u64, false)?;
        let wo = crate::protocol::layout::align16(2 * fmt.hidden as u64) as usize;
        let chunk = (WRITE_CHUNK_BYTES / yrec).clamp(1, n.max(1));
        let mut buf = Vec::with_capacity(chunk * yrec);
        let mut res = Ok(());
        for c0 in (0..n).step_by(chunk) {
            let m = chunk.min(n - c0);
            buf.clear();
            buf.resize(m * yrec, 0);
            for (i, rec) in buf.chunks_exact_mut(yrec).enumerate() {
                put_bf16_row(rec, y.row(c0 + i));
                if let Some(w) = weights {
                    put_f32s(&mut rec[wo..], w.row(c0 + i));
                }
            }
            let at = arena
                .data
                .at(data.combine_row((first + c0) as u64, yrec as u64));
            res = self.transport.write_local(rank, at, &buf);
            if res.is_err() {
                break;
            }
        }
        res
    }

    /// Runs `expert` over every row the last in-place dispatch left on every rank — as a phase,
    /// one agent per rank, a chunk of rows at a time (`expert(rank, first_row, rows, outputs)`,
    /// rows as dispatched, BF16 or FP8 with scales; one BF16 output row per row) — and stores
    /// the outputs, with the rows' dispatched weights, in the combine rows for
    /// [`Buffer::combine_from_rows`] (docs/protocol.md §2.6). The expert GEMM reading `recv_x`
    /// in place and writing into the buffer; on the simulator it runs on every core. An error
    /// of `expert` fails the phase (and poisons the buffer, as any failed phase does).
    pub fn apply_expert(&mut self, expert: &Expert) -> Result<()> {
        let st = self.in_place_rows(0)?.clone();
        let arena = self.normal_arena()?.clone();
        let out = Self::combine_rows_format(&st);
        let max = st.rows.iter().copied().max().unwrap_or(0);
        Self::check_capacity(&arena, max, out.combine_record(), false)?;
        let call = self.next_call();
        let job = ExpertJob {
            arena,
            call,
            fmt: st.fmt,
            out,
            rows: &st.rows,
            with_topk: st.with_topk,
            expert,
        };
        let res = self.transport.run_expert(&job);
        self.ran(call, res)?;
        Ok(())
    }

    /// Normal combine of the expert outputs the host wrote into the combine rows with
    /// [`Buffer::write_combine_rows`] (every row of every rank, after the last in-place
    /// dispatch), their weights read when `with_weights`; `bias` as in
    /// [`Buffer::combine_in_place`]. Equals [`Buffer::combine`] of the same outputs.
    pub fn combine_from_rows(
        &mut self,
        handles: &[IntranodeHandle],
        bias: &[&[Tensor2<bf16>]],
        with_weights: bool,
    ) -> Result<Vec<CombineOutput>> {
        let st = self.check_in_place_combine(handles, bias)?;
        if with_weights && !st.with_topk {
            return Err(Error::Unsupported(
                "combine_from_rows with weights after a dispatch without top-k".into(),
            ));
        }
        let fmt = Self::combine_rows_format(&st);
        let source = normal::CombineSource::CombineRows { fmt, bias };
        let k = if with_weights { fmt.num_topk } else { 0 };
        self.run_combine(
            handles,
            CombineFrom::InArena(InArenaRows(source)),
            (fmt.hidden, k),
            with_weights,
        )
    }

    /// The checks both in-place combines share: rank counts, handles that match the last
    /// in-place dispatch's rows, 0–2 biases of `[T_s, H]`; returns that dispatch's state.
    fn check_in_place_combine(
        &self,
        handles: &[IntranodeHandle],
        bias: &[&[Tensor2<bf16>]],
    ) -> Result<InPlaceRows> {
        let st = self.in_place_rows(0)?.clone();
        self.check_local(&[handles.len(), bias.len()])?;
        for (s, (h, b)) in handles.iter().zip(bias).enumerate() {
            if h.recv_src_idx.len() != st.rows[s] {
                return Err(crate::plan::intranode::handle_mismatch(
                    s,
                    format!(
                        "in-place combine: the handle has {} rows, the last in-place dispatch \
                         (call {}) left {}",
                        h.recv_src_idx.len(),
                        st.call,
                        st.rows[s]
                    ),
                ));
            }
            if b.len() > 2 {
                return Err(Error::TooManyBiases {
                    rank: s,
                    found: b.len(),
                });
            }
            for x in *b {
                if x.shape() != (h.send_head.rows(), st.fmt.hidden) {
                    return Err(Error::ShapeMismatch {
                        what: "combine bias",
                        expected: format!(
                            "({}, {}) on rank {s}",
                            h.send_head.rows(),
                            st.fmt.hidden
                        ),
                        found: format!("{:?}", x.shape()),
                    });
                }
            }
        }
        let shapes = handles
            .iter()
            .enumerate()
            .map(|(s, h)| Host::handle_shapes(h, s))
            .collect::<Result<Vec<_>>>()?;
        self.check_combine_handles(handles, &shapes, &st.rows)?;
        Ok(st)
    }

    /// The row format of an in-place dispatch of `inputs` (checked by it).
    fn last_dispatch_fmt(&self, inputs: &[RankInputs], with_topk: bool) -> RowFormat {
        let mut fmt = crate::executor::tensors::row_format(&inputs[0].shapes());
        fmt.num_topk = if with_topk {
            inputs[0].topk_idx.cols()
        } else {
            0
        };
        fmt
    }
}
