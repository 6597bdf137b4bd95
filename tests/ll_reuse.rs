//! `Buffer::low_latency_dispatch_reusing`: a dispatch that reuses the packed arrays of earlier
//! outputs (of other inputs, another format, other masks) returns exactly what a fresh dispatch
//! returns (`plan::low_latency::dispatch`, bit for bit, zeros past the counts included).

mod protocol_support;

use ep_rs::core::plan::low_latency::{LlParams, dispatch};
use proptest::prelude::*;
use protocol_support::*;

fn params(n: usize, e: usize, fp8: (bool, bool, bool)) -> LlParams {
    let p = LlParams::new(n, e);
    if fp8.0 { p.with_fp8(fp8.1, fp8.2) } else { p }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases() / 4))]

    #[test]
    fn reused_outputs_equal_fresh_ones(
        r in 1usize..=5,
        t in 1usize..=4,
        l in 1usize..=3,
        k in 1usize..=4,
        seeds in any::<(u64, u64, u64)>(),
        fmts in any::<[(bool, bool, bool); 3]>(),
    ) {
        let n = 4;
        let e = r * l;
        let mut buf = ll_buffer(sim(fabric(r, 4096, 4, 2), seeds.0, policy(seeds.0 as u8)),
            n, 512, r, e, 2);
        let mut spare = None;
        for (i, (&seed, fmt)) in [seeds.0, seeds.1, seeds.2].iter().zip(fmts).enumerate() {
            let fmt = (fmt.0, fmt.0 && fmt.1, fmt.0 && fmt.1 && fmt.2);
            let g = Gen {
                num_ranks: r,
                max_tokens: t,
                num_experts: e,
                num_topk: k,
                hidden: 512,
                fp8: false,
                mask: 0.2,
                full: i == 0,
            };
            let inputs = gen_inputs(&g, seed, false);
            let p = params(n, e, fmt);
            let Ok(want) = dispatch(&inputs, &p) else { continue };
            let got = buf
                .low_latency_dispatch_reusing(&inputs, &p, spare.take())
                .map_err(|x| TestCaseError::fail(format!("dispatch {i}: {x}")))?;
            prop_assert_eq!(&got.outputs, &want, "dispatch {}", i);
            spare = Some(got);
        }
    }
}
