//! Compiles `cuda/*.cu` to sm_90 cubins with nvcc and embeds them. Without nvcc the crate still
//! builds: the generated `kernels.rs` then holds, for every kernel, the reason it is missing, and
//! launching returns `Error::KernelsNotBuilt`.
//!
//! nvcc is looked for in `$EP_NVCC`, `$NVCC`, `$CUDA_HOME/bin`, `$CUDA_PATH/bin`,
//! `/usr/local/cuda/bin`, `$PATH`, then the workspace's pip toolchain
//! (`.venv-cuda/lib/python3*/site-packages/nvidia/cu13/bin`, see GPU.md).
//! `EP_KERNELS_NO_NVCC=1` skips compilation. If nvcc is found and fails, the build fails;
//! `EP_REQUIRE_KERNELS=1` (CI) also fails the build when nvcc is missing, so a build without
//! kernels cannot pass unnoticed.
//!
//! Variant (b) of the low-latency kernels (every peer through NVSHMEM's device API) is
//! `cuda/low_latency.cu` compiled a second time, relocatable (`-rdc=true -DEP_LL_NVSHMEM=1`),
//! into `low_latency_nvshmem.cubin`; it is linked at run time against the `libnvshmem_device.a`
//! of the NVSHMEM actually loaded (`src/nvshmem/device_link.rs`). The NVSHMEM headers are looked
//! for in `$NVSHMEM_HOME/include`, `$NVSHMEM_DIR/include`, the workspace's
//! `.venv-cuda/lib/python3*/site-packages/nvidia/nvshmem/include`, then
//! `/opt/torch/.venv/lib/python3*/site-packages/nvidia/nvshmem/include`; their version
//! (`non_abi/nvshmem_version.h`) is recorded, since only a device library of that very version
//! can be linked. `EP_REQUIRE_KERNELS=1` fails the build when this variant cannot be built. When
//! `nvlink` sits beside nvcc and `libnvshmem_device.a` in `<include>/../lib`, the build links the
//! two once as a check (undefined device symbols fail the build, not a GPU run); that output is
//! never shipped.
//!
//! Always (no CUDA needed): emits `ep_protocol_constants.h` from ep-core's protocol constants into
//! `OUT_DIR`, and compiles a host shim of `include/ep_protocol.cuh` (C++, with the `cc` crate)
//! into a static library, so tests can check the header against the Rust protocol through FFI.

use std::path::{Path, PathBuf};
use std::process::Command;

/// (Rust constant, source file, extra nvcc flags) of every kernel module. NORMAL_TRACE,
/// LOW_LATENCY_TRACE: the kernels recording their protocol events (`EP_TRACE`, docs/protocol.md
/// §3.13).
const MODULES: &[(&str, &str, &[&str])] = &[
    ("BRINGUP", "cuda/bringup.cu", &[]),
    ("NORMAL", "cuda/normal.cu", &[]),
    ("NORMAL_TRACE", "cuda/normal.cu", &["-DEP_TRACE=1"]),
    ("LOW_LATENCY", "cuda/low_latency.cu", &[]),
    (
        "LOW_LATENCY_TRACE",
        "cuda/low_latency.cu",
        &["-DEP_TRACE=1"],
    ),
];

/// The source of the low-latency kernels, compiled a second time for variant (b).
const LOW_LATENCY_NVSHMEM_SRC: &str = "cuda/low_latency.cu";

include!("gpu_abi.rs");
const ARCH: &str = "sm_90";

fn main() {
    println!("cargo:rerun-if-changed=cuda");
    println!("cargo:rerun-if-changed=include");
    println!("cargo:rerun-if-changed=build.rs");
    for v in [
        "EP_NVCC",
        "NVCC",
        "CUDA_HOME",
        "CUDA_PATH",
        "EP_KERNELS_NO_NVCC",
        "EP_REQUIRE_KERNELS",
        "NVSHMEM_HOME",
        "NVSHMEM_DIR",
    ] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));

    protocol_rules(&out, &manifest);
    gpu_abi(&out);

    let nvcc = if std::env::var_os("EP_KERNELS_NO_NVCC").is_some_and(|v| v == "1") {
        Err("EP_KERNELS_NO_NVCC=1 was set at build time".to_string())
    } else {
        find_nvcc(&manifest)
    };
    // Installing the pip toolchain must take effect without touching this crate: watch the
    // workspace's `.venv-cuda`. Where nvcc is missing that path does not exist, and Cargo reruns
    // a build script whose watched path is absent on every build, so a later install is seen at
    // once (`EP_KERNELS_NO_NVCC=1` builds without kernels and without that recheck). The root
    // directory itself cannot be watched: Cargo scans a watched directory recursively, `target/`
    // included, and would rebuild every time.
    let venv = manifest
        .parent()
        .and_then(Path::parent)
        .map(|ws| ws.join(".venv-cuda"));
    if let Some(venv) = venv.filter(|v| {
        v.exists() || (nvcc.is_err() && std::env::var_os("EP_KERNELS_NO_NVCC").is_none())
    }) {
        println!("cargo:rerun-if-changed={}", venv.display());
    }
    let require = std::env::var_os("EP_REQUIRE_KERNELS").is_some_and(|v| v == "1");
    if let (true, Err(why)) = (require, &nvcc) {
        panic!("EP_REQUIRE_KERNELS=1 but the CUDA kernels cannot be built: {why}");
    }
    let nvshmem = find_nvshmem_include(&manifest);
    if let (true, Err(why)) = (require, &nvshmem) {
        panic!(
            "EP_REQUIRE_KERNELS=1 but the NVSHMEM variant of the low-latency kernels cannot be built: {why}"
        );
    }
    let headers = nvshmem.as_ref().ok().map(|inc| {
        let version_h = inc.join("non_abi/nvshmem_version.h");
        println!("cargo:rerun-if-changed={}", version_h.display());
        let version = nvshmem_version(&version_h);
        (inc.clone(), version)
    });
    let mut rs = String::from("// Generated by build.rs.\n");
    match &headers {
        Some((inc, (a, b, c))) => rs.push_str(&format!(
            "/// Version of the NVSHMEM headers variant (b) was compiled with.\n\
             pub(crate) const NVSHMEM_HEADERS: Option<(u32, u32, u32)> = Some(({a}, {b}, {c}));\n\
             /// Their include directory.\n\
             pub(crate) const NVSHMEM_INCLUDE: Option<&str> = Some({:?});\n",
            inc.display().to_string()
        )),
        None => rs.push_str(
            "/// Version of the NVSHMEM headers variant (b) was compiled with.\n\
             pub(crate) const NVSHMEM_HEADERS: Option<(u32, u32, u32)> = None;\n\
             /// Their include directory.\n\
             pub(crate) const NVSHMEM_INCLUDE: Option<&str> = None;\n",
        ),
    }
    match nvcc {
        Ok(nvcc) => {
            println!("cargo:rerun-if-changed={}", nvcc.display());
            rs.push_str(&format!("/// The nvcc that built the kernels.\npub(crate) const NVCC: Option<&str> = Some({:?});\n", nvcc.display().to_string()));
            let includes = [manifest.join("include"), out.clone()];
            // One nvcc per module at once: the second low-latency compile would otherwise add
            // its whole duration to the build.
            std::thread::scope(|s| {
                for (name, src, flags) in MODULES {
                    let cubin = out.join(format!("{}.cubin", name.to_lowercase()));
                    let (nvcc, src_path, includes) = (&nvcc, manifest.join(src), &includes);
                    s.spawn(move || compile(nvcc, &src_path, &cubin, includes, flags));
                }
                // Variant (b), and variant (b) recording its protocol events (EP_TRACE).
                for (file, flags) in [
                    (
                        "low_latency_nvshmem.cubin",
                        &["-rdc=true", "-DEP_LL_NVSHMEM=1"][..],
                    ),
                    (
                        "low_latency_nvshmem_trace.cubin",
                        &["-rdc=true", "-DEP_LL_NVSHMEM=1", "-DEP_TRACE=1"][..],
                    ),
                ] {
                    let Some((inc, _)) = &headers else { break };
                    let (nvcc, out, manifest, includes) = (&nvcc, &out, &manifest, &includes);
                    s.spawn(move || {
                        let mut includes = includes.to_vec();
                        includes.push(inc.clone());
                        let rdc = out.join(file);
                        compile(
                            nvcc,
                            &manifest.join(LOW_LATENCY_NVSHMEM_SRC),
                            &rdc,
                            &includes,
                            flags,
                        );
                        link_check(nvcc, inc, &rdc, out);
                    });
                }
            });
            for (name, src, _) in MODULES {
                let cubin = out.join(format!("{}.cubin", name.to_lowercase()));
                rs.push_str(&format!(
                    "/// `{src}` for {ARCH}.\npub(crate) const {name}: Result<&[u8], &str> = Ok(include_bytes!({:?}));\n",
                    cubin.display().to_string()
                ));
            }
            match &nvshmem {
                Ok(_) => rs.push_str(&format!(
                    "/// `{LOW_LATENCY_NVSHMEM_SRC}` for {ARCH}, relocatable, with `EP_LL_NVSHMEM`.\n\
                     pub(crate) const LOW_LATENCY_NVSHMEM: Result<&[u8], &str> = Ok(include_bytes!({:?}));\n\
                     /// The same with `EP_TRACE` (recording its protocol events).\n\
                     pub(crate) const LOW_LATENCY_NVSHMEM_TRACE: Result<&[u8], &str> = Ok(include_bytes!({:?}));\n",
                    out.join("low_latency_nvshmem.cubin").display().to_string(),
                    out.join("low_latency_nvshmem_trace.cubin").display().to_string()
                )),
                Err(why) => {
                    println!("cargo:warning=ep-kernels: building without the NVSHMEM low-latency kernels: {why}");
                    rs.push_str(&format!(
                        "/// `{LOW_LATENCY_NVSHMEM_SRC}` with `EP_LL_NVSHMEM`: not built.\n\
                         pub(crate) const LOW_LATENCY_NVSHMEM: Result<&[u8], &str> = Err({why:?});\n\
                         /// The same with `EP_TRACE`: not built.\n\
                         pub(crate) const LOW_LATENCY_NVSHMEM_TRACE: Result<&[u8], &str> = Err({why:?});\n"
                    ));
                }
            }
        }
        Err(why) => {
            println!("cargo:warning=ep-kernels: building without CUDA kernels: {why}");
            rs.push_str("/// The nvcc that built the kernels.\npub(crate) const NVCC: Option<&str> = None;\n");
            for (name, src, _) in MODULES {
                rs.push_str(&format!(
                    "/// `{src}`: not built.\npub(crate) const {name}: Result<&[u8], &str> = Err({why:?});\n"
                ));
            }
            rs.push_str(&format!(
                "/// `{LOW_LATENCY_NVSHMEM_SRC}` with `EP_LL_NVSHMEM`: not built.\n\
                 pub(crate) const LOW_LATENCY_NVSHMEM: Result<&[u8], &str> = Err({why:?});\n\
                 /// The same with `EP_TRACE`: not built.\n\
                 pub(crate) const LOW_LATENCY_NVSHMEM_TRACE: Result<&[u8], &str> = Err({why:?});\n"
            ));
        }
    }
    std::fs::write(out.join("kernels.rs"), rs).expect("write kernels.rs");
}

fn compile(nvcc: &Path, src: &Path, cubin: &Path, includes: &[PathBuf], extra: &[&str]) {
    let output = Command::new(nvcc)
        .args(includes.iter().map(|i| format!("-I{}", i.display())))
        .args(extra)
        .args([
            "-cubin",
            &format!("-arch={ARCH}"),
            "-O3",
            "-std=c++17",
            "-o",
        ])
        .arg(cubin)
        .arg(src)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", nvcc.display()));
    if !output.status.success() {
        panic!(
            "{} failed on {} ({}):\n{}{}",
            nvcc.display(),
            src.display(),
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

/// Links the relocatable cubin against the headers' `libnvshmem_device.a` with nvlink, only to
/// fail the build on undefined device symbols; skipped (with a warning) when either is absent.
fn link_check(nvcc: &Path, include: &Path, rdc: &Path, out: &Path) {
    let nvlink = nvcc.with_file_name("nvlink");
    // Lexically `<include>/../lib` (`$NVSHMEM_HOME/lib` for `$NVSHMEM_HOME/include`), not
    // through a symlinked include directory.
    let device_a = include
        .parent()
        .unwrap_or(include)
        .join("lib/libnvshmem_device.a");
    if !nvlink.is_file() || !device_a.is_file() {
        println!(
            "cargo:warning=ep-kernels: NVSHMEM device link check skipped: {} or {} is missing",
            nvlink.display(),
            device_a.display()
        );
        return;
    }
    println!("cargo:rerun-if-changed={}", device_a.display());
    let output = Command::new(&nvlink)
        .args([&format!("-arch={ARCH}"), "--cpu-arch=X86_64"])
        .arg(rdc)
        .arg(&device_a)
        .arg("-o")
        .arg(out.join(format!(
            "{}_linkcheck.cubin",
            rdc.file_stem().and_then(|s| s.to_str()).unwrap_or("ll_nvshmem")
        )))
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", nvlink.display()));
    if !output.status.success() {
        panic!(
            "the NVSHMEM low-latency kernels do not link against {} ({} {}):\n{}{}",
            device_a.display(),
            nvlink.display(),
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

/// The first NVSHMEM include directory (holding `nvshmem.h` and `non_abi/nvshmem_version.h`) in
/// the order the crate docs give, or every place searched.
fn find_nvshmem_include(manifest: &Path) -> Result<PathBuf, String> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    for v in ["NVSHMEM_HOME", "NVSHMEM_DIR"] {
        if let Some(p) = std::env::var_os(v).filter(|p| !p.is_empty()) {
            candidates.push(PathBuf::from(p).join("include"));
        }
    }
    let site = "site-packages/nvidia/nvshmem/include";
    let mut venv_libs = vec![PathBuf::from("/opt/torch/.venv/lib")];
    if let Some(ws) = manifest.parent().and_then(Path::parent) {
        venv_libs.insert(0, ws.join(".venv-cuda/lib"));
    }
    for lib in venv_libs {
        let mut pys: Vec<PathBuf> = std::fs::read_dir(&lib)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("python3"))
            })
            .collect();
        pys.sort();
        if pys.is_empty() {
            candidates.push(lib.join("python3*").join(site));
        }
        candidates.extend(pys.into_iter().map(|py| py.join(site)));
    }
    let mut tried = Vec::new();
    for c in candidates {
        if c.join("nvshmem.h").is_file() && c.join("non_abi/nvshmem_version.h").is_file() {
            return Ok(c);
        }
        tried.push(c.display().to_string());
    }
    Err(format!(
        "NVSHMEM headers (nvshmem.h, non_abi/nvshmem_version.h) not found; searched: {}; set NVSHMEM_HOME to an NVSHMEM install (or pip install nvidia-nvshmem-cu13 into .venv-cuda, see GPU.md)",
        tried.join(", ")
    ))
}

/// `NVSHMEM_VENDOR_{MAJOR,MINOR,PATCH}_VERSION` of `nvshmem_version.h`.
fn nvshmem_version(header: &Path) -> (u32, u32, u32) {
    let text = std::fs::read_to_string(header)
        .unwrap_or_else(|e| panic!("reading {}: {e}", header.display()));
    let field = |name: &str| -> u32 {
        text.lines()
            .find_map(|l| {
                let mut w = l.split_whitespace();
                (w.next() == Some("#define") && w.next() == Some(name))
                    .then(|| w.next().and_then(|v| v.parse().ok()))
                    .flatten()
            })
            .unwrap_or_else(|| panic!("{} defines no numeric {name}", header.display()))
    };
    (
        field("NVSHMEM_VENDOR_MAJOR_VERSION"),
        field("NVSHMEM_VENDOR_MINOR_VERSION"),
        field("NVSHMEM_VENDOR_PATCH_VERSION"),
    )
}

fn find_nvcc(manifest: &Path) -> Result<PathBuf, String> {
    let mut tried = Vec::new();
    let mut candidates: Vec<PathBuf> = Vec::new();
    for v in ["EP_NVCC", "NVCC"] {
        if let Some(p) = std::env::var_os(v).filter(|p| !p.is_empty()) {
            candidates.push(PathBuf::from(p));
        }
    }
    for v in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(p) = std::env::var_os(v).filter(|p| !p.is_empty()) {
            candidates.push(PathBuf::from(p).join("bin/nvcc"));
        }
    }
    candidates.push(PathBuf::from("/usr/local/cuda/bin/nvcc"));
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(std::env::split_paths(&path).map(|d| d.join("nvcc")));
    }
    if let Some(ws) = manifest.parent().and_then(Path::parent) {
        let lib = ws.join(".venv-cuda/lib");
        let mut pys: Vec<PathBuf> = std::fs::read_dir(&lib)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .collect();
        pys.sort();
        for py in pys {
            candidates.push(py.join("site-packages/nvidia/cu13/bin/nvcc"));
        }
        if candidates.last().is_none_or(|c| !c.starts_with(&lib)) {
            candidates.push(lib.join("python3.*/site-packages/nvidia/cu13/bin/nvcc"));
        }
    }
    for c in candidates {
        if c.is_file() {
            return Ok(c);
        }
        tried.push(c.display().to_string());
    }
    Err(format!("nvcc not found; searched: {}", tried.join(", ")))
}

/// A table's doc string as Rust doc text: its brackets (`[R]`, `drecv[s]`: shapes and indices,
/// not links) escaped for rustdoc's Markdown. The C header takes the text as it is.
fn rust_doc(doc: &str) -> String {
    doc.replace('[', "\\[").replace(']', "\\]")
}

/// Writes `ep_gpu_abi.h` and `gpu_abi.rs` from the tables of `gpu_abi.rs`.
fn gpu_abi(out: &Path) {
    println!("cargo:rerun-if-changed=gpu_abi.rs");
    let mut h = String::from(
        "/* Generated by ep-kernels' build.rs from gpu_abi.rs. Do not edit. */\n\
         #ifndef EP_GPU_ABI_H\n#define EP_GPU_ABI_H\n#include <stdint.h>\n",
    );
    let mut rs =
        String::from("// Generated by ep-kernels' build.rs from gpu_abi.rs. Do not edit.\n");
    for (name, value, doc) in CONSTANTS.iter().chain(TRACE_CONSTANTS) {
        h.push_str(&format!("#define {name} {value}ull /* {doc} */\n"));
        let doc = rust_doc(doc);
        rs.push_str(&format!(
            "#[doc = {doc:?}]\npub const {name}: u64 = {value};\n"
        ));
    }
    for (c_name, rs_name, doc, fields) in [
        (
            "ep_normal_args",
            "NormalArgs",
            "Arguments of the normal-mode kernels.",
            NORMAL_ARGS,
        ),
        (
            "ep_ll_args",
            "LlArgs",
            "Arguments of the low-latency kernels.",
            LL_ARGS,
        ),
        (
            "ep_err_block",
            "ErrBlock",
            "The error record of a process's kernels.",
            ERR_BLOCK,
        ),
        (
            "ep_mailbox",
            "Mailbox",
            "What a rank's dispatch (its block 1) tells the host.",
            MAILBOX,
        ),
        (
            "ep_trace_header",
            "TraceHeader",
            "The header of a rank's device trace (debug builds).",
            TRACE_HEADER,
        ),
        (
            "ep_trace_record",
            "TraceRecord",
            "One record of a device trace.",
            TRACE_RECORD,
        ),
    ] {
        h.push_str(&format!("typedef struct {c_name} {{\n"));
        let doc = rust_doc(doc);
        rs.push_str(&format!(
            "#[doc = {doc:?}]\n#[repr(C)]\n#[derive(Clone, Copy, Debug)]\npub struct {rs_name} {{\n"
        ));
        for (f, n, fdoc) in fields {
            let rdoc = rust_doc(fdoc);
            if *n == 0 {
                h.push_str(&format!("    uint64_t {f}; /* {fdoc} */\n"));
                rs.push_str(&format!("    #[doc = {rdoc:?}]\n    pub {f}: u64,\n"));
            } else {
                h.push_str(&format!("    uint64_t {f}[{n}]; /* {fdoc} */\n"));
                rs.push_str(&format!(
                    "    #[doc = {rdoc:?}]\n    pub {f}: [u64; {n}],\n"
                ));
            }
        }
        let words: usize = fields.iter().map(|(_, n, _)| (*n).max(1)).sum();
        h.push_str(&format!("}} {c_name};\n"));
        rs.push_str(&format!(
            "}}\nconst _: () = assert!(std::mem::size_of::<{rs_name}>() == {});\n\
             impl Default for {rs_name} {{\n    fn default() -> Self {{\n        \
             // SAFETY: every field is a u64 or an array of u64, for which all-zero is valid.\n        \
             unsafe {{ std::mem::zeroed() }}\n    }}\n}}\n",
            8 * words
        ));
    }
    h.push_str("#endif\n");
    std::fs::write(out.join("ep_gpu_abi.h"), h).expect("write ep_gpu_abi.h");
    std::fs::write(out.join("gpu_abi.rs"), rs).expect("write gpu_abi.rs");
}

/// Writes `ep_protocol_constants.h` (from ep-core) and builds the host shim of
/// `include/ep_protocol.cuh` as the static library `ep_protocol_shim`.
fn protocol_rules(out: &Path, manifest: &Path) {
    use ep_core::protocol::layout as l;
    let constants = format!(
        "/* Generated by ep-kernels' build.rs from ep_core::protocol::layout. Do not edit. */\n\
         #ifndef EP_PROTOCOL_CONSTANTS_H\n#define EP_PROTOCOL_CONSTANTS_H\n\
         #define EP_WORD_STRIDE {}u\n#define EP_MAX_CHANNELS {}u\n#define EP_MAX_LOCAL_EXPERTS {}u\n\
         #define EP_LL_MAX_TOPK {}u\n#define EP_LL_META_ENTRY_BYTES {}u\n#define EP_REGION_ALIGN {}u\n\
         #define EP_LL_SIGNAL_QP {}u\n#define EP_ROW_META_PAIR_BYTES {}u\n\
         #define EP_ROW_TOPK_ID_BYTES {}u\n#define EP_ROW_TOPK_WEIGHT_BYTES {}u\n\
         #define EP_LL_MAX_SEND_GROUPS {}u\n#define EP_LL_HEADER_FIRST_WORD {}u\n\
         #define EP_LL_HEADER_MESSAGES_WORD {}u\n#define EP_LL_HEADER_COUNTS_WORD {}u\n#endif\n",
        l::WORD_STRIDE,
        l::MAX_CHANNELS,
        l::MAX_LOCAL_EXPERTS,
        l::LL_MAX_TOPK,
        l::LL_META_ENTRY_BYTES,
        l::REGION_ALIGN,
        l::LL_SIGNAL_QP,
        l::ROW_META_PAIR_BYTES,
        l::ROW_TOPK_ID_BYTES,
        l::ROW_TOPK_WEIGHT_BYTES,
        l::LL_MAX_SEND_GROUPS,
        l::LL_HEADER_FIRST_WORD,
        l::LL_HEADER_MESSAGES_WORD,
        l::LL_HEADER_COUNTS_WORD,
    );
    std::fs::write(out.join("ep_protocol_constants.h"), constants).expect("write constants header");
    let shim = out.join("ep_protocol_shim.cc");
    std::fs::write(&shim, SHIM).expect("write shim");
    cc::Build::new()
        .cpp(true)
        .file(&shim)
        .include(manifest.join("include"))
        .include(out)
        .flag_if_supported("-std=c++17")
        .warnings(true)
        .compile("ep_protocol_shim");
}

/// `extern "C"` wrappers of every header function (`ep_shim_` + name).
const SHIM: &str = r#"
#include "ep_protocol.cuh"
#define L4 uint64_t r, uint64_t le, uint64_t h, uint64_t n
#define MK ep_ll_layout lay = {r, le, h, n}
extern "C" {
uint64_t ep_shim_align16(uint64_t x) { return ep_align16(x); }
uint64_t ep_shim_align128(uint64_t x) { return ep_align128(x); }
void ep_shim_channel_range(uint64_t t, uint64_t c, uint64_t i, uint64_t *s, uint64_t *e) { ep_channel_range(t, c, i, s, e); }
void ep_shim_channel_half(uint64_t t, uint64_t c, uint64_t i, uint64_t h, uint64_t *s, uint64_t *e) { ep_channel_half(t, c, i, h, s, e); }
void ep_shim_ll_send_group(uint64_t t, uint64_t g, uint64_t b, uint64_t *s, uint64_t *e) { ep_ll_send_group(t, g, b, s, e); }
uint64_t ep_shim_parity(uint64_t call) { return ep_parity(call); }
uint64_t ep_shim_epoch_word(uint64_t call) { return ep_epoch_word(call); }
uint64_t ep_shim_counted(uint64_t call, uint32_t count) { return ep_counted(call, count); }
uint64_t ep_shim_ll_encode(uint64_t call, uint32_t count) { return ep_ll_encode(call, count); }
uint64_t ep_shim_ll_threshold(uint64_t call) { return ep_ll_threshold(call); }
uint64_t ep_shim_ll_epoch(uint64_t v) { return ep_ll_epoch(v); }
uint32_t ep_shim_ll_count(uint64_t v) { return ep_ll_count(v); }
uint64_t ep_shim_normal_ctrl_bytes(uint64_t r) { return ep_normal_ctrl_bytes(r); }
uint64_t ep_shim_normal_notify(uint64_t r, uint64_t p, uint64_t s) { return ep_normal_notify(r, p, s); }
uint64_t ep_shim_normal_table_ready(uint64_t r, uint64_t p) { return ep_normal_table_ready(r, p); }
uint64_t ep_shim_normal_done(uint64_t r, uint64_t s, uint64_t c, uint64_t h) { return ep_normal_done(r, s, c, h); }
uint64_t ep_shim_normal_pulled(uint64_t r, uint64_t s, uint64_t c) { return ep_normal_pulled(r, s, c); }
uint64_t ep_shim_normal_ready(uint64_t r, uint64_t d) { return ep_normal_ready(r, d); }
uint64_t ep_shim_normal_y_ready(uint64_t r, uint64_t d) { return ep_normal_y_ready(r, d); }
uint64_t ep_shim_normal_head(uint64_t r, uint64_t p, uint64_t s, uint64_t e) { return ep_normal_head(r, p, s, e); }
uint64_t ep_shim_count_record_bytes(void) { return ep_count_record_bytes(); }
uint64_t ep_shim_table_bytes(uint64_t r) { return ep_table_bytes(r); }
uint64_t ep_shim_normal_count_record(uint64_t r, uint64_t p, uint64_t s) { return ep_normal_count_record(r, p, s); }
uint64_t ep_shim_count_record_channel(uint64_t c) { return ep_count_record_channel(c); }
uint64_t ep_shim_count_record_experts(void) { return ep_count_record_experts(); }
uint64_t ep_shim_table_recv_begin(uint64_t r) { return ep_table_recv_begin(r); }
uint64_t ep_shim_row_scales_offset(uint64_t h, uint64_t e) { return ep_row_scales_offset(h, e); }
uint64_t ep_shim_normal_table(uint64_t r, uint64_t p) { return ep_normal_table(r, p); }
uint64_t ep_shim_normal_rows_base(uint64_t r) { return ep_normal_rows_base(r); }
uint64_t ep_shim_normal_half(uint64_t r, uint64_t b) { return ep_normal_half(r, b); }
uint64_t ep_shim_normal_dispatch_row(uint64_t r, uint64_t row, uint64_t drec) { return ep_normal_dispatch_row(r, row, drec); }
uint64_t ep_shim_normal_combine_row(uint64_t r, uint64_t b, uint64_t row, uint64_t yrec) { return ep_normal_combine_row(r, b, row, yrec); }
uint64_t ep_shim_row_dispatch_record(uint64_t h, uint64_t e, uint64_t s, uint64_t k) { return ep_row_dispatch_record(h, e, s, k); }
uint64_t ep_shim_row_meta_offset(uint64_t h, uint64_t e, uint64_t s) { return ep_row_meta_offset(h, e, s); }
uint64_t ep_shim_row_topk_idx_offset(uint64_t h, uint64_t e, uint64_t s) { return ep_row_topk_idx_offset(h, e, s); }
uint64_t ep_shim_row_topk_weights_offset(uint64_t h, uint64_t e, uint64_t s, uint64_t k) { return ep_row_topk_weights_offset(h, e, s, k); }
uint64_t ep_shim_row_combine_record(uint64_t h, uint64_t k) { return ep_row_combine_record(h, k); }
uint32_t ep_shim_normal_final_row(uint32_t a, uint32_t b, uint32_t c) { return ep_normal_final_row(a, b, c); }
uint64_t ep_shim_ll_signal_bytes(uint64_t r) { return ep_ll_signal_bytes(r); }
uint64_t ep_shim_ll_dispatch_signal(uint64_t r, uint64_t h, uint64_t s, uint64_t b) { return ep_ll_dispatch_signal(r, h, s, b); }
uint64_t ep_shim_ll_combine_signal(uint64_t r, uint64_t h, uint64_t d, uint64_t b) { return ep_ll_combine_signal(r, h, d, b); }
uint64_t ep_shim_ll_half(uint64_t op) { return ep_ll_half(op); }
uint16_t ep_shim_ll_data_qp(uint32_t run, uint16_t nq) { return ep_ll_data_qp(run, nq); }
uint64_t ep_shim_ll_row(L4) { MK; return ep_ll_row(lay); }
uint64_t ep_shim_ll_meta(L4) { MK; return ep_ll_meta(lay); }
uint64_t ep_shim_ll_header_copy(L4) { MK; return ep_ll_header_copy(lay); }
uint64_t ep_shim_ll_header(L4) { MK; return ep_ll_header(lay); }
uint64_t ep_shim_ll_header_copy_at(L4, uint64_t b) { MK; return ep_ll_header_copy_at(lay, b); }
uint64_t ep_shim_ll_dsend_row(L4, uint64_t t) { MK; return ep_ll_dsend_row(lay, t); }
uint64_t ep_shim_ll_dsend_meta(L4, uint64_t d) { MK; return ep_ll_dsend_meta(lay, d); }
uint64_t ep_shim_ll_drecv(L4, uint64_t s) { MK; return ep_ll_drecv(lay, s); }
uint64_t ep_shim_ll_drecv_row(L4, uint64_t s, uint64_t i) { MK; return ep_ll_drecv_row(lay, s, i); }
uint64_t ep_shim_ll_csend(L4, uint64_t s, uint64_t i) { MK; return ep_ll_csend(lay, s, i); }
uint64_t ep_shim_ll_crecv(L4, uint64_t d, uint64_t i) { MK; return ep_ll_crecv(lay, d, i); }
uint64_t ep_shim_ll_cy(L4, uint64_t e, uint64_t row) { MK; return ep_ll_cy(lay, e, row); }
uint64_t ep_shim_ll_logfmt_meta(L4) { MK; return ep_ll_logfmt_meta(lay); }
uint64_t ep_shim_ll_csend_meta(L4, uint64_t s, uint64_t i) { MK; return ep_ll_csend_meta(lay, s, i); }
uint64_t ep_shim_ll_crecv_meta(L4, uint64_t d, uint64_t i) { MK; return ep_ll_crecv_meta(lay, d, i); }
uint64_t ep_shim_ll_half_bytes(L4) { MK; return ep_ll_half_bytes(lay); }
uint64_t ep_shim_ll_total_bytes(L4) { MK; return ep_ll_total_bytes(lay); }
uint64_t ep_shim_ll_meta_entry(uint16_t l, uint16_t pos, uint32_t w) { return ep_ll_meta_entry(l, pos, w); }
uint32_t ep_shim_ll_entry_expert(uint64_t e) { return ep_ll_entry_expert(e); }
uint32_t ep_shim_ll_entry_pos(uint64_t e) { return ep_ll_entry_pos(e); }
uint32_t ep_shim_ll_entry_weight_bits(uint64_t e) { return ep_ll_entry_weight_bits(e); }
uint64_t ep_shim_ll_meta_head(uint32_t t, uint32_t n) { return ep_ll_meta_head(t, n); }
uint32_t ep_shim_ll_head_token(uint64_t h) { return ep_ll_head_token(h); }
uint32_t ep_shim_ll_head_count(uint64_t h) { return ep_ll_head_count(h); }
int64_t ep_shim_pack_layout_range(uint32_t b, uint32_t c) { return ep_pack_layout_range(b, c); }
uint32_t ep_shim_layout_range_begin(int64_t v) { return ep_layout_range_begin(v); }
uint32_t ep_shim_layout_range_count(int64_t v) { return ep_layout_range_count(v); }
}
#include "ep_logfmt.cuh"
static ep_logfmt_div lf_div(const float *p) { ep_logfmt_div d = {p[0], p[1], p[2], p[3]}; return d; }
extern "C" {
float ep_shim_logfmt_log2(float x) { return ep_logfmt_log2(x); }
float ep_shim_logfmt_exp2(float t) { return ep_logfmt_exp2(t); }
uint32_t ep_shim_logfmt_division_meta(const uint16_t *x, uint32_t n) { return ep_logfmt_division_meta(x, n); }
int ep_shim_logfmt_params(uint32_t meta, float *p) { ep_logfmt_div d; int c = ep_logfmt_params(meta, &d); p[0] = d.log_amin; p[1] = d.step; p[2] = d.inv_step; p[3] = d.bias; return c; }
uint32_t ep_shim_logfmt_code(uint16_t x, const float *p) { ep_logfmt_div d = lf_div(p); return ep_logfmt_code(x, &d); }
float ep_shim_logfmt_magnitude(uint32_t c, const float *p) { ep_logfmt_div d = lf_div(p); return ep_logfmt_magnitude(c, &d); }
void ep_shim_logfmt_pack16(const uint32_t *codes, uint32_t signs, uint32_t *w) { ep_logfmt_pack16(codes, signs, w); }
uint32_t ep_shim_logfmt_unpack_code(const uint32_t *w, uint32_t i) { return ep_logfmt_unpack_code(w, i); }
void ep_shim_logfmt_encode16(const uint16_t *x, const float *p, uint32_t *w) { ep_logfmt_div d = lf_div(p); ep_logfmt_encode16(x, &d, w); }
void ep_shim_logfmt_decode16(const uint32_t *w, const float *p, float *out) { ep_logfmt_div d = lf_div(p); ep_logfmt_decode16(w, &d, out); }
uint64_t ep_shim_logfmt_data_offset(uint64_t h) { return ep_logfmt_data_offset(h); }
uint64_t ep_shim_logfmt_num_chunks(uint64_t h) { return ep_logfmt_num_chunks(h); }
uint64_t ep_shim_logfmt_chunk_place(uint64_t k) { return ep_logfmt_chunk_place(k); }
uint64_t ep_shim_logfmt_chunk_channels(uint64_t h, uint64_t k) { return ep_logfmt_chunk_channels(h, k); }
uint64_t ep_shim_logfmt_chunk_bytes(uint64_t ch, int cast) { return ep_logfmt_chunk_bytes(ch, cast); }
uint64_t ep_shim_logfmt_max_bytes(uint64_t h) { return ep_logfmt_max_bytes(h); }
uint64_t ep_shim_logfmt_deepep_bytes(uint64_t h) { return ep_logfmt_deepep_bytes(h); }
int ep_shim_logfmt_chunk_cast(const uint32_t *meta, uint64_t h, uint64_t k) { return ep_logfmt_chunk_cast(meta, h, k); }
uint64_t ep_shim_logfmt_chunk_offset(const uint32_t *meta, uint64_t h, uint64_t k) { return ep_logfmt_chunk_offset(meta, h, k); }
uint64_t ep_shim_logfmt_message_bytes(const uint32_t *meta, uint64_t h) { return ep_logfmt_message_bytes(meta, h); }
uint64_t ep_shim_logfmt_encode_row(const uint16_t *x, uint64_t h, uint8_t *out) { return ep_logfmt_encode_row(x, h, out); }
void ep_shim_logfmt_decode_row(const uint8_t *m, uint64_t h, float *out) { ep_logfmt_decode_row(m, h, out); }
}
"#;
