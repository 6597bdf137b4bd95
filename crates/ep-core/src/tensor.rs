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

/// A dense row-major array `[n, rows, cols]`: `n` matrices `[rows, cols]` back to back in one
/// allocation, DeepEP's layout of the packed low-latency tensors (`[L, R·N, H]`, spec §2.4).
///
/// One allocation rather than `n` matrices of their own: the packed arrays are mostly empty, and
/// one large zeroed block is what the system allocator serves from fresh zero pages
/// ([`FRESH_MAPPING_BYTES`](crate::plan::low_latency::FRESH_MAPPING_BYTES)).
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor3<T> {
    n: usize,
    rows: usize,
    cols: usize,
    data: Vec<T>,
}

impl<T> Tensor3<T> {
    /// Wraps `data` (row-major) as `[n, rows, cols]`; the length must be `n * rows * cols`.
    pub fn new(n: usize, rows: usize, cols: usize, data: Vec<T>) -> Result<Self> {
        if data.len() != n * rows * cols {
            return Err(Error::ShapeMismatch {
                what: "tensor data",
                expected: format!("{n} x {rows} x {cols} = {} elements", n * rows * cols),
                found: format!("{} elements", data.len()),
            });
        }
        Ok(Self {
            n,
            rows,
            cols,
            data,
        })
    }

    /// Stacks `matrices`, each `[rows, cols]`, into `[matrices.len(), rows, cols]`.
    pub fn from_matrices(rows: usize, cols: usize, matrices: Vec<Tensor2<T>>) -> Result<Self> {
        let n = matrices.len();
        let mut data = Vec::with_capacity(n * rows * cols);
        for m in matrices {
            if m.shape() != (rows, cols) {
                return Err(Error::ShapeMismatch {
                    what: "stacked matrix",
                    expected: format!("[{rows}, {cols}]"),
                    found: format!("{:?}", m.shape()),
                });
            }
            data.extend(m.into_data());
        }
        Ok(Self {
            n,
            rows,
            cols,
            data,
        })
    }

    /// Number of matrices (the first dimension).
    pub fn matrices(&self) -> usize {
        self.n
    }

    /// Rows of each matrix.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns of each matrix.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// `(n, rows, cols)`.
    pub fn shape(&self) -> (usize, usize, usize) {
        (self.n, self.rows, self.cols)
    }

    /// Matrix `i`, row-major. Panics if `i >= n` (an index bug, not an input error).
    pub fn matrix(&self, i: usize) -> &[T] {
        let len = self.rows * self.cols;
        &self.data[i * len..(i + 1) * len]
    }

    /// Matrix `i`, mutable.
    pub fn matrix_mut(&mut self, i: usize) -> &mut [T] {
        let len = self.rows * self.cols;
        &mut self.data[i * len..(i + 1) * len]
    }

    /// Row `r` of matrix `i`. Panics if out of range.
    pub fn row(&self, i: usize, r: usize) -> &[T] {
        assert!(r < self.rows, "row {r} of {}", self.rows);
        let at = (i * self.rows + r) * self.cols;
        &self.data[at..at + self.cols]
    }

    /// Row `r` of matrix `i`, mutable.
    pub fn row_mut(&mut self, i: usize, r: usize) -> &mut [T] {
        assert!(r < self.rows, "row {r} of {}", self.rows);
        let at = (i * self.rows + r) * self.cols;
        &mut self.data[at..at + self.cols]
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

impl<T: Clone> Tensor3<T> {
    /// `[n, rows, cols]` filled with `value`. A zero of a primitive type (`0u8`, `0i32`,
    /// `0f32`) is allocated zeroed, untouched until written, as [`Tensor3::zeros`] is for BF16.
    pub fn filled(n: usize, rows: usize, cols: usize, value: T) -> Self {
        Self {
            n,
            rows,
            cols,
            data: vec![value; n * rows * cols],
        }
    }

    /// Element `(i, r, c)`.
    pub fn get(&self, i: usize, r: usize, c: usize) -> T {
        self.row(i, r)[c].clone()
    }

    /// Sets element `(i, r, c)`.
    pub fn set(&mut self, i: usize, r: usize, c: usize, value: T) {
        self.row_mut(i, r)[c] = value;
    }

    /// A copy of matrix `i` as a [`Tensor2`].
    pub fn to_matrix(&self, i: usize) -> Tensor2<T> {
        Tensor2 {
            rows: self.rows,
            cols: self.cols,
            data: self.matrix(i).to_vec(),
        }
    }
}

impl Tensor3<half::bf16> {
    /// `[n, rows, cols]` of BF16 `+0`, from zeroed memory (as [`Tensor2::zeros`]).
    #[must_use]
    pub fn zeros(n: usize, rows: usize, cols: usize) -> Self {
        use half::vec::HalfBitsVecExt;
        Self {
            n,
            rows,
            cols,
            data: vec![0u16; n * rows * cols].reinterpret_into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `[3, 4, 5]` with element `(i, r, c)` = `100i + 10r + c`.
    fn t3() -> Tensor3<u32> {
        let data = (0..3 * 4 * 5)
            .map(|x| 100 * (x / 20) + 10 * (x / 5 % 4) + x % 5)
            .collect();
        Tensor3::new(3, 4, 5, data).unwrap()
    }

    #[test]
    fn tensor3_indexes_matrices_then_rows() {
        let mut t = t3();
        assert_eq!(t.shape(), (3, 4, 5));
        assert_eq!(t.row(2, 3), &[230, 231, 232, 233, 234]);
        assert_eq!(t.matrix(1).len(), 20);
        assert_eq!(t.matrix(1)[7], 112);
        assert_eq!(t.get(0, 1, 4), 14);
        t.set(1, 0, 0, 7);
        t.row_mut(2, 0)[1] = 8;
        assert_eq!((t.matrix(1)[0], t.get(2, 0, 1)), (7, 8));
        // Matrices round-trip through Tensor2.
        let m: Vec<_> = (0..3).map(|i| t.to_matrix(i)).collect();
        assert_eq!(m[2].row(3), t.row(2, 3));
        assert_eq!(Tensor3::from_matrices(4, 5, m).unwrap(), t);
    }

    #[test]
    fn tensor3_refuses_wrong_shapes() {
        assert!(Tensor3::new(2, 2, 2, vec![0u8; 7]).is_err());
        let m = vec![Tensor2::filled(4, 5, 0u8), Tensor2::filled(5, 4, 0u8)];
        assert!(Tensor3::from_matrices(4, 5, m).is_err());
    }

    #[test]
    #[should_panic(expected = "row 4 of 4")]
    fn a_row_past_the_matrix_is_not_read_from_the_next() {
        let _ = t3().row(0, 4);
    }
}
