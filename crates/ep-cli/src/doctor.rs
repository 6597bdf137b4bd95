//! `ep doctor`: gathers facts (files under a sysroot, plus, on the machine itself, the loaded
//! NVSHMEM, `nvidia-smi topo -m`, CUDA's devices and peer access, rdma-core's device list,
//! ports, GIDs and mlx5 DevX, and GDRCopy's `gdr_open`), runs ep-setup's `diagnose`, prints
//! checks with their exact fixes and one verdict per capability; `--plan` prints the NVSHMEM
//! environment plan; `--probe` starts NVSHMEM for real in child processes (`ep
//! __nvshmem-probe`) and reports which transports came up, and registers a small GPU buffer
//! with the NIC (dma-buf, then peer memory). With `--sysroot` (another machine's files) no live
//! probe runs.

use std::collections::BTreeMap;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use clap::Args;
use ep_core::config::{BufferConfig, EnvPlan, IbgdaNicHandler, nvshmem_env_plan};
use ep_kernels::nvshmem::launch::{RankLaunch, launch_ranks, rank_from_env};
use ep_kernels::nvshmem::report::env_true;
use ep_kernels::nvshmem::{Bootstrap, BringUp, IbgdaState, TcpRendezvous, env::EnvEntry};
use ep_kernels::topology::{RegistrationBuffer, gpu_topology};
use ep_setup::{
    Attempt, Capability, CudaDevice, CudaFacts, CudaPeer, DevxOpen, Facts, GatherOptions,
    GdrcopyLive, GidEntry, NvshmemFacts, ProbeResult, RegistrationProbe, Report, Status, Topology,
    VerbsDevice, VerbsFacts, VerbsPort, Version, closest_nics, diagnose, format_gid, gather,
    gid_type_name, inspect_nvshmem, link_layer_name, nvidia_smi_topo, port_state_name,
};
use ibgda_sys::{Device, GdrApi, GdrHandle, IbVerbs, Mlx5Dv};
use serde::{Deserialize, Serialize};

/// Marks the probe child's result line on its stdout.
const PROBE_TAG: &str = "EP_DOCTOR_PROBE ";

/// Options of `ep doctor`.
#[derive(Debug, Args)]
pub(crate) struct DoctorArgs {
    /// Print the report (or the plan) as JSON.
    #[arg(long)]
    json: bool,
    /// Read /proc, /sys, /etc, /dev under DIR instead of / (a captured or fixture tree); live
    /// libraries and tools are then not queried.
    #[arg(long, value_name = "DIR", value_parser = ep_cli::args::existing_dir)]
    sysroot: Option<PathBuf>,
    /// Exit with status 2 unless CAP is usable (repeatable): intranode-nvlink,
    /// low-latency-nvlink, ibgda-gpu-initiated, ibgda-cpu-assisted. Without it, the status is
    /// 1 when no GPU path at all is usable.
    #[arg(long, value_name = "CAP")]
    require: Vec<Capability>,
    /// Start NVSHMEM for real in child processes with the plan's environment and report which
    /// transports came up (a silent fallback made loud).
    #[arg(long)]
    probe: bool,
    /// Processes (GPUs) the probe starts [default: the GPU count, at most 2].
    #[arg(long, value_name = "N", value_parser = ep_cli::args::at_least_one_u32)]
    probe_ranks: Option<u32>,
    /// Print the NVSHMEM environment plan for the configuration given by the options below,
    /// and exit.
    #[arg(long)]
    plan: bool,
    /// EP ranks of the planned buffer [default: 8; with --probe, the probe's ranks].
    #[arg(long, value_name = "R", value_parser = ep_cli::args::at_least_one)]
    ranks: Option<usize>,
    /// Low-latency mode.
    #[arg(long)]
    low_latency: bool,
    /// RC QPs per peer (`num_qps_per_rank`) [default: 24].
    #[arg(long, value_name = "Q")]
    qps: Option<u32>,
    /// Let low-latency kernels reach same-node peers over NVLink (the default).
    #[arg(long, overrides_with = "no_nvlink")]
    allow_nvlink: bool,
    /// Reach every peer through the NIC (`allow_nvlink_for_low_latency_mode=False`).
    #[arg(long)]
    no_nvlink: bool,
    /// Keep NVSHMEM's multi-node NVLink detection (`allow_mnnvl=True`).
    #[arg(long)]
    mnnvl: bool,
    /// `NVSHMEM_QP_DEPTH` to plan [default: 1024].
    #[arg(long, value_name = "D")]
    qp_depth: Option<u32>,
    /// `NVSHMEM_IBGDA_NIC_HANDLER`: auto, gpu, cpu, cpu_host_memory.
    #[arg(long, value_name = "H", default_value = "auto")]
    nic_handler: String,
    /// `num_rdma_bytes` of the planned buffer [default: 1 GiB in low-latency or internode
    /// mode, else 0].
    #[arg(long, value_name = "BYTES")]
    rdma_bytes: Option<u64>,
    /// The `libnvshmem_host.so.3` (or its install directory) to use instead of searching.
    #[arg(long, value_name = "PATH", value_parser = ep_cli::args::existing_path)]
    nvshmem: Option<PathBuf>,
}

/// Runs `ep doctor`; returns the process exit code.
pub(crate) fn run(args: &DoctorArgs) -> Result<i32> {
    if args.plan {
        let ranks = args.ranks.unwrap_or(8);
        let (cfg, plan) = build_plan(args, ranks, false)?;
        if args.json {
            println!(
                "{}",
                serde_json::to_string_pretty(&PlanJson::new(&cfg, &plan))?
            );
        } else {
            print_plan(&cfg, &plan);
        }
        return Ok(0);
    }
    let mut facts = gather_facts(args);
    if args.probe {
        facts.probe = Some(run_probe(args, &facts));
        if is_live(args) {
            facts.registration = Some(probe_registration(&facts));
        }
    }
    let report = diagnose(&facts);
    let code = report.exit_code(&args.require);
    if args.json {
        let out = DoctorJson {
            report: &report,
            require: &args.require,
            exit_code: code,
        };
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print_report(&report, &args.require, code);
    }
    Ok(code)
}

#[derive(Serialize)]
struct DoctorJson<'a> {
    report: &'a Report,
    require: &'a [Capability],
    exit_code: i32,
}

// ---- gathering ------------------------------------------------------------------------------

fn is_live(args: &DoctorArgs) -> bool {
    match &args.sysroot {
        None => true,
        Some(p) => p.canonicalize().is_ok_and(|p| p == Path::new("/")),
    }
}

fn env_dirs(var: &str) -> Vec<String> {
    std::env::var_os(var)
        .map(|v| {
            std::env::split_paths(&v)
                .filter(|p| p.is_absolute())
                .map(|p| p.display().to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// Facts from files under the sysroot; on the machine itself, also the loaded NVSHMEM and
/// `nvidia-smi topo -m`.
fn gather_facts(args: &DoctorArgs) -> Facts {
    let live = is_live(args);
    let root = args.sysroot.clone().unwrap_or_else(|| PathBuf::from("/"));
    let mut opts = GatherOptions::default();
    if live {
        opts.extra_lib_dirs = env_dirs("LD_LIBRARY_PATH");
        for var in ["NVSHMEM_DIR", "NVSHMEM_HOME"] {
            for d in env_dirs(var) {
                opts.nvshmem_dirs.push(format!("{d}/lib"));
                opts.nvshmem_dirs.push(format!("{d}/lib64"));
                opts.nvshmem_dirs.push(d);
            }
        }
    }
    if let Some(p) = &args.nvshmem {
        let p = p.display().to_string();
        opts.nvshmem_dirs.insert(0, format!("{p}/lib"));
        opts.nvshmem_dirs.insert(1, p.clone());
        if let Some((dir, _)) = p.rsplit_once('/') {
            opts.nvshmem_dirs.insert(2, dir.to_string());
        }
    }
    let mut facts = gather(&root, &opts);
    if live {
        live_nvshmem(&mut facts, args.nvshmem.as_deref());
        if facts.topology.is_none() {
            facts.topology = nvidia_smi_topology();
        }
        facts.cuda = Some(cuda_p2p_topology());
        facts.verbs = Some(live_verbs());
        facts.gdrcopy_live = Some(live_gdrcopy());
    }
    facts
}

fn to_core_version(v: nvshmem_sys::Version) -> Version {
    Version::new(v.major, v.minor, v.patch)
}

/// Loads NVSHMEM the way ep-rs will at run time (nvshmem-sys's search) and records its path
/// and version; the file-based facts of its directory (device library, plugins, headers)
/// come from `inspect_nvshmem`.
fn live_nvshmem(facts: &mut Facts, explicit: Option<&Path>) {
    match nvshmem_sys::Nvshmem::load(explicit) {
        Ok(lib) => {
            let dir = lib.lib_dir().display().to_string();
            let mut n = inspect_nvshmem(Path::new("/"), &dir);
            n.host_library = Some(lib.path().display().to_string());
            n.host_version = Some(to_core_version(lib.vendor_version()));
            n.on_search_path = Some(true);
            facts.nvshmem = Some(n);
        }
        Err(nvshmem_sys::Error::LibraryNotFound { .. }) => {
            let n = facts.nvshmem.get_or_insert_with(NvshmemFacts::default);
            match n.host_library.clone() {
                // On disk, but not where ep-rs looks: load that file for its version.
                Some(file) => {
                    n.on_search_path = Some(false);
                    if let Ok(lib) = nvshmem_sys::Nvshmem::load_path(Path::new(&file)) {
                        n.host_version = Some(to_core_version(lib.vendor_version()));
                    }
                }
                None => {
                    n.load_error = Some(
                        "not found by ep-rs's search (NVSHMEM_DIR, NVSHMEM_HOME, pip layouts \
                         of the Pythons on PATH, LD_LIBRARY_PATH, system directories)"
                            .to_string(),
                    );
                }
            }
        }
        Err(e) => {
            let n = facts.nvshmem.get_or_insert_with(NvshmemFacts::default);
            n.load_error = Some(e.to_string());
        }
    }
}

/// GPU count and peer access from the CUDA driver API (ep-kernels' `gpu_topology`), mapped to
/// ep-setup's facts. `nvidia-smi topo -m` stays the source of link types (the driver API does
/// not name links); `diagnose` matches CUDA ordinals to `nvidia-smi`'s GPUs by PCI bus id and
/// fails the topology where nvidia-smi shows NVLink but CUDA refuses peer access.
fn cuda_p2p_topology() -> CudaFacts {
    let mut c = CudaFacts {
        visible_devices: std::env::var("CUDA_VISIBLE_DEVICES").ok(),
        ..CudaFacts::default()
    };
    match gpu_topology() {
        Ok(t) => {
            c.driver_version = Some(t.driver_version);
            c.devices = t
                .devices
                .iter()
                .map(|d| CudaDevice {
                    name: d.name.clone(),
                    pci_bus_id: d.pci_bus_id.clone(),
                    gpu_direct_rdma: d.gpu_direct_rdma,
                    dma_buf: d.dma_buf,
                })
                .collect();
            c.peers = t
                .peers
                .iter()
                .map(|row| {
                    row.iter()
                        .map(|p| {
                            p.map(|p| CudaPeer {
                                can_access_peer: p.can_access_peer,
                                access_supported: p.access_supported,
                                native_atomics: p.native_atomics,
                                performance_rank: p.performance_rank,
                            })
                        })
                        .collect()
                })
                .collect();
        }
        Err(e) => {
            c.library_missing = matches!(e, ep_kernels::Error::CudaDriverMissing);
            if let ep_kernels::Error::Cuda { source, .. } = &e {
                c.error_code = Some(format!("{:?}", source.0));
            }
            c.error = Some(e.to_string());
        }
    }
    c
}

fn os_errno(e: &ibgda_sys::Error) -> Option<i32> {
    match e {
        ibgda_sys::Error::Null { errno, .. } | ibgda_sys::Error::Call { errno, .. } => Some(*errno),
        _ => None,
    }
}

/// rdma-core's own view: the device list, per device mlx5 support, ports and GIDs through
/// verbs, and whether a DevX context opens.
fn live_verbs() -> VerbsFacts {
    let mut v = VerbsFacts::default();
    let verbs = match IbVerbs::load(None) {
        Ok(l) => l,
        Err(e) => {
            v.load_error = Some(e.to_string());
            return v;
        }
    };
    v.library = Some(verbs.path().display().to_string());
    v.dmabuf_mr = verbs.ext.is_some();
    let mlx5 = match Mlx5Dv::load(None) {
        Ok(m) => {
            v.mlx5_library = Some(m.path().display().to_string());
            Some(m)
        }
        Err(e) => {
            v.mlx5_error = Some(e.to_string());
            None
        }
    };
    let list = match verbs.get_device_list() {
        Ok(l) => l,
        Err(ibgda_sys::Error::NoRdmaSubsystem) => {
            v.no_rdma_subsystem = true;
            return v;
        }
        Err(e) => {
            v.list_error = Some(e.to_string());
            return v;
        }
    };
    for dev in list.iter() {
        v.devices.push(verbs_device(&dev, mlx5.as_ref()));
    }
    v
}

/// One device: its name, mlx5 support, ports and GIDs, and whether a DevX context opens.
fn verbs_device(dev: &Device<'_>, mlx5: Option<&Mlx5Dv>) -> VerbsDevice {
    let mut d = VerbsDevice {
        name: dev.name(),
        mlx5: mlx5.map(|m| dev.is_mlx5(m)),
        ..VerbsDevice::default()
    };
    match dev.open() {
        Ok(ctx) => d.ports = verbs_ports(&ctx),
        Err(e) => {
            d.open_errno = os_errno(&e);
            d.open_error = Some(e.to_string());
        }
    }
    if let (Some(m), Some(true)) = (mlx5, d.mlx5) {
        // A context that opens is closed at once (dropped).
        d.devx = Some(match dev.open_devx(m) {
            Ok(_ctx) => DevxOpen {
                opened: true,
                ..DevxOpen::default()
            },
            Err(e) => DevxOpen {
                opened: false,
                errno: os_errno(&e),
                error: Some(e.to_string()),
            },
        });
    }
    d
}

/// The ports of an open context with their GIDs.
fn verbs_ports(ctx: &ibgda_sys::Context<'_>) -> Vec<VerbsPort> {
    let Ok(attr) = ctx.query_device() else {
        return Vec::new();
    };
    let mut ports = Vec::new();
    for port in 1..=attr.phys_port_cnt {
        let Ok(p) = ctx.query_port(port) else {
            continue;
        };
        ports.push(VerbsPort {
            port: port.into(),
            state: port_state_name(p.state),
            link_layer: link_layer_name(p.link_layer).to_string(),
            gid_table_len: u32::try_from(p.gid_tbl_len).unwrap_or(0),
            gids: Vec::new(),
        });
    }
    let total: usize = ports.iter().map(|p| p.gid_table_len as usize).sum();
    if let Ok(table) = ctx.query_gid_table(total.max(1)) {
        for e in table {
            let raw = e.gid.bytes();
            if raw == [0; 16] {
                continue;
            }
            if let Some(p) = ports.iter_mut().find(|p| p.port == e.port_num) {
                p.gids.push(GidEntry {
                    index: e.gid_index,
                    gid: format_gid(&raw),
                    kind: Some(gid_type_name(e.gid_type).to_string()),
                    ndev: None,
                });
            }
        }
    } else {
        // rdma-core < 32: index by index, without GID types.
        for p in &mut ports {
            for i in 0..p.gid_table_len.min(256) {
                let Ok(g) = ctx.query_gid(p.port as u8, i as i32) else {
                    continue;
                };
                let raw = g.bytes();
                if raw != [0; 16] {
                    p.gids.push(GidEntry {
                        index: i,
                        gid: format_gid(&raw),
                        kind: None,
                        ndev: None,
                    });
                }
            }
        }
    }
    for p in &mut ports {
        p.gids.sort_by_key(|g| g.index);
    }
    ports
}

/// Loads GDRCopy and calls `gdr_open`; when that fails, tells a missing driver from a device
/// node this user cannot open.
fn live_gdrcopy() -> GdrcopyLive {
    let mut g = GdrcopyLive::default();
    let api = match GdrApi::load(None) {
        Ok(a) => a,
        Err(e) => {
            g.library_error = Some(e.to_string());
            return g;
        }
    };
    g.library = Some(api.path().display().to_string());
    let (major, minor) = api.runtime_version();
    g.runtime_version = Some(format!("{major}.{minor}"));
    match GdrHandle::open(&api) {
        Ok(h) => {
            g.opened = true;
            if let Ok((a, b)) = h.driver_version() {
                g.driver_version = Some(format!("{a}.{b}"));
            }
        }
        Err(_) => {
            g.dev_access_error = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/gdrdrv")
                .err()
                .map(|e| e.to_string());
        }
    }
    g
}

/// `nvidia-smi topo -m`, parsed; `None` when nvidia-smi is absent or fails.
fn nvidia_smi_topology() -> Option<Topology> {
    let out = Command::new("nvidia-smi")
        .args(["topo", "-m"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    nvidia_smi_topo(&String::from_utf8_lossy(&out.stdout))
}

// ---- plan -----------------------------------------------------------------------------------

/// The buffer configuration the flags describe, and its NVSHMEM environment plan against this
/// process's environment. `force_nvshmem` turns on low-latency mode when the configuration
/// would not use NVSHMEM at all (so the probe has something to start).
fn build_plan(
    args: &DoctorArgs,
    ranks: usize,
    force_nvshmem: bool,
) -> Result<(BufferConfig, EnvPlan)> {
    let mut cfg = BufferConfig::new(ranks);
    cfg.low_latency_mode = args.low_latency;
    if force_nvshmem && !cfg.uses_nvshmem() {
        cfg.low_latency_mode = true;
    }
    if let Some(q) = args.qps {
        cfg.num_qps_per_rank = q;
    }
    if let Some(d) = args.qp_depth {
        cfg.nvshmem_qp_depth = d;
    }
    cfg.allow_nvlink_for_low_latency_mode = !args.no_nvlink;
    cfg.allow_mnnvl = args.mnnvl;
    let internode = ranks > 8;
    cfg.num_rdma_bytes = args
        .rdma_bytes
        .unwrap_or(if cfg.low_latency_mode || internode {
            1 << 30
        } else {
            0
        });
    let user_env: BTreeMap<String, String> = std::env::vars()
        .filter(|(k, _)| k.starts_with("NVSHMEM_"))
        .collect();
    let handler = IbgdaNicHandler::from_env_value(&args.nic_handler).ok_or_else(|| {
        anyhow!(
            "--nic-handler {:?}: use one of auto, gpu, cpu, cpu_host_memory",
            args.nic_handler
        )
    })?;
    let plan = nvshmem_env_plan(&cfg, &user_env, handler).with_context(|| {
        format!(
            "planning the NVSHMEM environment for {ranks} rank(s), {} mode",
            if cfg.low_latency_mode {
                "low-latency"
            } else {
                "normal"
            }
        )
    })?;
    Ok((cfg, plan))
}

#[derive(Serialize)]
struct PlanEntryJson<'a> {
    name: &'a str,
    planned: &'a str,
    user: Option<&'a str>,
    effective: &'a str,
    reason: &'a str,
}

#[derive(Serialize)]
struct PlanJson<'a> {
    config: &'a BufferConfig,
    uses_nvshmem: bool,
    initialises_nvshmem: bool,
    entries: Vec<PlanEntryJson<'a>>,
    qp_depth: Option<u32>,
    num_rc_per_pe: Option<u32>,
    cumem_granularity: Option<u64>,
    nic_handler: Option<&'static str>,
    num_pes: Option<usize>,
    num_jobs: Option<usize>,
}

impl<'a> PlanJson<'a> {
    fn new(cfg: &'a BufferConfig, plan: &'a EnvPlan) -> Self {
        let r = plan.resources.as_ref();
        Self {
            config: cfg,
            uses_nvshmem: plan.uses_nvshmem,
            initialises_nvshmem: plan.initialises_nvshmem,
            entries: plan
                .entries
                .iter()
                .map(|e| PlanEntryJson {
                    name: e.name,
                    planned: &e.planned,
                    user: e.user.as_deref(),
                    effective: e.effective(),
                    reason: e.reason,
                })
                .collect(),
            qp_depth: r.map(|r| r.qp_depth),
            num_rc_per_pe: r.map(|r| r.num_rc_per_pe),
            cumem_granularity: r.map(|r| r.cumem_granularity),
            nic_handler: r.map(|r| r.nic_handler.as_env_value()),
            num_pes: plan.world.map(|w| w.num_pes),
            num_jobs: plan.world.map(|w| w.num_jobs),
        }
    }
}

fn print_plan(cfg: &BufferConfig, plan: &EnvPlan) {
    println!(
        "NVSHMEM environment plan: {} ranks, {} mode, {} QPs per rank, NVLink {}, MNNVL {}, \
         num_rdma_bytes {}",
        cfg.num_ranks,
        if cfg.low_latency_mode {
            "low-latency"
        } else {
            "normal"
        },
        cfg.num_qps_per_rank,
        if cfg.allow_nvlink_for_low_latency_mode {
            "allowed"
        } else {
            "off"
        },
        if cfg.allow_mnnvl { "on" } else { "off" },
        cfg.num_rdma_bytes
    );
    if !plan.uses_nvshmem {
        println!(
            "  DeepEP sets no NVSHMEM variable here: intranode normal mode runs on CUDA IPC/VMM \
             buffers only."
        );
        return;
    }
    for e in &plan.entries {
        match &e.user {
            Some(u) if *u != e.planned => println!(
                "  {}={}    # yours, kept (plan: {}); {}",
                e.name, u, e.planned, e.reason
            ),
            Some(u) => println!(
                "  {}={}    # yours, same as the plan; {}",
                e.name, u, e.reason
            ),
            None => println!("  export {}={}    # {}", e.name, e.planned, e.reason),
        }
    }
    if let Some(w) = plan.world {
        println!(
            "  NVSHMEM world: {} PE(s) per job, {} job(s){}",
            w.num_pes,
            w.num_jobs,
            if w.strided_rdma_team {
                ", plus the strided CPU RDMA team"
            } else {
                ""
            }
        );
    } else {
        println!("  NVSHMEM is not initialised (num_rdma_bytes = 0)");
    }
}

// ---- probe ----------------------------------------------------------------------------------

/// What a probe child prints (one line, after [`PROBE_TAG`]).
#[derive(Debug, Default, Serialize, Deserialize)]
struct ProbeLine {
    initialized: bool,
    version: Option<String>,
    library: Option<String>,
    transports_up: Vec<String>,
    failed: Vec<String>,
    plugins: Vec<String>,
    p2p_peers: Vec<u32>,
    remote_peers: Vec<u32>,
    ibgda: String,
    error: Option<String>,
}

/// Bytes of GPU memory the registration probe registers.
const REGISTRATION_BYTES: usize = 2 << 20;

/// `--probe` on the machine itself: registers a small GPU buffer with the NIC closest to
/// GPU 0, through dma-buf and through peer memory, and reports which worked.
fn probe_registration(facts: &Facts) -> RegistrationProbe {
    let skip = |why: String| RegistrationProbe {
        skipped: Some(why),
        ..RegistrationProbe::default()
    };
    let Some(v) = facts.verbs.as_ref() else {
        return skip("rdma-core not queried".to_string());
    };
    let opened: Vec<&str> = v
        .devices
        .iter()
        .filter(|d| d.open_error.is_none())
        .map(|d| d.name.as_str())
        .collect();
    if opened.is_empty() {
        let why = if v.no_rdma_subsystem {
            "no RDMA NIC (no kernel RDMA support)".to_string()
        } else if v.devices.is_empty() {
            "no RDMA NIC (libibverbs lists none)".to_string()
        } else {
            "no RDMA device opens (see nic.verbs-ports)".to_string()
        };
        return skip(why);
    }
    // The NIC closest to GPU 0 when known, else the first mlx5 device that opens.
    let closest = closest_nics(facts)
        .into_iter()
        .next()
        .and_then(|(_, best)| best.map(|(nic, _)| nic))
        .filter(|n| opened.contains(&n.as_str()));
    let nic = closest
        .or_else(|| {
            opened
                .iter()
                .find(|n| n.starts_with("mlx5"))
                .map(|n| n.to_string())
        })
        .unwrap_or_else(|| opened[0].to_string());
    let buf = match RegistrationBuffer::alloc(0, REGISTRATION_BYTES) {
        Ok(b) => b,
        Err(e) => return skip(format!("no GPU buffer to register: {e}")),
    };
    let mut r = RegistrationProbe {
        nic: Some(nic.clone()),
        gpu: Some(0),
        ..RegistrationProbe::default()
    };
    if let Err(e) = register_on(&nic, &buf, &mut r) {
        return skip(format!("cannot open {nic} for the probe: {e}"));
    }
    r
}

/// Opens `nic`, allocates a protection domain, tries both registrations of `buf`, and
/// releases everything before returning.
fn register_on(
    nic: &str,
    buf: &RegistrationBuffer,
    r: &mut RegistrationProbe,
) -> Result<(), ibgda_sys::Error> {
    let verbs = IbVerbs::load(None)?;
    let list = verbs.get_device_list()?;
    let dev = list
        .iter()
        .find(|d| d.name() == nic)
        .ok_or(ibgda_sys::Error::Null {
            op: "ibv_get_device_list (device gone)",
            errno: 19,
        })?;
    // Dropped in reverse order at the end: the PD, then the context, then the list.
    let ctx = dev.open()?;
    let pd = ctx.alloc_pd()?;
    let access = ibgda_sys::IBV_ACCESS_LOCAL_WRITE
        | ibgda_sys::IBV_ACCESS_REMOTE_WRITE
        | ibgda_sys::IBV_ACCESS_REMOTE_READ
        | ibgda_sys::IBV_ACCESS_REMOTE_ATOMIC;
    let attempt = |res: Result<(), String>| match res {
        Ok(()) => Attempt {
            ok: true,
            error: None,
        },
        Err(e) => Attempt {
            ok: false,
            error: Some(e),
        },
    };
    r.dmabuf = Some(match buf.dmabuf_fd() {
        Err(e) => Attempt {
            ok: false,
            error: Some(e.to_string()),
        },
        Ok(fd) => attempt(
            pd.try_register_dmabuf(fd.as_fd(), 0, buf.len(), buf.device_ptr(), access)
                .map_err(|e| e.to_string()),
        ),
    });
    r.peermem = Some(attempt(
        pd.try_register(buf.device_ptr(), buf.len(), access)
            .map_err(|e| e.to_string()),
    ));
    Ok(())
}

/// Starts `ep __nvshmem-probe` once per probe rank with the plan's environment and collects
/// what rank 0 saw.
fn run_probe(args: &DoctorArgs, facts: &Facts) -> ProbeResult {
    let gpus = facts
        .topology
        .as_ref()
        .map_or(facts.gpus.len(), Topology::gpu_count);
    let world = args.probe_ranks.unwrap_or(gpus.clamp(1, 2) as u32).max(1);
    let mut result = ProbeResult::default();
    let plan = match build_plan(args, args.ranks.unwrap_or(world as usize), true) {
        Ok((_, plan)) => plan,
        Err(e) => {
            result.error = Some(format!("{e:#}"));
            return result;
        }
    };
    let entries: Vec<EnvEntry> = plan
        .entries
        .iter()
        .map(|e| EnvEntry::new(e.name, e.planned.clone(), e.reason))
        .collect();
    let program = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            result.error = Some(format!("cannot find the ep executable: {e}"));
            return result;
        }
    };
    let launch = RankLaunch {
        program,
        args: vec!["__nvshmem-probe".to_string()],
        world,
        plan: entries,
        // Multicast can take shared GPUs down (GPU.md): keep it off whatever the plan says.
        extra_env: vec![
            ("NVSHMEM_DISABLE_NVLS".to_string(), "1".to_string()),
            ("NCCL_NVLS_ENABLE".to_string(), "0".to_string()),
        ],
        timeout: Duration::from_secs(120),
    };
    let launched = match launch_ranks(&launch) {
        Ok(l) => l,
        Err(e) => {
            result.error = Some(format!("probe processes: {e}"));
            return result;
        }
    };
    result.env = launched
        .applied
        .iter()
        .map(|a| (a.var.clone(), a.value.clone()))
        .collect();
    result.ibgda_requested = env_true(
        result
            .env
            .iter()
            .find(|(k, _)| k == "NVSHMEM_IB_ENABLE_IBGDA")
            .map(|(_, v)| v.as_str()),
    );
    let Some(rank0) = launched.outcomes.first() else {
        result.error = Some("no probe process ran".to_string());
        return result;
    };
    result.log = rank0
        .output
        .lines()
        .filter(|l| !l.starts_with(PROBE_TAG))
        .filter(|l| {
            let l = l.to_ascii_lowercase();
            l.contains("init failed") || l.contains("warn") || l.contains("error")
        })
        .take(20)
        .map(str::to_string)
        .collect();
    let line = rank0
        .output
        .lines()
        .find_map(|l| l.strip_prefix(PROBE_TAG))
        .and_then(|j| serde_json::from_str::<ProbeLine>(j).ok());
    let Some(line) = line else {
        result.error = Some(format!(
            "rank 0 exited with {:?} without a report",
            rank0.code
        ));
        return result;
    };
    result.initialized = line.initialized;
    result.transports_up = line
        .transports_up
        .iter()
        .map(|t| t.to_ascii_uppercase())
        .collect();
    result.transports_failed = line.failed.iter().map(|t| t.to_ascii_uppercase()).collect();
    result.error = line.error;
    if result.initialized {
        result.log.insert(
            0,
            format!(
                "NVSHMEM {} ({}): {} PE(s); P2P peers {:?}, remote peers {:?}; plugins loaded \
                 {:?}; IBGDA {}",
                line.version.as_deref().unwrap_or("?"),
                line.library.as_deref().unwrap_or("?"),
                world,
                line.p2p_peers,
                line.remote_peers,
                line.plugins,
                line.ibgda
            ),
        );
    }
    result
}

/// One rank of the probe (`ep __nvshmem-probe`, started by [`run_probe`]): initialise NVSHMEM
/// over the launcher's rendezvous, print what came up on one tagged line, finalise.
pub(crate) fn probe_child() -> Result<i32> {
    let (rank, world) =
        rank_from_env().context("__nvshmem-probe is started by `ep doctor --probe`")?;
    let rdv = TcpRendezvous::from_env()?;
    let mut line = ProbeLine::default();
    let code = match BringUp::new(rank, world, Bootstrap::UniqueId(&rdv))
        .device(rank as usize)
        .init()
    {
        Ok(session) => {
            let r = session.report();
            line.initialized = true;
            line.version = Some(r.version.to_string());
            line.library = Some(r.library.display().to_string());
            line.transports_up = r.transports_up();
            line.failed = r.failed_transports.clone();
            line.plugins = r.plugins_loaded.clone();
            line.p2p_peers = r.p2p_peers.clone();
            line.remote_peers = r.remote_peers.clone();
            line.ibgda = match &r.ibgda {
                IbgdaState::NotRequested => "not requested".to_string(),
                IbgdaState::Live => "live".to_string(),
                IbgdaState::FellBack { reason } => format!("fell back: {reason}"),
            };
            let fin = session.finalize();
            if let Err(e) = fin {
                line.error = Some(format!("finalize: {e}"));
            }
            0
        }
        Err(e) => {
            line.error = Some(e.to_string());
            1
        }
    };
    println!("{PROBE_TAG}{}", serde_json::to_string(&line)?);
    Ok(code)
}

// ---- text output ----------------------------------------------------------------------------

fn print_report(report: &Report, require: &[Capability], code: i32) {
    let f = &report.facts;
    let host = f.os.pretty_name.as_deref().unwrap_or("unknown OS");
    let kernel = f.os.kernel_release.as_deref().unwrap_or("?");
    println!("ep doctor: sysroot {} ({host}, kernel {kernel})", f.sysroot);
    if f.container.in_container {
        println!(
            "  inside a container ({})",
            f.container.evidence.as_deref().unwrap_or("?")
        );
    }
    println!();
    for c in &report.checks {
        println!("{:<5} {:<26} {}", c.status.label(), c.id, c.title);
        if !c.detail.is_empty() {
            for l in c.detail.lines() {
                println!("      {l}");
            }
        }
        if let Some(fix) = c.fix.as_deref().filter(|_| c.status != Status::Pass) {
            println!("      fix:");
            for l in fix.lines() {
                println!("        {l}");
            }
        }
    }
    if let Some(p) = &f.probe
        && !p.log.is_empty()
    {
        println!("\nprobe:");
        for l in &p.log {
            println!("  {l}");
        }
    }
    println!("\ncapabilities:");
    for v in &report.verdicts {
        let why = if v.because.is_empty() {
            String::new()
        } else if v.usable {
            format!(" (caveats: {})", v.because.join(", "))
        } else {
            format!(" (blocked by: {})", v.because.join(", "))
        };
        println!(
            "{:<5} {:<22} {}{why}",
            v.status.label(),
            v.capability.name(),
            v.capability.title()
        );
    }
    let mode = report
        .check("ibgda.mode")
        .map_or(String::new(), |c| c.detail.clone());
    println!("\nIBGDA: {mode}");
    if !require.is_empty() {
        let names: Vec<&str> = require.iter().map(|c| c.name()).collect();
        println!("required: {} -> exit {code}", names.join(", "));
    } else if code != 0 {
        println!("no GPU path is usable -> exit {code}");
    }
}
