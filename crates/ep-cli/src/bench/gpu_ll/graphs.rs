//! Captured phases replayed as CUDA graphs and timed (the definition of a phase's time).

use ep_kernels::gpu::{
    LlCombineArgs, LlCombineInput, LlDispatchArgs, LlGroup, LlPoison, LlRankInputs,
};

use super::verify::{Verify, verify};
use crate::bench::error::BenchError;
use crate::bench::gpu::{gpu_err, samples};

/// Per-call samples of the graph replays, or the mismatches of the verified replay.
pub(super) struct GraphSamples {
    pub(super) dispatch: Vec<f64>,
    pub(super) combine: Vec<f64>,
    pub(super) both: Vec<f64>,
    pub(super) bad: Option<Vec<String>>,
}

/// Captures dispatch + combine, dispatch, and combine as graphs; verifies one replay of the
/// first and of the pair of the others (outputs poisoned first); times `total - warm` replays of
/// each after `warm` (module docs).
pub(super) fn time_graphs(
    g: &mut LlGroup,
    inputs: &[LlRankInputs<'_>],
    (dargs, cargs): (&LlDispatchArgs, &LlCombineArgs),
    y_in: &[LlCombineInput<'_>],
    v: &Verify<'_>,
    total: usize,
    warm: usize,
) -> Result<GraphSamples, BenchError> {
    let both = g
        .capture(|g| {
            let o = g.dispatch(inputs, dargs)?;
            let hs: Vec<_> = o.iter().map(|o| &o.handle).collect();
            let c = g.combine_with(&hs, y_in, cargs)?;
            Ok((o, c))
        })
        .map_err(gpu_err("capturing dispatch + combine"))?;
    let poison = |g: &mut LlGroup| -> Result<(), BenchError> {
        g.poison_for_test(LlPoison::Dispatch, 0xa5)
            .and_then(|()| g.poison_for_test(LlPoison::Combine, 0x5a))
            .map_err(gpu_err("poisoning the outputs"))
    };
    poison(g)?;
    both.replay(g).map_err(gpu_err("graph replay"))?;
    g.sync().map_err(gpu_err("graph replay"))?;
    let (o, c) = both.outputs();
    let (bad, _) = verify(o, c, v)?;
    if !bad.is_empty() {
        return Ok(GraphSamples {
            dispatch: Vec::new(),
            combine: Vec::new(),
            both: Vec::new(),
            bad: Some(bad),
        });
    }
    let t_both = samples(total, warm, |_| {
        g.timed(|g| both.replay(g))
            .map(|(_, t)| t)
            .map_err(gpu_err("timed dispatch + combine graph"))
    })?;
    // A dispatch graph, then (after one replay, whose handles it combines) a combine graph.
    let disp = g
        .capture(|g| g.dispatch(inputs, dargs))
        .map_err(gpu_err("capturing dispatch"))?;
    poison(g)?;
    disp.replay(g).map_err(gpu_err("graph replay"))?;
    let comb = g
        .capture(|g| {
            let hs: Vec<_> = disp.outputs().iter().map(|o| &o.handle).collect();
            g.combine_with(&hs, y_in, cargs)
        })
        .map_err(gpu_err("capturing combine"))?;
    comb.replay(g).map_err(gpu_err("graph replay"))?;
    g.sync().map_err(gpu_err("graph replay"))?;
    let (bad, _) = verify(disp.outputs(), comb.outputs(), v)?;
    if !bad.is_empty() {
        return Ok(GraphSamples {
            dispatch: Vec::new(),
            combine: Vec::new(),
            both: t_both,
            bad: Some(bad),
        });
    }
    let t_disp = samples(total, warm, |_| {
        let t = g
            .timed(|g| disp.replay(g))
            .map(|(_, t)| t)
            .map_err(gpu_err("timed dispatch graph"))?;
        comb.replay(g).map_err(gpu_err("combine graph"))?;
        Ok(t)
    })?;
    let t_comb = samples(total, warm, |_| {
        // Each timed combine combines a fresh dispatch (untimed, enqueued before the gate).
        disp.replay(g).map_err(gpu_err("dispatch graph"))?;
        g.timed(|g| comb.replay(g))
            .map(|(_, t)| t)
            .map_err(gpu_err("timed combine graph"))
    })?;
    g.sync().map_err(gpu_err("graph replays"))?;
    Ok(GraphSamples {
        dispatch: t_disp,
        combine: t_comb,
        both: t_both,
        bad: None,
    })
}
