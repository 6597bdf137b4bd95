//! Quick checks while developing.
mod common;
use common::*;
use ep_sim::Policy;

#[test]
fn correct_forms_pass_one_seed() {
    for seed in 0..3 {
        let pol = policy_for(seed);
        ring(Mutation::None, RingParams::default(), seed, pol).unwrap();
        count_then_data(Mutation::None, CountParams::default(), seed, pol).unwrap();
        double_buffer(Mutation::None, DoubleParams::default(), seed, pol).unwrap();
        credit_stream(Mutation::None, CreditParams::default(), seed, pol).unwrap();
    }
    let _ = Policy::Uniform;
}

#[test]
fn mutants_one_seed() {
    for m in [
        Mutation::SignalOnOtherQp,
        Mutation::RingOverflowByOne,
        Mutation::ReadBeforeTail,
    ] {
        for seed in 0..6 {
            let r = ring(m, RingParams::default(), seed, policy_for(seed));
            println!("{m:?} seed {seed}: {:?}", r.err().map(|e| e.to_string()));
        }
    }
    for m in [Mutation::MissingFence, Mutation::CounterNotReset] {
        for seed in 0..6 {
            let r = count_then_data(m, CountParams::default(), seed, policy_for(seed));
            println!("{m:?} seed {seed}: {:?}", r.err().map(|e| e.to_string()));
        }
    }
    for m in [
        Mutation::HookAfterNextCall,
        Mutation::SourceReusedBeforeQuiet,
    ] {
        for seed in 0..6 {
            let r = double_buffer(m, DoubleParams::default(), seed, policy_for(seed));
            println!("{m:?} seed {seed}: {:?}", r.err().map(|e| e.to_string()));
        }
    }
    for seed in 0..6 {
        let r = credit_stream(
            Mutation::StraddleUncounted,
            CreditParams::default(),
            seed,
            policy_for(seed),
        );
        println!("straddle seed {seed}: {:?}", r.err().map(|e| e.to_string()));
    }
}
