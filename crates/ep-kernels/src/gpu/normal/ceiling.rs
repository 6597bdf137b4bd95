//! The ceilings of a [`NormalGroup`]'s calls (BASELINES.md): copy kernels moving the same bytes
//! to and from the same rows with the same blocks, and no protocol.

use super::launch::Kernel;
use super::{NormalGroup, check_rank_count};
use crate::error::{Error, Result};
use crate::gpu::tensor::{DType, DevTensor};

impl NormalGroup {
    /// The ceiling of a dispatch's data movement (BASELINES.md): on every local rank `i`,
    /// `blocks` blocks load each row of `x[i]` — and of `scales[i]` (FP8: `[T, S]` f32, the
    /// bytes DeepEP counts with the row) — once and store it to each of its final rows
    /// `dst_rows[i]` (`[T, R]` i32, `-1` = not sent) on the destinations' arenas, records of
    /// `drec` bytes, the scales where a dispatch puts them. No protocol, no signals, no meta.
    pub fn ceiling(
        &mut self,
        x: &[&DevTensor],
        scales: &[Option<&DevTensor>],
        dst_rows: &[&DevTensor],
        drec: u64,
        blocks: u32,
    ) -> Result<()> {
        self.check_ready()?;
        let r = self.num_ranks();
        check_rank_count(self.num_local_ranks(), x.len())?;
        check_rank_count(self.num_local_ranks(), scales.len())?;
        check_rank_count(self.num_local_ranks(), dst_rows.len())?;
        for s in 0..x.len() {
            let row_bytes = (x[s].cols() * x[s].dtype().size()) as u64;
            let num_scales = match scales[s] {
                Some(t) => {
                    t.expect(
                        &format!("scales of rank {}", self.who(s)),
                        DType::F32,
                        Some(x[s].rows()),
                        None,
                    )?;
                    let tail =
                        row_bytes.div_ceil(16) * 16 + (4 * t.cols() as u64).div_ceil(16) * 16;
                    if !t.is_contiguous() || tail > drec {
                        return Err(Error::Unsupported(format!(
                            "ceiling scales of rank {}: {} columns",
                            self.who(s),
                            t.cols()
                        )));
                    }
                    t.cols() as u64
                }
                None => 0,
            };
            dst_rows[s].expect(
                &format!("dst_rows of rank {}", self.who(s)),
                DType::I32,
                Some(x[s].rows()),
                Some(r),
            )?;
            if !row_bytes.is_multiple_of(16) || row_bytes > drec || !x[s].is_contiguous() {
                return Err(Error::Unsupported(format!(
                    "ceiling rows of rank {}: {row_bytes} bytes",
                    self.who(s)
                )));
            }
            let mut a = self.base_args(s);
            a.num_tokens = x[s].rows() as u64;
            a.x_bytes = row_bytes;
            a.drec = drec;
            a.x = x[s].ptr();
            a.num_scales = num_scales;
            a.x_scales = scales[s].map_or(0, DevTensor::ptr);
            a.dst_rows = dst_rows[s].ptr();
            self.launch(s, Kernel::Ceiling, blocks, &a)?;
        }
        Ok(())
    }

    /// The ceiling of a combine's data movement: every token of local rank `i` reduces its
    /// rows of the last dispatch (BF16 x parts; `src_rows[i]` `[T, R]` i32, the token's row on
    /// each rank or -1) into `out[i]` (`[T, H]` BF16), `blocks` blocks per rank, no signals.
    pub fn ceiling_combine(
        &mut self,
        src_rows: &[&DevTensor],
        out: &[&DevTensor],
        blocks: u32,
    ) -> Result<()> {
        self.check_ready()?;
        let r = self.num_ranks();
        check_rank_count(self.num_local_ranks(), src_rows.len())?;
        check_rank_count(self.num_local_ranks(), out.len())?;
        let last = self.last.ok_or_else(|| {
            Error::Unsupported(
                "a combine ceiling reads the rows of a dispatch: dispatch first".into(),
            )
        })?;
        if last.fmt.elem_bytes != 2 {
            return Err(Error::Unsupported(
                "the combine ceiling reads BF16 dispatch rows".into(),
            ));
        }
        for s in 0..out.len() {
            out[s].expect(
                &format!("ceiling output of rank {}", self.who(s)),
                DType::Bf16,
                None,
                Some(last.fmt.hidden),
            )?;
            src_rows[s].expect(
                &format!("src_rows of rank {}", self.who(s)),
                DType::I32,
                Some(out[s].rows()),
                Some(r),
            )?;
            let mut a = self.base_args(s);
            a.num_tokens = out[s].rows() as u64;
            a.hidden = last.fmt.hidden as u64;
            a.drec = last.fmt.dispatch_record();
            a.dst_rows = src_rows[s].ptr();
            a.combined_x = out[s].ptr();
            self.launch(s, Kernel::CeilingGather, blocks, &a)?;
        }
        Ok(())
    }
}
