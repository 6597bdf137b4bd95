//! One `.npy` file in, one out, through `npyz`, with every failure turned into an [`IoError`]
//! that names the file: missing, unreadable header or truncated data, a dtype other than the one
//! asked for, a number of dimensions other than the one asked for.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use npyz::{AutoSerialize, Deserialize, WriterBuilder};

use super::IoError;

/// The element types ep-rs reads and writes, with their NumPy dtype (without the byte order).
pub(crate) trait Elem: Deserialize + AutoSerialize + Copy {
    /// NumPy kind and size, e.g. `f4`, `i8`, `u1`.
    const KIND: &'static str;
}

impl Elem for f32 {
    const KIND: &'static str = "f4";
}
impl Elem for i64 {
    const KIND: &'static str = "i8";
}
impl Elem for i32 {
    const KIND: &'static str = "i4";
}
impl Elem for u16 {
    const KIND: &'static str = "u2";
}
impl Elem for u8 {
    const KIND: &'static str = "u1";
}
impl Elem for bool {
    const KIND: &'static str = "b1";
}

/// A parsed `.npy` file whose data is still raw: its header says dtype and shape.
pub(crate) struct Npy {
    bytes: Vec<u8>,
    /// Dtype as NumPy writes it, e.g. `<f4`.
    pub(crate) descr: String,
    /// Shape as in the file (C order after [`Npy::read`]).
    pub(crate) shape: Vec<u64>,
    fortran: bool,
}

impl Npy {
    /// Opens and parses the header of `path`; `what` says what the file should hold (for the
    /// missing-file error).
    pub(crate) fn open(path: &Path, what: &'static str) -> Result<Self, IoError> {
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(IoError::MissingFile {
                    path: path.to_path_buf(),
                    what,
                });
            }
            Err(e) => return Err(IoError::io(path, "reading", e)),
        };
        let npy = npyz::NpyFile::new(&bytes[..]).map_err(|e| IoError::Corrupt {
            path: path.to_path_buf(),
            detail: format!("bad header: {e}"),
        })?;
        let descr = match npy.dtype() {
            npyz::DType::Plain(t) => t.to_string(),
            other => other.descr(),
        };
        let shape = npy.shape().to_vec();
        let fortran = npy.order() == npyz::Order::Fortran;
        Ok(Self {
            bytes,
            descr,
            shape,
            fortran,
        })
    }

    /// The dtype's kind and size without the byte-order character (`f4` for `<f4`).
    pub(crate) fn kind(&self) -> &str {
        self.descr.trim_start_matches(['<', '>', '|', '='])
    }

    /// Checks the number of dimensions; `what` names the expected layout, e.g. `[T, K]`.
    pub(crate) fn expect_ndim(
        &self,
        path: &Path,
        ndim: usize,
        what: &'static str,
    ) -> Result<(), IoError> {
        if self.shape.len() != ndim {
            return Err(IoError::WrongNdim {
                path: path.to_path_buf(),
                shape: self.shape.clone(),
                expected: ndim,
                layout: what,
            });
        }
        Ok(())
    }

    /// The data as `T` in C (row-major) order; the dtype must be `T`'s (either byte order).
    /// A 2-D Fortran-order array is transposed into C order.
    pub(crate) fn read<T: Elem>(
        &self,
        path: &Path,
        expected: &'static str,
    ) -> Result<Vec<T>, IoError> {
        if self.kind() != T::KIND {
            return Err(IoError::WrongDtype {
                path: path.to_path_buf(),
                found: self.descr.clone(),
                expected,
            });
        }
        let npy = npyz::NpyFile::new(&self.bytes[..]).map_err(|e| IoError::Corrupt {
            path: path.to_path_buf(),
            detail: format!("bad header: {e}"),
        })?;
        let want: u64 = self.shape.iter().product();
        let data: Vec<T> = npy.into_vec().map_err(|e| IoError::Corrupt {
            path: path.to_path_buf(),
            detail: format!(
                "data of shape {:?} ({want} elements of {}) unreadable: {e} (truncated?)",
                self.shape, self.descr
            ),
        })?;
        if !self.fortran || self.shape.len() < 2 {
            return Ok(data);
        }
        if self.shape.len() > 2 {
            return Err(IoError::Corrupt {
                path: path.to_path_buf(),
                detail: "Fortran-order arrays of more than 2 dimensions are not supported; \
                         save a C-contiguous array (numpy.ascontiguousarray)"
                    .into(),
            });
        }
        let (rows, cols) = (self.shape[0] as usize, self.shape[1] as usize);
        Ok((0..rows * cols)
            .map(|i| data[(i % cols) * rows + i / cols])
            .collect())
    }
}

/// Writes `data` (row-major) as a C-order `.npy` of `shape` with `T`'s default dtype.
pub(crate) fn write<T: Elem>(path: &Path, shape: &[usize], data: &[T]) -> Result<(), IoError> {
    // Written under a temporary name and renamed: a file that is there is whole.
    let partial = super::partial_path(path);
    write_to(&partial, shape, data)?;
    std::fs::rename(&partial, path).map_err(|e| IoError::io(path, "renaming into place", e))
}

fn write_to<T: Elem>(path: &Path, shape: &[usize], data: &[T]) -> Result<(), IoError> {
    debug_assert_eq!(shape.iter().product::<usize>(), data.len());
    let dims: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    let file = File::create(path).map_err(|e| IoError::io(path, "creating", e))?;
    let mut out = BufWriter::new(file);
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(&dims)
        .writer(&mut out)
        .begin_nd()
        .map_err(|e| IoError::io(path, "writing", e))?;
    w.extend(data.iter().copied())
        .map_err(|e| IoError::io(path, "writing", e))?;
    w.finish().map_err(|e| IoError::io(path, "writing", e))?;
    out.flush().map_err(|e| IoError::io(path, "writing", e))
}
