//! Dense row-major host tensors: the shapes the DeepEP API talks in (`[T, H]`, `[T, K]`, ...).

use crate::error::{Error, Result};

/// A dense row-major matrix `[rows, cols]`.
///
/// ep-core's semantics work on host data; the GPU backend maps device buffers to the same
/// shapes. `cols == 0` is allowed (e.g. top-k of an empty routing), `rows == 0` is an empty batch.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor2<T> {
    rows: usize,
    cols: usize,
    data: Vec<T>,
}

impl<T> Tensor2<T> {
    /// Wraps `data` (row-major) as `[rows, cols]`; the length must be `rows * cols`.
    pub fn new(rows: usize, cols: usize, data: Vec<T>) -> Result<Self> {
        if data.len() != rows * cols {
            return Err(Error::ShapeMismatch {
                what: "tensor data",
                expected: format!("{rows} x {cols} = {} elements", rows * cols),
                found: format!("{} elements", data.len()),
            });
        }
        Ok(Self { rows, cols, data })
    }

    /// Builds `[rows, cols]` from `f(row, col)`.
    pub fn from_fn(rows: usize, cols: usize, mut f: impl FnMut(usize, usize) -> T) -> Self {
        let mut data = Vec::with_capacity(rows * cols);
        for r in 0..rows {
            for c in 0..cols {
                data.push(f(r, c));
            }
        }
        Self { rows, cols, data }
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// Row `r` as a slice. Panics if `r >= rows` (an index bug, not an input error).
    pub fn row(&self, r: usize) -> &[T] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// Row `r` as a mutable slice.
    pub fn row_mut(&mut self, r: usize) -> &mut [T] {
        &mut self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// Iterator over rows.
    pub fn iter_rows(&self) -> impl ExactSizeIterator<Item = &[T]> + '_ {
        (0..self.rows).map(move |r| self.row(r))
    }

    /// All elements, row-major.
    pub fn data(&self) -> &[T] {
        &self.data
    }

    /// All elements, row-major, mutable.
    pub fn data_mut(&mut self) -> &mut [T] {
        &mut self.data
    }

    /// Consumes the tensor, returning its row-major data.
    pub fn into_data(self) -> Vec<T> {
        self.data
    }
}

impl Tensor2<half::bf16> {
    /// `[rows, cols]` of BF16 `+0`, from zeroed memory: the allocator may hand out fresh pages
    /// untouched (the writer faults them in, on its own thread), where `filled` writes every
    /// element first.
    #[must_use]
    pub fn zeros(rows: usize, cols: usize) -> Self {
        use half::vec::HalfBitsVecExt;
        Self {
            rows,
            cols,
            data: vec![0u16; rows * cols].reinterpret_into(),
        }
    }
}

impl<T: Clone> Tensor2<T> {
    /// `[rows, cols]` filled with `value`.
    pub fn filled(rows: usize, cols: usize, value: T) -> Self {
        Self {
            rows,
            cols,
            data: vec![value; rows * cols],
        }
    }

    /// Element `(r, c)`.
    pub fn get(&self, r: usize, c: usize) -> T {
        self.data[r * self.cols + c].clone()
    }

    /// Sets element `(r, c)`.
    pub fn set(&mut self, r: usize, c: usize, value: T) {
        self.data[r * self.cols + c] = value;
    }

    /// Appends one row; its length must equal `cols`.
    pub fn push_row(&mut self, row: &[T]) -> Result<()> {
        if row.len() != self.cols {
            return Err(Error::ShapeMismatch {
                what: "appended row",
                expected: format!("{} columns", self.cols),
                found: format!("{} columns", row.len()),
            });
        }
        self.data.extend_from_slice(row);
        self.rows += 1;
        Ok(())
    }
}
