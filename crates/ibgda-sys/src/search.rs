//! Where the libraries are looked for, in order: an explicit path (then the only place), the
//! library's home variable (`$RDMA_CORE_HOME`, `$GDRCOPY_HOME`: `lib/`, `lib64/`),
//! `$LD_LIBRARY_PATH`, then the system library directories. Only absolute paths are produced.

use std::path::{Path, PathBuf};

/// A library ibgda-sys loads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LibSpec {
    /// The versioned file name (`libibverbs.so.1`).
    pub file: &'static str,
    /// The variable naming its install root.
    pub home_var: &'static str,
    /// Extra directories its installers use.
    pub extra_dirs: &'static [&'static str],
    /// What installs it.
    pub hint: &'static str,
}

/// rdma-core's verbs library.
pub const LIBIBVERBS: LibSpec = LibSpec {
    file: "libibverbs.so.1",
    home_var: "RDMA_CORE_HOME",
    extra_dirs: &[],
    hint: "install rdma-core (Debian/Ubuntu: libibverbs1, RHEL: libibverbs) or MLNX_OFED",
};
/// rdma-core's mlx5 direct-verbs library.
pub const LIBMLX5: LibSpec = LibSpec {
    file: "libmlx5.so.1",
    home_var: "RDMA_CORE_HOME",
    extra_dirs: &[],
    hint: "install rdma-core's mlx5 provider (Debian/Ubuntu: ibverbs-providers) or MLNX_OFED",
};
/// GDRCopy's user library.
pub const LIBGDRAPI: LibSpec = LibSpec {
    file: "libgdrapi.so.2",
    home_var: "GDRCOPY_HOME",
    extra_dirs: &[
        "/usr/local/gdrcopy/lib",
        "/opt/gdrcopy/lib",
        "/opt/mellanox/gdrcopy/lib",
    ],
    hint: "install GDRCopy (libgdrapi.so.2) and load its gdrdrv kernel module",
};

/// A snapshot of the environment the search depends on; tests build their own.
#[derive(Clone, Debug, Default)]
pub struct SearchEnv {
    /// Value of the library's home variable.
    pub home: Option<PathBuf>,
    /// `$LD_LIBRARY_PATH`, split.
    pub ld_library_path: Vec<PathBuf>,
    /// System directories, searched last.
    pub system_dirs: Vec<PathBuf>,
}

impl SearchEnv {
    /// Reads the current process environment for `spec`.
    pub fn from_process(spec: &LibSpec) -> Self {
        let triplet = format!("/usr/lib/{}-linux-gnu", std::env::consts::ARCH);
        let mut system_dirs: Vec<PathBuf> = spec.extra_dirs.iter().map(PathBuf::from).collect();
        for d in [
            triplet.as_str(),
            "/usr/lib64",
            "/usr/local/lib",
            "/usr/local/lib64",
            "/usr/lib",
        ] {
            system_dirs.push(PathBuf::from(d));
        }
        Self {
            home: std::env::var_os(spec.home_var)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from),
            ld_library_path: std::env::var_os("LD_LIBRARY_PATH")
                .map(|v| {
                    std::env::split_paths(&v)
                        .filter(|p| !p.as_os_str().is_empty())
                        .collect()
                })
                .unwrap_or_default(),
            system_dirs,
        }
    }
}

/// Every candidate file for `spec`, in order, without duplicates.
pub fn candidates(spec: &LibSpec, explicit: Option<&Path>, env: &SearchEnv) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    if let Some(p) = explicit {
        out.push(if p.is_dir() {
            p.join(spec.file)
        } else {
            p.to_path_buf()
        });
        return out;
    }
    if let Some(h) = &env.home {
        out.push(h.join("lib").join(spec.file));
        out.push(h.join("lib64").join(spec.file));
    }
    for d in env.ld_library_path.iter().chain(&env.system_dirs) {
        out.push(d.join(spec.file));
    }
    let mut unique = Vec::with_capacity(out.len());
    for p in out {
        if !unique.contains(&p) {
            unique.push(p);
        }
    }
    unique
}

/// The first existing candidate, or every place searched.
pub fn locate(
    spec: &LibSpec,
    explicit: Option<&Path>,
    env: &SearchEnv,
) -> Result<PathBuf, Vec<PathBuf>> {
    let all = candidates(spec, explicit, env);
    all.iter()
        .find(|p| p.is_file())
        .map(|p| std::path::absolute(p).unwrap_or_else(|_| p.clone()))
        .ok_or(all)
}
