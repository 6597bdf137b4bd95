//! Shape tests of the kernels' SASS: properties of the compiled code that decide its speed and
//! that no correctness test sees (each a measured loss or gain, BENCHMARKS.md): the normal rows
//! loop at few SMs, the low-latency combine's first loads; and one that a wrong order would make
//! a race, the normal dispatch's grid-dependency wait before any read. They read `cuobjdump
//! -sass` of the module build.rs compiled.

use super::{built, low_latency_cubin, normal_cubin};

/// The SASS of `function` in `cubin`, from the cuobjdump beside the nvcc that built it;
/// `None` (a skip, said why) where that tool is missing, a failure under
/// `EP_REQUIRE_KERNELS=1` (CI installs it: .ci/run).
fn sass(cubin: &[u8], function: &str) -> Option<String> {
    let nvcc = std::path::Path::new(built::NVCC?);
    let tool = nvcc.with_file_name("cuobjdump");
    if !tool.exists() {
        assert!(
            std::env::var_os("EP_REQUIRE_KERNELS").is_none_or(|v| v != "1"),
            "EP_REQUIRE_KERNELS=1 but {} is missing (pip nvidia-cuda-cuobjdump, .ci/run)",
            tool.display()
        );
        eprintln!("skipped: no cuobjdump beside {}", nvcc.display());
        return None;
    }
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("ep-sass-{}-{call}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join(format!("{function}.cubin"));
    std::fs::write(&file, cubin).unwrap();
    let out = std::process::Command::new(&tool)
        .args(["-sass", "-fun", function])
        .arg(&file)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", tool.display()));
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "{} failed: {}",
        tool.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Some(String::from_utf8(out.stdout).unwrap())
}

/// The SASS of `functions` in `module`, or `None` (a skip, said why) where the module was not
/// built or cuobjdump is missing.
fn kernels_sass(
    module: crate::error::Result<&'static [u8]>,
    functions: &[&'static str],
) -> Option<Vec<(&'static str, String)>> {
    let cubin = match module {
        Ok(cubin) => cubin,
        Err(e) => {
            eprintln!("skipped: {e}");
            return None;
        }
    };
    functions
        .iter()
        .map(|&f| Some((f, sass(cubin, f)?)))
        .collect()
}

/// The SASS of both kernels that copy rows (the dispatch and its ceiling), or `None` (a skip,
/// said why) where normal.cu or cuobjdump is missing.
fn row_kernels() -> Option<Vec<(&'static str, String)>> {
    kernels_sass(normal_cubin(), &["ep_normal_dispatch", "ep_copy_ceiling"])
}

/// The rows loop of a dispatch-shaped kernel as runs of (is_store, count) in program order:
/// its loads are `ld.global.nc` (`LDG.E.NA.128.CONSTANT`, ep_ld_nc, used by load_row_pass
/// only), its stores `st.global.v4` (`STG.E.128`, ep_st_v4, used by store_row_pass only).
fn row_runs(sass: &str) -> Vec<(bool, usize)> {
    let mut runs: Vec<(bool, usize)> = Vec::new();
    for line in sass.lines() {
        let store = if line.contains("LDG.E.NA.128.CONSTANT") {
            false
        } else if line.contains("STG.E.128") {
            true
        } else {
            continue;
        };
        match runs.last_mut() {
            Some((s, n)) if *s == store => *n += 1,
            _ => runs.push((store, 1)),
        }
    }
    runs
}

/// warp_copy_fanout keeps two passes in flight: pass i + 1's loads are issued before pass
/// i's stores. ptxas is free to sink loads below stores, and did in the dispatch kernel at
/// its register cap (one pass in flight, BENCHMARKS.md 2026-12-07), which no CPU test and
/// no correctness test sees: this reads the order in the SASS of both kernels that copy rows.
#[test]
fn the_rows_loop_keeps_two_passes_in_flight() {
    const UNROLL: usize = crate::gpu::abi::EP_NORMAL_ROW_UNROLL as usize;
    let Some(kernels) = row_kernels() else {
        return;
    };
    for (function, sass) in kernels {
        let runs = row_runs(&sass);
        assert!(
            runs.iter().any(|r| r.0),
            "{function}: no st.global.v4 row stores in its SASS"
        );
        for (i, &(store, n)) in runs.iter().enumerate() {
            if !store {
                continue;
            }
            // The first pass's stores follow both passes' loads, every later one the
            // loads of the pass after it.
            let want = if i == 1 { 2 * UNROLL } else { UNROLL };
            let before = if i == 0 { 0 } else { runs[i - 1].1 };
            assert!(
                before >= want,
                "{function}: store run {i} ({n} stores) follows {before} loads, not >= {want}: \
                 a pass's loads were sunk below the stores (runs {runs:?})"
            );
            assert_eq!(
                n, UNROLL,
                "{function}: a pass stores {UNROLL} chunks per destination"
            );
        }
    }
}

/// One SASS instruction: its address, opcode (predicate dropped) and operands.
struct Insn<'a> {
    addr: u64,
    predicated: bool,
    op: &'a str,
    operands: Vec<&'a str>,
}

/// The instructions of a `cuobjdump -sass` listing, in program order.
fn instructions(sass: &str) -> Vec<Insn<'_>> {
    let mut out = Vec::new();
    for line in sass.lines() {
        // "        /*0d40*/   @!P2 LDG.E.64 R52, desc[UR8][R52.64] ;   /* 0x... */"
        let Some(rest) = line.trim_start().strip_prefix("/*") else {
            continue;
        };
        let Some((addr, text)) = rest.split_once("*/") else {
            continue;
        };
        let Ok(addr) = u64::from_str_radix(addr, 16) else {
            continue;
        };
        let Some((text, _)) = text.split_once(';') else {
            continue;
        };
        let mut words = text.trim();
        let predicated = words.starts_with('@');
        if predicated {
            words = words.split_once(' ').map_or("", |(_, w)| w.trim_start());
        }
        let (op, args) = words.split_once(' ').unwrap_or((words, ""));
        let operands = args
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .collect();
        out.push(Insn {
            addr,
            predicated,
            op,
            operands,
        });
    }
    out
}

/// The general registers an operand names: `R52` one, `R52.64` (an address pair) two, and a
/// data operand of a `width`-register access `width` from it.
fn registers(operand: &str, width: u32) -> Vec<u32> {
    let mut regs = Vec::new();
    let bytes = operand.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let boundary = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        if bytes[i] == b'R' && boundary && i + 1 < bytes.len() && bytes[i + 1].is_ascii_digit() {
            let mut j = i + 1;
            while j < bytes.len() && bytes[j].is_ascii_digit() {
                j += 1;
            }
            let r: u32 = operand[i + 1..j].parse().unwrap();
            let n = if operand[j..].starts_with(".64") {
                2
            } else {
                width
            };
            regs.extend(r..r + n);
            i = j;
        } else {
            i += 1;
        }
    }
    regs
}

/// Where a branch goes (`BRA 0xd400`, `BRA.DIV UR4, 0x11c80`).
fn branch_target(insn: &Insn<'_>) -> Option<u64> {
    u64::from_str_radix(insn.operands.last()?.strip_prefix("0x")?, 16).ok()
}

/// Registers of a memory access's data: 4 for .128, 2 for .64, else 1.
fn access_width(op: &str) -> u32 {
    if op.contains(".128") {
        4
    } else if op.contains(".64") {
        2
    } else {
        1
    }
}

/// The row's first pass is issued only after everything before it in the row's code: an
/// instruction there that reads what a global load of the same stretch returns (the tail's
/// scales, top-k ids or weights) stalls the warp for that load's round trip before the row's
/// loads go out, once per row. Found in the SASS of 398b38f (the id's division in tail_load):
/// the FP8 dispatch at 8 SMs lost 18% (179 -> 212 us, BENCHMARKS.md 2026-12-07 12:34). Checks,
/// from the head of the rows loop to the first row load, that no instruction reads a register
/// a global load there wrote (forward branches followed; nothing falls through an unconditional
/// one).
#[test]
fn no_row_start_waits_for_a_load_before_the_row_loads() {
    let Some(kernels) = row_kernels() else {
        return;
    };
    for (function, sass) in kernels {
        let insns = instructions(&sass);
        let row_load = |i: &Insn<'_>| i.op.starts_with("LDG.E.NA.128.CONSTANT");
        let first = insns
            .iter()
            .position(row_load)
            .unwrap_or_else(|| panic!("{function}: no ld.global.nc row loads in its SASS"));
        // The row's code starts at the head of the innermost loop around the first row load:
        // the latest target, at or before that load, of a branch back from after it.
        let at = insns[first].addr;
        let head = insns
            .iter()
            .filter(|i| i.op.starts_with("BRA") && i.addr > at)
            .filter_map(branch_target)
            .filter(|&t| t <= at)
            .max()
            .unwrap_or_else(|| panic!("{function}: its first row load is in no loop"));
        let start = insns
            .iter()
            .position(|i| i.addr == head)
            .expect("a branch target is an instruction");
        // Registers written by a global load on a path from `start` to here, not since
        // overwritten on it; forward branches carry theirs to their targets, and nothing
        // falls through an unconditional branch.
        let mut pending: Vec<(u32, String)> = Vec::new();
        let mut at_target: std::collections::HashMap<u64, Vec<(u32, String)>> = Default::default();
        for insn in &insns[start..first] {
            if let Some(more) = at_target.remove(&insn.addr) {
                pending.extend(more);
            }
            let store = insn.op.starts_with("ST");
            let reads: Vec<u32> = if store {
                insn.operands
                    .iter()
                    .enumerate()
                    .flat_map(|(k, o)| registers(o, if k == 0 { 1 } else { access_width(insn.op) }))
                    .collect()
            } else {
                insn.operands
                    .iter()
                    .skip(1)
                    .flat_map(|o| registers(o, 1))
                    .collect()
            };
            if let Some((r, load)) = pending.iter().find(|(r, _)| reads.contains(r)) {
                panic!(
                    "{function}: `{} {}` reads R{r}, which `{load}` loads, before the row's first \
                     load: every row waits a round trip there",
                    insn.op,
                    insn.operands.join(", ")
                );
            }
            if insn.op.starts_with("BRA") {
                if let Some(t) = branch_target(insn).filter(|&t| t > insn.addr) {
                    at_target
                        .entry(t)
                        .or_default()
                        .extend(pending.iter().cloned());
                }
                if insn.op == "BRA" && !insn.predicated {
                    pending.clear();
                }
                continue;
            }
            if store || insn.operands.is_empty() {
                continue;
            }
            let global_load = insn.op.starts_with("LDG") || insn.op.starts_with("LD.");
            let width = if global_load {
                access_width(insn.op)
            } else if insn.op.contains(".WIDE") || insn.op.starts_with("CS2R") {
                2
            } else {
                1
            };
            let written = registers(insn.operands[0], width);
            if global_load {
                let text = format!("{} {}", insn.op, insn.operands.join(", "));
                pending.extend(written.into_iter().map(|r| (r, text.clone())));
            } else if !insn.predicated {
                pending.retain(|(r, _)| !written.contains(r));
            }
        }
    }
}

#[test]
fn the_checker_reads_registers_and_instructions() {
    assert_eq!(registers("desc[UR8][R52.64+0x8]", 1), vec![52, 53]);
    assert_eq!(registers("R24", 4), vec![24, 25, 26, 27]);
    assert_eq!(registers("RZ", 1), Vec::<u32>::new());
    assert_eq!(registers("UR4", 1), Vec::<u32>::new());
    let sass = "        /*0d40*/              @!P2 LDG.E.64 R52, desc[UR8][R52.64] ;  /* 0x0 */\n\
                \x20       /*0d50*/                   ISETP.GE.AND P1, PT, R53, RZ, PT ;  /* 0x0 */";
    let insns = instructions(sass);
    assert_eq!(insns.len(), 2);
    assert!(insns[0].predicated && insns[0].op == "LDG.E.64" && insns[0].addr == 0xd40);
    assert_eq!(insns[0].operands, vec!["R52", "desc[UR8][R52.64]"]);
    assert_eq!(insns[1].op, "ISETP.GE.AND");
    assert_eq!(access_width("STG.E.128"), 4);
}

/// The low-latency combine issues its send part's first loads — the header copies' slot bounds
/// (`__ldcg`: `LDG.E.STRONG.GPU`) — before the block's epoch word's read (a volatile load:
/// `LDG.E.64.STRONG.SYS`, ep_block_epoch), so that in a graph replay the two latencies overlap
/// (combine_loads; graph replays -0.13 to -0.35 us, BENCHMARKS.md 2026-12-07 from 16:37). Before,
/// the epoch's read and its barrier came first.
#[test]
fn the_ll_combine_loads_its_records_before_its_epoch_word() {
    let Some(kernels) = kernels_sass(
        low_latency_cubin(),
        &["ep_ll_combine", "ep_ll_combine_logfmt"],
    ) else {
        return;
    };
    for (function, sass) in kernels {
        let insns = instructions(&sass);
        let first = |op: &str| insns.iter().position(|i| i.op == op);
        let epoch = first("LDG.E.64.STRONG.SYS")
            .unwrap_or_else(|| panic!("{function}: no strong 64-bit load (the epoch word's read)"));
        let records = first("LDG.E.STRONG.GPU")
            .unwrap_or_else(|| panic!("{function}: no __ldcg load (the header copies' words)"));
        assert!(
            records < epoch,
            "{function}: the header copies' loads (at {:#x}) come after the epoch word's read (at \
             {:#x}): combine_loads no longer runs before op_epoch",
            insns[records].addr,
            insns[epoch].addr
        );
    }
}

/// An instruction that reads global memory another kernel may write: global or generic loads
/// and atomics (not `LDC`, the kernel parameters, nor `LDS`, the block's shared memory).
fn reads_memory(op: &str) -> bool {
    op == "LD"
        || ["LDG", "LD.", "ATOM", "RED"]
            .iter()
            .any(|p| op.starts_with(p))
}

/// A global or generic memory access of any kind: a read ([`reads_memory`]) or a store.
fn accesses_memory(op: &str) -> bool {
    reads_memory(op) || op.starts_with("STG") || op.starts_with("ST.")
}

/// The normal dispatch is launched with programmatic serialization (PDL, docs/protocol.md §2.7):
/// it may start while the layout kernel before it runs, so it must read no memory before its
/// grid-dependency wait (`ACQBULK`, `ep_pdl_wait`); and the layout kernel lets it start
/// (`PREEXIT`, `ep_pdl_trigger`) before it writes its counts.
#[test]
fn the_normal_dispatch_reads_nothing_before_its_grid_dependency_wait() {
    let Some(kernels) = kernels_sass(normal_cubin(), &["ep_normal_dispatch", "ep_normal_layout"])
    else {
        return;
    };
    // (function, its griddepcontrol instruction, what may not come before it): the dispatch no
    // read, the layout no memory access of any kind.
    let checks = [
        (
            "ep_normal_dispatch",
            "ACQBULK",
            reads_memory as fn(&str) -> bool,
        ),
        ("ep_normal_layout", "PREEXIT", accesses_memory),
    ];
    for ((function, sass), (name, mark, forbidden)) in kernels.iter().zip(checks) {
        assert_eq!(*function, name);
        let insns = instructions(sass);
        let at = insns
            .iter()
            .position(|i| i.op == mark)
            .unwrap_or_else(|| panic!("{function}: no {mark} (its griddepcontrol instruction)"));
        let before = insns[..at].iter().find(|i| forbidden(i.op));
        assert!(
            before.is_none(),
            "{function}: {} at {:#x} comes before its {mark} at {:#x}",
            before.map_or("", |i| i.op),
            before.map_or(0, |i| i.addr),
            insns[at].addr
        );
    }
}
