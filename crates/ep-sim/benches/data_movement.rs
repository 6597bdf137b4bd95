//! Threads-mode data movement against a plain memcpy (`ep bench` pushes GBs through ThreadSim;
//! its payload rate must stay at or above half of one thread's memcpy).
//!
//! `cargo bench -p ep-sim --bench data_movement -- --warm-up-time 1 --measurement-time 3`
//!
//! Measures, on one thread, bytes per second of: `memcpy` of a buffer larger than the caches;
//! ThreadSim `store` of token rows (7168 BF16 = 14336 bytes) into an NVLink peer; ThreadSim `put`
//! of the same rows from the agent's heap to the peer. Then prints each ThreadSim rate as a ratio
//! of the memcpy rate (median of 7 timed runs each).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use ep_core::transport::{
    AgentCtx, AllocRequest, FabricParams, Init, Phase, PhaseKind, QpIndex, SymAlloc, Transport,
};
use ep_sim::ThreadSim;

const ROW: u64 = 7168 * 2;
const ROWS: u64 = 4096;
const BYTES: u64 = ROW * ROWS;

struct Fixture {
    sim: ThreadSim,
    src: SymAlloc,
    dst: SymAlloc,
    rows: Vec<u8>,
}

fn fixture() -> Fixture {
    let mut f = FabricParams::single_node(2);
    f.granularity = 1 << 29;
    let mut sim = ThreadSim::new(f, Duration::from_secs(30));
    let mut alloc = |name: &str| {
        sim.alloc(AllocRequest {
            name: name.into(),
            bytes: BYTES,
            align: 128,
            init: Init::Poison,
        })
        .expect("alloc")
    };
    let (src, dst) = (alloc("src"), alloc("dst"));
    let rows: Vec<u8> = (0..BYTES).map(|i| (i * 31 % 251) as u8).collect();
    sim.host_write(0, src.at(0), &rows).expect("host write");
    let mut fx = Fixture {
        sim,
        src,
        dst,
        rows,
    };
    // Touch every page once so the timed runs measure copies, not page faults.
    stores(&mut fx);
    puts(&mut fx);
    fx
}

fn stores(fx: &mut Fixture) {
    let (dst, rows) = (fx.dst.clone(), &fx.rows);
    let p = Phase::new(PhaseKind::Custom("stores".into()), 1).agent(
        0,
        0,
        "sender",
        move |c: &mut dyn AgentCtx| {
            for i in 0..ROWS {
                let r = &rows[(i * ROW) as usize..((i + 1) * ROW) as usize];
                c.store(1, dst.at(i * ROW), r)?;
            }
            Ok(())
        },
    );
    fx.sim.run_phase(p).expect("stores");
}

fn puts(fx: &mut Fixture) {
    let (src, dst) = (fx.src.clone(), fx.dst.clone());
    let p = Phase::new(PhaseKind::Custom("puts".into()), 1).agent(
        0,
        0,
        "sender",
        move |c: &mut dyn AgentCtx| {
            for i in 0..ROWS {
                c.put(1, QpIndex(0), dst.at(i * ROW), src.at(i * ROW), ROW)?;
            }
            c.quiet()
        },
    );
    fx.sim.run_phase(p).expect("puts");
}

fn memcpy(from: &[u8], to: &mut [u8]) {
    to.copy_from_slice(black_box(from));
    black_box(to);
}

fn median_rate(mut f: impl FnMut()) -> f64 {
    let mut t: Vec<f64> = (0..7)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    BYTES as f64 / t[3]
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    let mut fx = fixture();
    let from = fx.rows.clone();
    let mut to = vec![1u8; BYTES as usize];
    {
        let mut g = c.benchmark_group("data_movement");
        g.throughput(Throughput::Bytes(BYTES));
        g.sample_size(10);
        g.bench_function("memcpy", |b| b.iter(|| memcpy(&from, &mut to)));
        g.bench_function("threadsim_store_rows", |b| b.iter(|| stores(&mut fx)));
        g.bench_function("threadsim_put_rows", |b| b.iter(|| puts(&mut fx)));
        g.finish();
    }
    c.final_summary();
    let base = median_rate(|| memcpy(&from, &mut to));
    let st = median_rate(|| stores(&mut fx));
    let pu = median_rate(|| puts(&mut fx));
    println!(
        "single-thread rates over {} MB ({} rows of {} bytes): memcpy {:.2} GB/s, \
         ThreadSim store {:.2} GB/s (ratio {:.2}), ThreadSim put {:.2} GB/s (ratio {:.2})",
        BYTES / 1_000_000,
        ROWS,
        ROW,
        base / 1e9,
        st / 1e9,
        st / base,
        pu / 1e9,
        pu / base
    );
}
