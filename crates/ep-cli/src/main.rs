//! The `ep` command: `ep bench` (dispatch and combine on the simulator, verified against the
//! oracle, timed beside the cost model's prediction; the library's [`ep_cli::bench`]), `ep layout`
//! (plan + oracle on a generated or replayed workload, output dumps and digests) and `ep doctor`
//! (machine checks for NVLink, NVSHMEM and IBGDA). Each subcommand lives in its own module;
//! `main` parses and dispatches. Reusable parts (options, NumPy I/O, the benchmark) live in the
//! `ep_cli` library.

use clap::{Parser, Subcommand};

mod doctor;
mod layout;

/// Large freed blocks are reused by the next benchmark iteration (`ep_sim::alloc`).
#[global_allocator]
static ALLOC: ep_sim::alloc::CachingAlloc = ep_sim::alloc::CachingAlloc::new();

/// ep-rs command-line tools.
#[derive(Debug, Parser)]
#[command(
    name = "ep",
    version,
    about = "ep-rs: Mixture-of-Experts all-to-all tools"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run dispatch and combine on a backend (the simulator by default), verify every result
    /// against the oracle, and print DeepEP-style bandwidth and latency beside the cost model's
    /// prediction. Exit codes: 0 verified, 1 mismatch, 2 usage error, 3 other errors, 130/143
    /// stopped by SIGINT/SIGTERM.
    Bench(ep_cli::bench::BenchArgs),
    /// Generate a seeded workload (or read one from .npy files), plan every rank's
    /// dispatch/combine, check against the oracle, print the output digest, dump on request.
    Layout(layout::LayoutArgs),
    /// Check this machine for intranode NVLink, NVSHMEM and IBGDA, with the exact fixes.
    Doctor(doctor::DoctorArgs),
    /// Internal: one rank of `ep doctor --probe` (initialises NVSHMEM and reports).
    #[command(name = "__nvshmem-probe", hide = true)]
    NvshmemProbe,
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Bench(args) => {
            ep_cli::interrupt::install();
            match ep_cli::bench::run_any(&args) {
                Ok(code) => Ok(code),
                Err(e) => {
                    eprintln!("ep bench: {}", ep_cli::bench::error_chain(&e));
                    std::process::exit(e.exit_code());
                }
            }
        }
        Command::Layout(args) => layout::run(&args),
        Command::Doctor(args) => doctor::run(&args),
        Command::NvshmemProbe => doctor::probe_child(),
    };
    match code {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("ep: {e:#}");
            std::process::exit(exit_code(&e));
        }
    }
}

/// The exit code of a failed `ep layout` or `ep doctor`: 2 for usage errors (options that
/// cannot work), 3 for run-time errors, as `ep bench`'s `BenchError::exit_code`.
#[must_use]
fn exit_code(e: &anyhow::Error) -> i32 {
    use ep_cli::workload::OptionsError;
    if let Some(p) = e.downcast_ref::<ep_cli::preflight::PreflightError>() {
        return p.exit_code();
    }
    match e.downcast_ref::<OptionsError>() {
        Some(OptionsError::ExpertsRequired | OptionsError::Generate(_) | OptionsError::Cast(_)) => {
            2
        }
        _ => 3,
    }
}
