//! Value parsers of the commands' options: a value that cannot work is a usage error (exit 2,
//! clap's message naming the option) before the command runs, never a plausible report about
//! something else.

use std::path::PathBuf;

/// A path that must exist (e.g. `ep doctor --nvshmem`).
pub fn existing_path(s: &str) -> Result<PathBuf, String> {
    let p = PathBuf::from(s);
    if p.exists() {
        Ok(p)
    } else {
        Err(format!("{s} does not exist"))
    }
}

/// A directory that must exist (e.g. `ep doctor --sysroot`).
pub fn existing_dir(s: &str) -> Result<PathBuf, String> {
    let p = existing_path(s)?;
    if p.is_dir() {
        Ok(p)
    } else {
        Err(format!("{s} is not a directory"))
    }
}

/// A count of at least 1.
pub fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// A `u32` count of at least 1.
pub fn at_least_one_u32(s: &str) -> Result<u32, String> {
    let n = at_least_one(s)?;
    u32::try_from(n).map_err(|e| e.to_string())
}
