//! [`DevTensor`]: a small typed view over device memory (buffer, byte offset, dtype, rows x
//! columns, row stride, device). Received rows are strided views into a rank's arena. And
//! `copy_2d`, a stream-ordered copy between two views of one shape.

use std::sync::Arc;

use cudarc::driver::CudaStream;
use ep_core::tensor::Tensor2;
use half::bf16;

use super::mem::DevBuf;
use crate::error::{Error, Result};

/// Element type of a [`DevTensor`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DType {
    /// bfloat16.
    Bf16,
    /// FP8 e4m3 (raw bytes).
    F8E4M3,
    /// float32.
    F32,
    /// int32.
    I32,
    /// int64.
    I64,
    /// bool / uint8.
    U8,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bf16 => 2,
            DType::F8E4M3 | DType::U8 => 1,
            DType::F32 | DType::I32 => 4,
            DType::I64 => 8,
        }
    }
}

/// Host element types a [`DevTensor`] uploads from and downloads to.
pub trait HostElem: Copy + Default {
    /// The device dtype it maps to.
    const DTYPE: DType;
    /// Little-endian bytes of a slice.
    fn to_bytes(v: &[Self]) -> Vec<u8>;
    /// From little-endian bytes (`b.len()` is a multiple of the size).
    fn from_bytes(b: &[u8]) -> Vec<Self>;
}

macro_rules! host_elem {
    ($t:ty, $d:expr, $n:expr, $from:expr, $to:expr) => {
        impl HostElem for $t {
            const DTYPE: DType = $d;
            fn to_bytes(v: &[Self]) -> Vec<u8> {
                v.iter().flat_map(|x| $to(*x)).collect()
            }
            fn from_bytes(b: &[u8]) -> Vec<Self> {
                b.chunks_exact($n)
                    .map(|c| $from(c.try_into().expect("chunk of the element size")))
                    .collect()
            }
        }
    };
}
host_elem!(bf16, DType::Bf16, 2, bf16::from_le_bytes, bf16::to_le_bytes);
host_elem!(f32, DType::F32, 4, f32::from_le_bytes, f32::to_le_bytes);
host_elem!(i32, DType::I32, 4, i32::from_le_bytes, i32::to_le_bytes);
host_elem!(i64, DType::I64, 8, i64::from_le_bytes, i64::to_le_bytes);
host_elem!(u8, DType::U8, 1, |b: [u8; 1]| b[0], |x: u8| [x]);
host_elem!(bool, DType::U8, 1, |b: [u8; 1]| b[0] != 0, |x: bool| [
    u8::from(x)
]);

/// A 2-D view over device memory (module docs).
#[derive(Clone, Debug)]
pub struct DevTensor {
    buf: Arc<DevBuf>,
    offset: u64,
    dtype: DType,
    rows: usize,
    cols: usize,
    row_stride: u64,
}

impl DevTensor {
    /// A contiguous `[rows, cols]` tensor, uninitialised.
    pub fn empty(
        ctx: &Arc<cudarc::driver::CudaContext>,
        dtype: DType,
        rows: usize,
        cols: usize,
    ) -> Result<Self> {
        let buf = DevBuf::new(ctx, rows * cols * dtype.size())?;
        Ok(Self::contiguous(Arc::new(buf), 0, dtype, rows, cols))
    }

    /// A contiguous `[rows, cols]` tensor of zero bytes.
    pub fn zeros(
        ctx: &Arc<cudarc::driver::CudaContext>,
        dtype: DType,
        rows: usize,
        cols: usize,
    ) -> Result<Self> {
        let buf = DevBuf::zeroed(ctx, rows * cols * dtype.size())?;
        Ok(Self::contiguous(Arc::new(buf), 0, dtype, rows, cols))
    }

    /// A contiguous `[rows, cols]` tensor in stream-ordered memory of `stream`, from `dev`'s
    /// pool (uninitialised).
    pub fn on_stream(
        dev: &super::device::Device,
        stream: &Arc<cudarc::driver::CudaStream>,
        dtype: DType,
        rows: usize,
        cols: usize,
    ) -> Result<Self> {
        let buf = Arc::new(DevBuf::on_stream(
            &dev.pool,
            stream,
            rows * cols * dtype.size(),
        )?);
        Ok(Self::contiguous(buf, 0, dtype, rows, cols))
    }

    /// Bytes the view spans (from element `[0, 0]` to the end of the last row).
    pub fn span_bytes(&self) -> u64 {
        if self.rows == 0 {
            0
        } else {
            (self.rows as u64 - 1) * self.row_stride + (self.cols * self.dtype.size()) as u64
        }
    }

    /// A contiguous view of `buf` at `offset`.
    pub fn contiguous(
        buf: Arc<DevBuf>,
        offset: u64,
        dtype: DType,
        rows: usize,
        cols: usize,
    ) -> Self {
        let row_stride = (cols * dtype.size()) as u64;
        Self {
            buf,
            offset,
            dtype,
            rows,
            cols,
            row_stride,
        }
    }

    /// A strided view (`row_stride` bytes between rows) of `buf` at `offset`. Fails when the
    /// view does not fit the buffer.
    pub fn strided(
        buf: Arc<DevBuf>,
        offset: u64,
        dtype: DType,
        rows: usize,
        cols: usize,
        row_stride: u64,
    ) -> Result<Self> {
        let row_bytes = (cols * dtype.size()) as u64;
        let end = if rows == 0 {
            offset
        } else {
            offset + (rows as u64 - 1) * row_stride + row_bytes
        };
        if end > buf.len() as u64 || (rows > 1 && row_stride < row_bytes) {
            return Err(Error::OutOfBounds {
                what: "strided device view",
                offset: offset as usize,
                len: (end - offset) as usize,
                size: buf.len(),
            });
        }
        Ok(Self {
            buf,
            offset,
            dtype,
            rows,
            cols,
            row_stride,
        })
    }

    /// Uploads a host tensor (synchronous).
    pub fn upload<T: HostElem>(
        ctx: &Arc<cudarc::driver::CudaContext>,
        t: &Tensor2<T>,
    ) -> Result<Self> {
        let d = Self::empty(ctx, T::DTYPE, t.rows(), t.cols())?;
        d.buf.write(0, &T::to_bytes(t.data()))?;
        Ok(d)
    }

    /// Overwrites this contiguous tensor with `t` (same element size and shape): a synchronous
    /// copy from the host, ordered against no stream, so no work may be using the tensor (sync
    /// first). How fresh values reach the inputs a CUDA graph was captured with.
    pub fn write<T: HostElem>(&self, t: &Tensor2<T>) -> Result<()> {
        if T::DTYPE.size() != self.dtype.size()
            || t.rows() != self.rows
            || t.cols() != self.cols
            || !self.is_contiguous()
        {
            return Err(Error::TensorMismatch {
                what: "write into a device tensor".into(),
                expected: format!(
                    "{:?} [{}, {}], contiguous",
                    self.dtype, self.rows, self.cols
                ),
                found: format!("{:?} [{}, {}]", T::DTYPE, t.rows(), t.cols()),
            });
        }
        self.buf.write(self.offset as usize, &T::to_bytes(t.data()))
    }

    /// Downloads into a host tensor (synchronous; strided rows are gathered).
    pub fn download<T: HostElem>(&self) -> Result<Tensor2<T>> {
        if T::DTYPE.size() != self.dtype.size() {
            return Err(Error::TensorMismatch {
                what: "download".into(),
                expected: format!("{:?}", T::DTYPE),
                found: format!("{:?}", self.dtype),
            });
        }
        let row_bytes = self.cols * self.dtype.size();
        let mut bytes = vec![0u8; self.rows * row_bytes];
        if self.is_contiguous() {
            self.buf.read(self.offset as usize, &mut bytes)?;
        } else {
            let span = if self.rows == 0 {
                0
            } else {
                (self.rows - 1) * self.row_stride as usize + row_bytes
            };
            let mut all = vec![0u8; span];
            self.buf.read(self.offset as usize, &mut all)?;
            for r in 0..self.rows {
                let s = r * self.row_stride as usize;
                bytes[r * row_bytes..(r + 1) * row_bytes].copy_from_slice(&all[s..s + row_bytes]);
            }
        }
        Tensor2::new(self.rows, self.cols, T::from_bytes(&bytes)).map_err(|e| {
            Error::TensorMismatch {
                what: "download".into(),
                expected: "a consistent shape".into(),
                found: e.to_string(),
            }
        })
    }

    /// Device address of element `[0, 0]`.
    pub fn ptr(&self) -> u64 {
        self.buf.ptr() + self.offset
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes between rows.
    pub fn row_stride(&self) -> u64 {
        self.row_stride
    }

    /// Whether rows are packed.
    pub fn is_contiguous(&self) -> bool {
        self.rows <= 1 || self.row_stride == (self.cols * self.dtype.size()) as u64
    }

    /// The CUDA device ordinal it lives on.
    pub fn device(&self) -> usize {
        self.buf.context().ordinal()
    }

    /// The buffer it views.
    pub fn buffer(&self) -> &Arc<DevBuf> {
        &self.buf
    }

    /// Checks dtype and shape (`None` = any), naming `what` in the error.
    pub fn expect(
        &self,
        what: &str,
        dtype: DType,
        rows: Option<usize>,
        cols: Option<usize>,
    ) -> Result<()> {
        let ok = self.dtype == dtype
            && rows.is_none_or(|r| r == self.rows)
            && cols.is_none_or(|c| c == self.cols);
        if ok {
            return Ok(());
        }
        let dim = |d: Option<usize>| d.map_or("*".to_string(), |v| v.to_string());
        Err(Error::TensorMismatch {
            what: what.to_string(),
            expected: format!("{dtype:?} [{}, {}]", dim(rows), dim(cols)),
            found: format!("{:?} [{}, {}]", self.dtype, self.rows, self.cols),
        })
    }
}

/// The first `rows` rows of each of `tables` (i64 tensors on the device, e.g. the kernels'
/// `%globaltimer` stamps: a row per block) downloaded, as u64.
pub(crate) fn rows_u64(
    tables: &[DevTensor],
    rows: impl Fn(usize) -> usize,
) -> Result<Vec<Vec<Vec<u64>>>> {
    tables
        .iter()
        .map(|b| {
            let t = b.download::<i64>()?;
            Ok((0..rows(t.rows()))
                .map(|i| t.row(i).iter().map(|&v| v as u64).collect())
                .collect())
        })
        .collect()
}

/// A 2-D copy of `src` into `dst` (same shape and dtype, any row strides) on `stream`.
pub(crate) fn copy_2d(stream: &CudaStream, src: &DevTensor, dst: &DevTensor) -> Result<()> {
    if src.shape() != dst.shape() || src.dtype() != dst.dtype() {
        return Err(Error::TensorMismatch {
            what: "2-D copy".into(),
            expected: format!("{:?} {:?}", dst.dtype(), dst.shape()),
            found: format!("{:?} {:?}", src.dtype(), src.shape()),
        });
    }
    if src.rows() == 0 {
        return Ok(());
    }
    use cudarc::driver::sys;
    let p = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcHost: std::ptr::null(),
        srcDevice: src.ptr(),
        srcArray: std::ptr::null_mut(),
        srcPitch: src.row_stride() as usize,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst.ptr(),
        dstArray: std::ptr::null_mut(),
        dstPitch: dst.row_stride() as usize,
        WidthInBytes: src.cols() * src.dtype().size(),
        Height: src.rows(),
    };
    // SAFETY: both views were bounds-checked against their buffers when made, and the shapes
    // are equal, so the copy stays inside both; the buffers outlive the enqueued copy (callers
    // hold the tensors until the stream is synchronised or passed).
    unsafe { sys::cuMemcpy2DAsync_v2(&p, stream.cu_stream()) }
        .result()
        .map_err(Error::cuda("cuMemcpy2DAsync"))
}
