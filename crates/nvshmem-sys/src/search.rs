//! Where `libnvshmem_host.so.3` is looked for, in order:
//!
//! 1. an explicit path given by the caller (a file, or a directory holding `lib/` or the file);
//!    when given, it is the only place searched;
//! 2. `$NVSHMEM_DIR`, then `$NVSHMEM_HOME` (`lib/`, `lib64/`, the directory itself);
//! 3. the `nvidia-nvshmem-cu13` / `nvidia-nvshmem-cu12` pip layouts (`nvidia/nvshmem/lib`,
//!    `nvidia/cu13/lib`, `nvidia/cu12/lib`) in the `site-packages` / `dist-packages` of every
//!    Python found on `$PATH` (virtual environments included), then the user site;
//! 4. `$LD_LIBRARY_PATH`, the Debian/RPM package directories (`<libdir>/nvshmem/{13,12}`) and
//!    the system library directories.
//!
//! Only absolute paths are produced, so `dlopen` never falls back to its own search.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The file names tried in each directory, most specific first.
pub const LIB_NAMES: [&str; 2] = ["libnvshmem_host.so.3", "libnvshmem_host.so"];

/// A snapshot of the environment the search depends on; tests build their own.
#[derive(Clone, Debug, Default)]
pub struct SearchEnv {
    /// `$NVSHMEM_DIR`.
    pub nvshmem_dir: Option<PathBuf>,
    /// `$NVSHMEM_HOME`.
    pub nvshmem_home: Option<PathBuf>,
    /// `$PATH`, split.
    pub path: Vec<PathBuf>,
    /// `$LD_LIBRARY_PATH`, split.
    pub ld_library_path: Vec<PathBuf>,
    /// `$HOME` (for the pip user site).
    pub home: Option<PathBuf>,
    /// System library directories, searched last.
    pub system_dirs: Vec<PathBuf>,
}

fn var_path(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

fn split(v: Option<OsString>) -> Vec<PathBuf> {
    v.map(|v| {
        std::env::split_paths(&v)
            .filter(|p| !p.as_os_str().is_empty())
            .collect()
    })
    .unwrap_or_default()
}

impl SearchEnv {
    /// Reads the current process environment.
    pub fn from_process() -> Self {
        Self {
            nvshmem_dir: var_path("NVSHMEM_DIR"),
            nvshmem_home: var_path("NVSHMEM_HOME"),
            path: split(std::env::var_os("PATH")),
            ld_library_path: split(std::env::var_os("LD_LIBRARY_PATH")),
            home: var_path("HOME"),
            system_dirs: default_system_dirs(),
        }
    }
}

/// The system directories searched last, NVSHMEM's distribution packages first.
pub fn default_system_dirs() -> Vec<PathBuf> {
    let triplet = format!("/usr/lib/{}-linux-gnu", std::env::consts::ARCH);
    let mut dirs = Vec::new();
    for base in [triplet.as_str(), "/usr/lib64", "/usr/lib"] {
        for cuda in ["13", "12"] {
            dirs.push(PathBuf::from(format!("{base}/nvshmem/{cuda}")));
        }
    }
    for d in [
        "/usr/local/nvshmem/lib",
        "/opt/nvidia/nvshmem/lib",
        triplet.as_str(),
        "/usr/lib64",
        "/usr/local/lib",
        "/usr/lib",
    ] {
        dirs.push(PathBuf::from(d));
    }
    dirs
}

fn files_in(dir: &Path, out: &mut Vec<PathBuf>) {
    for name in LIB_NAMES {
        out.push(dir.join(name));
    }
}

fn install_root(root: &Path, out: &mut Vec<PathBuf>) {
    files_in(&root.join("lib"), out);
    files_in(&root.join("lib64"), out);
    files_in(root, out);
}

fn sorted_children(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
        .map(|e| e.path())
        .collect();
    // Newest Python first (python3.12 before python3.11).
    v.sort();
    v.reverse();
    v
}

/// Python installation prefixes of the interpreters on `$PATH`: a venv's root for
/// `venv/bin/python3`, and the prefix of what the link resolves to.
fn python_prefixes(path: &[PathBuf]) -> Vec<PathBuf> {
    let mut prefixes = Vec::new();
    for dir in path {
        let pythons = sorted_children(dir, "python3");
        let mut pythons: Vec<PathBuf> = pythons
            .into_iter()
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .map(|n| n == "python3" || n.strip_prefix("python3.").is_some_and(is_minor))
                    .unwrap_or(false)
            })
            .collect();
        if dir.join("python").exists() {
            pythons.push(dir.join("python"));
        }
        for py in pythons {
            if let Some(prefix) = py.parent().and_then(Path::parent) {
                push_unique(&mut prefixes, prefix.to_path_buf());
            }
            if let Ok(real) = std::fs::canonicalize(&py)
                && let Some(prefix) = real.parent().and_then(Path::parent)
            {
                push_unique(&mut prefixes, prefix.to_path_buf());
            }
        }
    }
    prefixes
}

fn is_minor(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

fn push_unique(v: &mut Vec<PathBuf>, p: PathBuf) {
    if !v.contains(&p) {
        v.push(p);
    }
}

fn site_dirs(prefix: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for lib in [prefix.join("lib"), prefix.join("local").join("lib")] {
        for py in sorted_children(&lib, "python3") {
            out.push(py.join("site-packages"));
            out.push(py.join("dist-packages"));
        }
    }
    out
}

fn pip_layouts(site: &Path, out: &mut Vec<PathBuf>) {
    for sub in ["nvidia/nvshmem/lib", "nvidia/cu13/lib", "nvidia/cu12/lib"] {
        files_in(&site.join(sub), out);
    }
}

/// Every candidate file, in search order, without duplicates.
pub fn candidates(explicit: Option<&Path>, env: &SearchEnv) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(p) = explicit {
        if p.is_dir() {
            install_root(p, &mut out);
        } else {
            out.push(p.to_path_buf());
        }
        return out;
    }
    for root in env.nvshmem_dir.iter().chain(env.nvshmem_home.iter()) {
        install_root(root, &mut out);
    }
    for prefix in python_prefixes(&env.path) {
        for site in site_dirs(&prefix) {
            pip_layouts(&site, &mut out);
        }
    }
    if let Some(home) = &env.home {
        for py in sorted_children(&home.join(".local").join("lib"), "python3") {
            pip_layouts(&py.join("site-packages"), &mut out);
        }
    }
    for dir in env.ld_library_path.iter().chain(env.system_dirs.iter()) {
        files_in(dir, &mut out);
    }
    let mut seen = Vec::with_capacity(out.len());
    for p in out {
        push_unique(&mut seen, p);
    }
    seen
}

/// The first candidate that is a file, or every place searched.
pub fn locate(explicit: Option<&Path>, env: &SearchEnv) -> Result<PathBuf, Vec<PathBuf>> {
    let all = candidates(explicit, env);
    match all.iter().find(|p| p.is_file()) {
        Some(p) => Ok(std::path::absolute(p).unwrap_or_else(|_| p.clone())),
        None => Err(all),
    }
}
