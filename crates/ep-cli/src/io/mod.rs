//! NumPy I/O placeholder.
