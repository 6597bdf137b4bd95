//! `get_dispatch_layout`, the dispatch and the cached dispatch of a [`NormalGroup`]
//! (docs/protocol.md §2.3, §2.4): checks, launches, and the host's wait for `num_recv`.

use std::time::{Duration, Instant};

use ep_core::plan::intranode::DispatchOptions;
use ep_core::protocol::layout::RowFormat;
use ep_core::routing::InputShapes;

use super::launch::Kernel;
use super::types::{GpuDispatch, GpuDispatchArgs, GpuHandle, GpuLayout, GpuRankInputs};
use super::{LastDispatch, MAX_TOPK, NormalGroup, THREADS, check_device, check_rank_count};
use crate::error::{Error, Result};
use crate::gpu::abi::{self, Mailbox};
use crate::gpu::device::stream_fault;
use crate::gpu::tensor::{DType, DevTensor};

/// What a dispatch's checks settled ([`NormalGroup::check_dispatch`]).
pub(crate) struct DispatchChecked {
    r: usize,
    n: usize,
    with_topk: bool,
    l: usize,
    fmt: RowFormat,
    tokens: Vec<usize>,
    drec: u64,
    cap: u64,
    c: usize,
}

/// What a cached dispatch's checks settled ([`NormalGroup::check_cached`]).
pub(crate) struct CachedChecked {
    n: usize,
    fmt: RowFormat,
    tokens: Vec<usize>,
    c: usize,
    drec: u64,
    cap: u64,
}

impl NormalGroup {
    /// `get_dispatch_layout` of every local rank on the device (spec §1.7). `topk_idx[i]` is
    /// local rank `i`'s `[T, K]` i64.
    pub fn layout(
        &mut self,
        topk_idx: &[&DevTensor],
        num_experts: usize,
    ) -> Result<Vec<GpuLayout>> {
        self.check_ready()?;
        let r = self.num_ranks();
        check_rank_count(self.num_local_ranks(), topk_idx.len())?;
        ep_core::plan::layout::local_experts(num_experts, r)?;
        let mut out = Vec::with_capacity(topk_idx.len());
        for (s, t) in topk_idx.iter().enumerate() {
            let w = self.who(s);
            t.expect(&format!("topk_idx of rank {w}"), DType::I64, None, None)?;
            check_device(t, &self.dev, w)?;
            if t.cols() > MAX_TOPK || !t.is_contiguous() {
                return Err(Error::Unsupported(format!(
                    "topk_idx of rank {w}: {} columns (at most {MAX_TOPK}), contiguous rows needed",
                    t.cols()
                )));
            }
            self.keep(Some(t));
            // Both counts in one allocation, zeroed by one memset (each stream operation before
            // the kernel costs the call a launch gap).
            let counts = self.alloc(s, DType::I32, 1, r + num_experts)?;
            counts
                .buffer()
                .memset_async(&self.ranks[s].stream, 0, 0, 4 * (r + num_experts))?;
            let buf = counts.buffer().clone();
            let per_rank = DevTensor::strided(buf.clone(), 0, DType::I32, 1, r, 4 * r as u64)?;
            let per_expert = DevTensor::strided(
                buf,
                4 * r as u64,
                DType::I32,
                1,
                num_experts,
                4 * num_experts as u64,
            )?;
            let in_rank = self.alloc(s, DType::U8, t.rows(), r)?;
            let mut a = self.base_args(s);
            a.num_tokens = t.rows() as u64;
            a.num_topk = t.cols() as u64;
            a.num_experts = num_experts as u64;
            a.num_local_experts = (num_experts / r) as u64;
            a.topk_idx = t.ptr();
            a.num_tokens_per_rank = per_rank.ptr();
            a.num_tokens_per_expert = per_expert.ptr();
            a.is_token_in_rank = in_rank.ptr();
            // Two ids a lane (the kernel's lanes per token round that up to a power of two, and
            // its grid-stride loop covers whatever this grid leaves).
            let lanes = t.cols().div_ceil(2) as u64;
            let blocks = (t.rows() as u64 * lanes)
                .div_ceil(u64::from(THREADS))
                .clamp(1, 132) as u32;
            self.launch(s, Kernel::Layout, blocks, &a)?;
            out.push(GpuLayout {
                num_tokens_per_rank: per_rank,
                num_tokens_per_expert: per_expert,
                is_token_in_rank: in_rank,
            });
        }
        Ok(out)
    }

    /// The row format of `inputs` (checked equal across ranks) and each rank's token count.
    fn check_inputs(
        &self,
        inputs: &[GpuRankInputs<'_>],
        with_topk: bool,
    ) -> Result<(RowFormat, Vec<usize>)> {
        let first = inputs[0].x;
        let fp8 = match first.dtype() {
            DType::Bf16 => false,
            DType::F8E4M3 => true,
            d => {
                return Err(Error::TensorMismatch {
                    what: format!("x of rank {}", self.who(0)),
                    expected: "Bf16 or F8E4M3".into(),
                    found: format!("{d:?}"),
                });
            }
        };
        let shape = |t: &DevTensor| (t.rows(), t.cols());
        let shapes_of = |inp: &GpuRankInputs<'_>| InputShapes {
            x: shape(inp.x),
            fp8: inp.x.dtype() == DType::F8E4M3,
            x_scales: inp.x_scales.map(shape),
            topk_idx: inp.topk_idx.map(shape),
            topk_weights: inp.topk_weights.map(shape),
        };
        let first_shapes = shapes_of(&inputs[0]);
        let mut tokens = Vec::with_capacity(inputs.len());
        for (i, inp) in inputs.iter().enumerate() {
            let s = self.who(i);
            // Dtypes, devices and layout here; shapes by the rules every backend shares.
            inp.x
                .expect(&format!("x of rank {s}"), first.dtype(), None, None)?;
            check_device(inp.x, &self.dev, s)?;
            if !inp.x.is_contiguous() {
                return Err(Error::Unsupported(format!(
                    "x of rank {s}: rows must be contiguous"
                )));
            }
            let typed = |t: Option<&DevTensor>, name: &str, dtype: DType| -> Result<()> {
                if let Some(x) = t {
                    x.expect(&format!("{name} of rank {s}"), dtype, None, None)?;
                    check_device(x, &self.dev, s)?;
                }
                Ok(())
            };
            if fp8 {
                typed(inp.x_scales, "x_scales", DType::F32)?;
            }
            if with_topk {
                typed(inp.topk_idx, "topk_idx", DType::I64)?;
                typed(inp.topk_weights, "topk_weights", DType::F32)?;
            }
            let shapes = shapes_of(inp);
            shapes.check(s, with_topk)?;
            shapes.agree(&first_shapes, s, with_topk)?;
            tokens.push(inp.x.rows());
        }
        let hidden = first.cols();
        let num_scales = if fp8 { hidden.div_ceil(128) } else { 0 };
        let elem = if fp8 { 1 } else { 2 };
        if hidden == 0 || !(hidden * elem).is_multiple_of(16) {
            return Err(Error::Unsupported(format!(
                "hidden {hidden}: rows must be a multiple of 16 bytes (hidden a multiple of {})",
                16 / elem
            )));
        }
        let num_topk = if with_topk {
            first_shapes.topk_idx.map_or(0, |(_, k)| k)
        } else {
            0
        };
        if num_topk > MAX_TOPK {
            return Err(Error::Unsupported(format!(
                "top-k {num_topk}: at most {MAX_TOPK}"
            )));
        }
        let fmt = RowFormat {
            hidden,
            elem_bytes: elem,
            num_scales,
            num_topk,
        };
        Ok((fmt, tokens))
    }

    /// The top-k ids (`[rows, K]` i64, local ids, -1 elsewhere) and weights (`[rows, K]` f32) of
    /// local rank `rank`'s received rows: views of the dispatch records in the arena (row
    /// stride = the record), valid until the next dispatch, like `recv_x`.
    pub(crate) fn topk_views(
        &self,
        rank: usize,
        fmt: RowFormat,
        rows: usize,
    ) -> Result<(DevTensor, DevTensor)> {
        let data = &self.ranks[rank].data;
        let base = self.data_layout().rows_base();
        let drec = fmt.dispatch_record();
        let k = fmt.num_topk;
        Ok((
            DevTensor::strided(
                data.clone(),
                base + fmt.topk_idx_offset(),
                DType::I64,
                rows,
                k,
                drec,
            )?,
            DevTensor::strided(
                data.clone(),
                base + fmt.topk_weights_offset(),
                DType::F32,
                rows,
                k,
                drec,
            )?,
        ))
    }

    /// The checks of a dispatch before anything is enqueued (no side effect): counts, dtypes,
    /// devices, shapes, options, capacity for the worst-token rows.
    pub(crate) fn check_dispatch(
        &self,
        inputs: &[GpuRankInputs<'_>],
        layouts: &[GpuLayout],
        num_experts: usize,
        args: &GpuDispatchArgs,
    ) -> Result<DispatchChecked> {
        let r = self.num_ranks();
        let n = self.num_local_ranks();
        check_rank_count(n, inputs.len())?;
        check_rank_count(n, layouts.len())?;
        let with_topk = inputs.first().is_some_and(|i| i.topk_idx.is_some());
        // The shape-level rules every backend applies (ep-core's, the simulator's Buffer's).
        let l = ep_core::buffer::check::normal_dispatch(
            r,
            num_experts,
            &DispatchOptions {
                num_channels: self.num_channels(),
                expert_alignment: args.expert_alignment,
                num_worst_tokens: args.num_worst_tokens,
                with_topk,
            },
        )?;
        if self.capture.is_some() && args.num_worst_tokens == 0 {
            return Err(Error::NotCapturable {
                what: "a dispatch without num_worst_tokens".into(),
                fix: "the host waits for num_recv mid-call; capture worst-token dispatches (num_worst_tokens > 0) only".into(),
            });
        }
        let (fmt, tokens) = self.check_inputs(inputs, with_topk)?;
        for (i, lay) in layouts.iter().enumerate() {
            let s = self.who(i);
            lay.num_tokens_per_rank.expect(
                &format!("num_tokens_per_rank of rank {s}"),
                DType::I32,
                Some(1),
                Some(r),
            )?;
            lay.num_tokens_per_expert.expect(
                &format!("num_tokens_per_expert of rank {s}"),
                DType::I32,
                Some(1),
                Some(num_experts),
            )?;
            lay.is_token_in_rank.expect(
                &format!("is_token_in_rank of rank {s}"),
                DType::U8,
                Some(tokens[i]),
                Some(r),
            )?;
        }
        let drec = fmt.dispatch_record();
        let cap = self.dispatch_capacity(drec);
        if args.num_worst_tokens as u64 > cap {
            return Err(Error::DeviceCapacity {
                rank: self.who(0),
                rows: args.num_worst_tokens as u64,
                capacity: cap,
            });
        }
        let c = self.num_channels();
        Ok(DispatchChecked {
            r,
            n,
            with_topk,
            l,
            fmt,
            tokens,
            drec,
            cap,
            c,
        })
    }

    /// Normal dispatch of every local rank (spec §1.8, docs/protocol.md §2.3): layout counts
    /// in, every row stored once at its final row on each destination. `inputs[i]` and
    /// `layouts[i]` are local rank `i`'s.
    pub fn dispatch(
        &mut self,
        inputs: &[GpuRankInputs<'_>],
        layouts: &[GpuLayout],
        num_experts: usize,
        args: &GpuDispatchArgs,
    ) -> Result<Vec<GpuDispatch>> {
        self.check_ready()?;
        let DispatchChecked {
            r,
            n,
            with_topk,
            l,
            fmt,
            tokens,
            drec,
            cap,
            c,
        } = self.check_dispatch(inputs, layouts, num_experts, args)?;
        self.begin_traced(super::trace::TracedOp::Dispatch)?;
        self.call += 1;
        let k = fmt.num_topk;
        let mut handles = Vec::with_capacity(n);
        // Every allocation (and release) before the first launch: a synchronous one would
        // wait for kernels already launched, which wait for ranks not launched yet.
        for (s, &t) in tokens.iter().enumerate() {
            handles.push((
                self.alloc(s, DType::I32, r, r)?,
                self.alloc(s, DType::I32, r, c)?,
                self.alloc(s, DType::I32, r, c)?,
                self.alloc(s, DType::I32, t, r)?,
            ));
            let inp = inputs[s];
            for t in [Some(inp.x), inp.x_scales, inp.topk_idx, inp.topk_weights] {
                self.keep(t);
            }
            let lay = &layouts[s];
            for t in [
                &lay.num_tokens_per_rank,
                &lay.num_tokens_per_expert,
                &lay.is_token_in_rank,
            ] {
                self.keep(Some(t));
            }
        }
        for s in 0..n {
            let (rpm, cpm, rcpm, send_head) = &handles[s];
            let inp = &inputs[s];
            let mut a = self.base_args(s);
            a.num_tokens = tokens[s] as u64;
            a.num_topk = k as u64;
            a.num_experts = num_experts as u64;
            a.num_local_experts = l as u64;
            a.x_bytes = (fmt.hidden * fmt.elem_bytes) as u64;
            a.num_scales = fmt.num_scales as u64;
            a.hidden = fmt.hidden as u64;
            a.drec = drec;
            a.capacity = cap;
            a.expert_alignment = args.expert_alignment as u64;
            a.num_worst_tokens = args.num_worst_tokens as u64;
            a.flags |= if with_topk { abi::EP_FLAG_TOPK } else { 0 }
                | if fmt.elem_bytes == 1 {
                    abi::EP_FLAG_FP8
                } else {
                    0
                };
            a.x = inp.x.ptr();
            a.x_scales = inp.x_scales.map_or(0, DevTensor::ptr);
            a.topk_idx = inp.topk_idx.map_or(0, DevTensor::ptr);
            a.topk_weights = inp.topk_weights.map_or(0, DevTensor::ptr);
            a.is_token_in_rank = layouts[s].is_token_in_rank.ptr();
            a.num_tokens_per_rank = layouts[s].num_tokens_per_rank.ptr();
            a.num_tokens_per_expert = layouts[s].num_tokens_per_expert.ptr();
            a.rank_prefix_matrix = rpm.ptr();
            a.channel_prefix_matrix = cpm.ptr();
            a.recv_channel_prefix_matrix = rcpm.ptr();
            a.send_head = send_head.ptr();
            self.launch(s, Kernel::Dispatch, 2 * c as u32, &a)?;
        }
        self.last = Some(LastDispatch { fmt, num_topk: k });
        // The only host sync: num_recv and the expert list from each rank's block 1, every word
        // tagged with the call number (no system fence orders them on the device).
        let mut recv = vec![(None, Vec::new()); n];
        if args.num_worst_tokens == 0 {
            // Inside `timed`, the kernels are still behind the gate.
            self.open_gate();
            let deadline = Instant::now() + self.timeout + Duration::from_secs(1);
            for (s, slot) in recv.iter_mut().enumerate() {
                let mut polls = 0u32;
                let got = loop {
                    // The whole mailbox is read only once num_recv carries this call.
                    if self.ranks[s].mailbox.word(0) >> 32 == self.call
                        && let Some(got) = published(&self.ranks[s].mailbox.read(), self.call, l)
                    {
                        break got;
                    }
                    if self.dev.err.read().status != 0 {
                        self.check_device_error()?;
                    }
                    polls = polls.wrapping_add(1);
                    if polls.is_multiple_of(4096)
                        && let Err(e) =
                            stream_fault(&self.ranks[s].stream, "dispatch (a kernel faulted)")
                    {
                        self.poison = Some(format!("rank {}'s stream faulted: {e}", self.who(s)));
                        return Err(e);
                    }
                    if Instant::now() > deadline {
                        self.poison = Some(format!(
                            "rank {}'s dispatch of call {} never published num_recv",
                            self.who(s),
                            self.call
                        ));
                        return Err(Error::HostWaitTimeout {
                            rank: self.who(s),
                            what: format!(
                                "num_recv of call {} from the dispatch's block 1",
                                self.call
                            ),
                            timeout: self.timeout,
                        });
                    }
                    std::hint::spin_loop();
                };
                *slot = (Some(got.0), got.1);
            }
        }
        let mut out = Vec::with_capacity(n);
        for (s, (rpm, cpm, rcpm, send_head)) in handles.into_iter().enumerate() {
            let (num_recv, experts) = recv[s].clone();
            let rows = num_recv.unwrap_or(args.num_worst_tokens);
            let (recv_x, recv_x_scales) = self.recv_views(s, fmt, rows)?;
            let topk = with_topk
                .then(|| self.topk_views(s, fmt, rows))
                .transpose()?;
            let (recv_topk_idx, recv_topk_weights) =
                topk.map_or((None, None), |(i, w)| (Some(i), Some(w)));
            out.push(GpuDispatch {
                recv_x,
                recv_x_scales,
                recv_topk_idx,
                recv_topk_weights,
                recv_src_idx: self.src_view(s, fmt, rows)?,
                num_recv_tokens_per_expert_list: experts,
                handle: GpuHandle {
                    rank_prefix_matrix: rpm,
                    channel_prefix_matrix: cpm,
                    recv_channel_prefix_matrix: rcpm,
                    send_head,
                    is_token_in_rank: layouts[s].is_token_in_rank.clone(),
                    num_recv_tokens: num_recv,
                    num_rows: rows,
                    num_tokens: tokens[s],
                },
            });
        }
        Ok(out)
    }

    /// The checks of a cached dispatch before anything is enqueued (no side effect).
    pub(crate) fn check_cached(
        &self,
        inputs: &[GpuRankInputs<'_>],
        handles: &[&GpuHandle],
    ) -> Result<CachedChecked> {
        let r = self.num_ranks();
        let n = self.num_local_ranks();
        check_rank_count(n, inputs.len())?;
        check_rank_count(n, handles.len())?;
        let (fmt, tokens) = self.check_inputs(inputs, false)?;
        let c = self.num_channels();
        let drec = fmt.dispatch_record();
        let cap = self.dispatch_capacity(drec);
        for (i, h) in handles.iter().enumerate() {
            let s = self.who(i);
            h.check(s, r, c)?;
            if h.num_tokens != tokens[i] {
                return Err(Error::TensorMismatch {
                    what: format!("x of rank {s} for a cached dispatch"),
                    expected: format!("{} rows (the handle's tokens)", h.num_tokens),
                    found: format!("{} rows", tokens[i]),
                });
            }
            let rows = h.num_recv_tokens.ok_or_else(|| {
                Error::Unsupported(
                    "a cached dispatch needs a handle from a dispatch without num_worst_tokens"
                        .into(),
                )
            })?;
            if rows as u64 > cap {
                return Err(Error::DeviceCapacity {
                    rank: s,
                    rows: rows as u64,
                    capacity: cap,
                });
            }
        }
        Ok(CachedChecked {
            n,
            fmt,
            tokens,
            c,
            drec,
            cap,
        })
    }

    /// Cached dispatch (spec §1.8 with a handle, docs/protocol.md §2.4): no count exchange, the
    /// offsets come from each local rank's handle; no top-k. The handles must come from a
    /// dispatch of this group with the same channel count.
    pub fn dispatch_cached(
        &mut self,
        inputs: &[GpuRankInputs<'_>],
        handles: &[&GpuHandle],
    ) -> Result<Vec<GpuDispatch>> {
        self.check_ready()?;
        let CachedChecked {
            n,
            fmt,
            tokens,
            c,
            drec,
            cap,
        } = self.check_cached(inputs, handles)?;
        self.begin_traced(super::trace::TracedOp::Dispatch)?;
        self.call += 1;
        for s in 0..n {
            self.keep(Some(inputs[s].x));
            self.keep(inputs[s].x_scales);
            self.keep_handle(handles[s]);
        }
        for s in 0..n {
            let h = handles[s];
            let mut a = self.base_args(s);
            a.num_tokens = tokens[s] as u64;
            a.x_bytes = (fmt.hidden * fmt.elem_bytes) as u64;
            a.num_scales = fmt.num_scales as u64;
            a.hidden = fmt.hidden as u64;
            a.drec = drec;
            a.capacity = cap;
            a.flags |= abi::EP_FLAG_CACHED
                | if fmt.elem_bytes == 1 {
                    abi::EP_FLAG_FP8
                } else {
                    0
                };
            a.x = inputs[s].x.ptr();
            a.x_scales = inputs[s].x_scales.map_or(0, DevTensor::ptr);
            a.is_token_in_rank = h.is_token_in_rank.ptr();
            a.rank_prefix_matrix = h.rank_prefix_matrix.ptr();
            a.channel_prefix_matrix = h.channel_prefix_matrix.ptr();
            a.recv_channel_prefix_matrix = h.recv_channel_prefix_matrix.ptr();
            self.launch(s, Kernel::Dispatch, 2 * c as u32, &a)?;
        }
        self.last = Some(LastDispatch { fmt, num_topk: 0 });
        let mut out = Vec::with_capacity(n);
        for (s, h) in handles.iter().enumerate() {
            let rows = h.num_rows;
            let (recv_x, recv_x_scales) = self.recv_views(s, fmt, rows)?;
            out.push(GpuDispatch {
                recv_x,
                recv_x_scales,
                recv_topk_idx: None,
                recv_topk_weights: None,
                recv_src_idx: self.src_view(s, fmt, rows)?,
                num_recv_tokens_per_expert_list: Vec::new(),
                handle: (*h).clone(),
            });
        }
        Ok(out)
    }
}

/// What a dispatch's block 1 published for call `call` (docs/protocol.md §2.7): num_recv and the
/// first `l` expert counts, once every one of those words carries the call in its high half
/// (the device orders them with no fence); `None` while any is from an earlier call.
fn published(mb: &Mailbox, call: u64, l: usize) -> Option<(usize, Vec<i32>)> {
    let of_call = |w: u64| w >> 32 == call;
    let experts = mb.expert_counts.get(..l)?;
    if !of_call(mb.num_recv) || !experts.iter().all(|&w| of_call(w)) {
        return None;
    }
    let low = |w: u64| (w & 0xffff_ffff) as u32;
    Some((
        low(mb.num_recv) as usize,
        experts.iter().map(|&w| low(w) as i32).collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host takes a dispatch's num_recv and expert list only when every word it reads
    /// carries the call (block 1 stores them with no fence between): a stale word from the
    /// previous call, in num_recv or in any one expert, keeps it waiting.
    #[test]
    fn the_mailbox_is_taken_only_when_every_word_carries_the_call() {
        let call = 7u64;
        let mut mb = Mailbox::default();
        let counts = [5u64, 0, 128, 3];
        for (w, c) in mb.expert_counts.iter_mut().zip(counts) {
            *w = (call << 32) | c;
        }
        mb.num_recv = ((call - 1) << 32) | 99;
        assert_eq!(
            published(&mb, call, 4),
            None,
            "num_recv of the previous call"
        );
        mb.num_recv = (call << 32) | 136;
        assert_eq!(published(&mb, call, 4), Some((136, vec![5, 0, 128, 3])));
        mb.expert_counts[2] = ((call - 1) << 32) | 128;
        assert_eq!(
            published(&mb, call, 4),
            None,
            "one expert of the previous call"
        );
        // Words past the rank's local experts are not looked at.
        assert_eq!(published(&mb, call, 2), Some((136, vec![5, 0])));
        assert_eq!(
            published(&mb, call, 2000),
            None,
            "more experts than the mailbox holds"
        );
    }
}
