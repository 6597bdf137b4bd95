//! The `ep` command: `ep layout` (plan + oracle on a generated or replayed workload, output
//! dumps and digests) and `ep doctor` (machine checks for NVLink, NVSHMEM and IBGDA). Each
//! subcommand lives in its own module; `main` parses and dispatches. Reusable parts (NumPy I/O)
//! live in the `ep_cli` library.

use clap::{Parser, Subcommand};

mod doctor;
mod layout;

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
        Command::Layout(args) => layout::run(&args),
        Command::Doctor(args) => doctor::run(&args),
        Command::NvshmemProbe => doctor::probe_child(),
    };
    match code {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("ep: {e:#}");
            std::process::exit(3);
        }
    }
}
