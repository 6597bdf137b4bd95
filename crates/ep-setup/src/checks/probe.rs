//! The `--probe` result: NVSHMEM initialised, and whether IBGDA came up or NVSHMEM fell back.

use crate::facts::Facts;
use crate::report::{Check, Status};

use super::{CPU, GPU, LL, check};

pub(crate) fn probe(f: &Facts) -> Vec<Check> {
    let Some(p) = f.probe.as_ref() else {
        return vec![check(
            "probe",
            "NVSHMEM start-up probe",
            &[],
            Status::Skip,
            "not run (pass --probe)",
            None,
        )];
    };
    let up = if p.transports_up.is_empty() {
        "none reported".to_string()
    } else {
        p.transports_up.join(", ")
    };
    let mut out = Vec::new();
    if p.initialized {
        out.push(check(
            "probe.init",
            "NVSHMEM initialises",
            &[LL],
            Status::Pass,
            format!("NVSHMEM initialised; transports up: {up}"),
            None,
        ));
    } else {
        out.push(check(
            "probe.init",
            "NVSHMEM initialises",
            &[LL, GPU, CPU],
            Status::Fail,
            format!(
                "NVSHMEM did not initialise: {}",
                p.error.as_deref().unwrap_or("no error text")
            ),
            Some(
                "Re-run with `NVSHMEM_DEBUG=INFO ep doctor --probe` and read NVSHMEM's log."
                    .to_string(),
            ),
        ));
    }
    let ibgda_up = p.transports_up.iter().any(|t| t == "IBGDA");
    let ibgda_failed = p.transports_failed.iter().any(|t| t == "IBGDA");
    if !p.ibgda_requested {
        out.push(check(
            "probe.ibgda",
            "IBGDA transport came up",
            &[],
            Status::Skip,
            "the probe's plan did not request IBGDA",
            None,
        ));
    } else if p.initialized && ibgda_up && !ibgda_failed {
        out.push(check(
            "probe.ibgda",
            "IBGDA transport came up",
            &[GPU, CPU],
            Status::Pass,
            "IBGDA transport initialised",
            None,
        ));
    } else {
        let detail = if ibgda_failed {
            format!(
                "NVSHMEM printed `init failed for transport: IBGDA` and carried on with {up}: \
                 inter-node traffic would silently use another path"
            )
        } else {
            format!("IBGDA was requested but did not come up (transports up: {up})")
        };
        out.push(check(
            "probe.ibgda",
            "IBGDA transport came up",
            &[GPU, CPU],
            Status::Fail,
            detail,
            Some(
                "Fix the failing checks above (driver keys or GDRCopy, NIC, peer memory)."
                    .to_string(),
            ),
        ));
    }
    out
}
