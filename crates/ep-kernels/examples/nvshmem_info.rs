//! Prints where NVSHMEM was found (or every place searched), its version, and which native
//! bootstrap plugins it ships. Needs no GPU: only pre-init queries.

use ep_kernels::nvshmem::NativeBootstrap;

fn main() {
    let explicit = std::env::args_os().nth(1).map(std::path::PathBuf::from);
    match ep_kernels::nvshmem::load_checked(explicit.as_deref()) {
        Ok(lib) => {
            println!(
                "NVSHMEM {} at {}",
                lib.vendor_version(),
                lib.path().display()
            );
            let (a, b) = lib.info_get_version();
            println!(
                "OpenSHMEM spec level {a}.{b}; init status {}",
                lib.init_status()
            );
            for m in [
                NativeBootstrap::Mpi,
                NativeBootstrap::Pmix,
                NativeBootstrap::Pmi2,
                NativeBootstrap::Pmi,
            ] {
                println!(
                    "bootstrap {:6} ({}): {}",
                    m.env_value(),
                    m.plugin(),
                    if m.available(&lib) {
                        "shipped"
                    } else {
                        "absent"
                    }
                );
            }
        }
        Err(e) => {
            println!("{e}");
            std::process::exit(1);
        }
    }
}
