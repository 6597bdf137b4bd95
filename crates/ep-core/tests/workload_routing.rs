//! Skewed routings of the workload generator: parsing, distributions (hot fraction, Zipf
//! frequencies), distinct top-k, determinism pinned by digests, rank independence.

use std::collections::BTreeSet;

use ep_core::Error;
use ep_core::workload::{Routing, WorkloadSpec, digest};

fn spec(
    routing: Routing,
    ranks: usize,
    tokens: usize,
    topk: usize,
    experts: usize,
) -> WorkloadSpec {
    WorkloadSpec {
        routing,
        ..WorkloadSpec::new(ranks, tokens, 128, topk, experts, 0x5eed)
    }
}

#[test]
fn parse_and_print_round_trip() {
    let cases = [
        ("uniform", Routing::Uniform),
        ("UNIFORM", Routing::Uniform),
        ("zipf:1.2", Routing::Zipf { exponent: 1.2 }),
        (" zipf : 2 ", Routing::Zipf { exponent: 2.0 }),
        ("zipf:0", Routing::Zipf { exponent: 0.0 }),
        ("hot:0.5", Routing::Hot { fraction: 0.5 }),
        ("Hot:1", Routing::Hot { fraction: 1.0 }),
        ("hot:0", Routing::Hot { fraction: 0.0 }),
    ];
    for (text, want) in cases {
        let got: Routing = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(got, want, "{text}");
        let again: Routing = got.to_string().parse().unwrap();
        assert_eq!(again, got, "{text} printed as {got}");
    }
    assert_eq!(Routing::Zipf { exponent: 1.2 }.to_string(), "zipf:1.2");
    assert_eq!(Routing::Hot { fraction: 0.25 }.to_string(), "hot:0.25");
    assert_eq!(Routing::default().to_string(), "uniform");
}

#[test]
fn bad_routings_are_typed_errors() {
    for text in [
        "",
        "zipf",
        "zipf:",
        "zipf:abc",
        "zipf:-1",
        "zipf:inf",
        "zipf:nan",
        "hot",
        "hot:1.5",
        "hot:-0.1",
        "hot:nan",
        "uniform:3",
        "normal",
        "zipf:1:2",
    ] {
        match text.parse::<Routing>() {
            Err(Error::InvalidRouting { routing, fix }) => {
                assert_eq!(routing, text);
                assert!(!fix.is_empty());
            }
            other => panic!("{text:?}: {other:?}"),
        }
    }
    // Constructed directly, the spec rejects them too.
    for routing in [
        Routing::Zipf { exponent: -0.5 },
        Routing::Zipf {
            exponent: f64::INFINITY,
        },
        Routing::Hot { fraction: 2.0 },
        Routing::Hot { fraction: f64::NAN },
    ] {
        assert!(
            matches!(
                spec(routing, 2, 4, 2, 8).generate(),
                Err(Error::InvalidRouting { .. })
            ),
            "{routing:?}"
        );
    }
}

fn assert_distinct(inputs: &[ep_core::RankInputs], experts: usize) {
    for (r, inp) in inputs.iter().enumerate() {
        ep_core::validate_inputs(inp, experts, r).unwrap();
        for row in inp.topk_idx.iter_rows() {
            let valid: Vec<i64> = row.iter().copied().filter(|&e| e >= 0).collect();
            let set: BTreeSet<i64> = valid.iter().copied().collect();
            assert_eq!(set.len(), valid.len(), "duplicate expert in {row:?}");
        }
    }
}

#[test]
fn topk_is_distinct_for_every_routing_with_masking() {
    for routing in [
        Routing::Zipf { exponent: 0.0 },
        Routing::Zipf { exponent: 1.2 },
        Routing::Zipf { exponent: 8.0 },
        Routing::Hot { fraction: 0.5 },
        Routing::Hot { fraction: 1.0 },
    ] {
        for (topk, experts) in [(4, 8), (8, 8), (1, 4), (0, 4)] {
            let s = WorkloadSpec {
                masked_per_rank: 3.min(64 * topk),
                ..spec(routing, 2, 64, topk, experts)
            };
            let w = s.generate().unwrap();
            assert_distinct(&w, experts);
            let masked = w[0].topk_idx.data().iter().filter(|&&e| e < 0).count();
            assert_eq!(masked, s.masked_per_rank, "{routing} K={topk}");
        }
    }
}

#[test]
fn hot_fraction_is_within_tolerance() {
    let (t, e) = (4096usize, 32usize);
    for f in [0.0, 0.25, 0.5, 0.9, 1.0] {
        let w = spec(Routing::Hot { fraction: f }, 1, t, 4, e)
            .generate()
            .unwrap();
        let first = w[0].topk_idx.iter_rows().filter(|r| r[0] == 0).count() as f64 / t as f64;
        // Non-hot tokens are uniform, so expert 0 leads them with probability 1/E.
        let want = f + (1.0 - f) / e as f64;
        // 5 sigma of a binomial proportion over 4096 tokens.
        let tol = 5.0 * (want * (1.0 - want) / t as f64).sqrt() + 1e-9;
        assert!((first - want).abs() <= tol, "hot:{f}: {first} vs {want}");
        if f == 1.0 {
            assert!(w[0].topk_idx.iter_rows().all(|r| r[0] == 0));
        }
        // Expert 0 never appears twice; the other slots never hold it for hot tokens.
        assert_distinct(&w, e);
    }
}

#[test]
fn zipf_frequencies_decrease_with_popularity() {
    let (t, e) = (8192usize, 16usize);
    let s = spec(Routing::Zipf { exponent: 1.2 }, 2, t, 1, e);
    let order = s.zipf_order();
    let w = s.generate().unwrap();
    let mut counts = vec![0usize; e];
    for inp in &w {
        for &x in inp.topk_idx.data() {
            counts[x as usize] += 1;
        }
    }
    let by_pos: Vec<usize> = order.iter().map(|&x| counts[x as usize]).collect();
    // K = 1: the share of position i is exactly (i+1)^-S / Σ (j+1)^-S.
    let norm: f64 = (1..=e).map(|i| (i as f64).powf(-1.2)).sum();
    let n = (2 * t) as f64;
    for (i, &c) in by_pos.iter().enumerate() {
        let p = ((i + 1) as f64).powf(-1.2) / norm;
        let tol = 5.0 * (n * p * (1.0 - p)).sqrt();
        assert!(
            (c as f64 - n * p).abs() <= tol,
            "position {i}: {c} vs {}",
            n * p
        );
    }
    // Strongly separated positions are strictly ordered.
    for (a, b) in [(0, 1), (1, 3), (3, 7), (7, 15)] {
        assert!(by_pos[a] > by_pos[b], "{by_pos:?}");
    }

    // K > 1 (sampling without replacement): still decreasing in popularity.
    let s = spec(Routing::Zipf { exponent: 1.2 }, 1, 4096, 4, 32);
    let order = s.zipf_order();
    let w = s.generate().unwrap();
    assert_distinct(&w, 32);
    let mut counts = vec![0usize; 32];
    for &x in w[0].topk_idx.data() {
        counts[x as usize] += 1;
    }
    let by_pos: Vec<usize> = order.iter().map(|&x| counts[x as usize]).collect();
    for (a, b) in [(0, 2), (2, 6), (6, 14), (14, 31)] {
        assert!(by_pos[a] > by_pos[b], "{by_pos:?}");
    }
    // A token takes each expert at most once: the top expert cannot exceed T picks.
    assert!(by_pos[0] <= 4096);
}

#[test]
fn zipf_zero_is_uniform_popularity() {
    let w = spec(Routing::Zipf { exponent: 0.0 }, 1, 4096, 8, 32)
        .generate()
        .unwrap();
    let mut counts = [0usize; 32];
    for &e in w[0].topk_idx.data() {
        counts[e as usize] += 1;
    }
    assert!(
        counts.iter().all(|&c| (870..=1180).contains(&c)),
        "{counts:?}"
    );
}

#[test]
fn zipf_order_depends_on_seed_and_experts_only() {
    let a = spec(Routing::Zipf { exponent: 1.0 }, 2, 8, 2, 64);
    let b = WorkloadSpec {
        num_ranks: 8,
        num_tokens: 100,
        ..a.clone()
    };
    assert_eq!(a.zipf_order(), b.zipf_order());
    let set: BTreeSet<i64> = a.zipf_order().into_iter().collect();
    assert_eq!(set, (0..64).collect());
    let c = WorkloadSpec {
        seed: 1,
        ..a.clone()
    };
    assert_ne!(a.zipf_order(), c.zipf_order());
    // Rank data depends on (seed, rank) and the shapes, not on R.
    let two = a.generate().unwrap();
    let four = WorkloadSpec {
        num_ranks: 4,
        ..a.clone()
    }
    .generate()
    .unwrap();
    assert_eq!(two[1], four[1]);
}

#[test]
fn skewed_routings_leave_weights_and_activations_alone() {
    let base = spec(Routing::Uniform, 2, 32, 4, 16).generate().unwrap();
    for routing in [
        Routing::Zipf { exponent: 1.5 },
        Routing::Hot { fraction: 0.5 },
    ] {
        let w = spec(routing, 2, 32, 4, 16).generate().unwrap();
        for (a, b) in base.iter().zip(&w) {
            assert_eq!(a.x, b.x);
            assert_eq!(a.topk_weights, b.topk_weights);
            assert_ne!(a.topk_idx, b.topk_idx, "{routing}");
        }
    }
}

/// Pinned fingerprints of the skewed generators: a change of sampling, stream layout or of the
/// portable `exp`/`ln` on any machine fails here. Update only for a deliberate change.
#[test]
fn golden_digests() {
    let cases = [
        (Routing::Zipf { exponent: 1.2 }, GOLDEN_ZIPF),
        (Routing::Hot { fraction: 0.5 }, GOLDEN_HOT),
    ];
    for (routing, golden) in cases {
        let s = WorkloadSpec {
            masked_per_rank: 5,
            ..spec(routing, 4, 16, 4, 32)
        };
        let a = s.generate().unwrap();
        assert_eq!(a, s.generate().unwrap());
        assert_eq!(digest(&a), golden, "{routing}: {:#018x}", digest(&a));
    }
}

const GOLDEN_ZIPF: u64 = 0x452d_61b1_f812_2fff;
const GOLDEN_HOT: u64 = 0x116a_cf61_8dd9_22ff;
