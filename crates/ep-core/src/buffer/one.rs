//! The calls of a process that drives one rank (the deployment shape: one rank per process,
//! one GPU each), without one-element slices: each is the slice call of [`Buffer`] with the
//! rank's inputs, returning the rank's outputs. On an executor with several local ranks (the
//! simulator holds every rank) they are [`Error::RankCountMismatch`](crate::Error).

use super::{Buffer, NormalDispatchArgs};
use crate::error::Result;
use crate::executor::{Executor, Tensors};

type T<E> = <E as Executor>::T;

/// The one output of a call that had one input.
fn only<X>(mut v: Vec<X>) -> X {
    debug_assert_eq!(v.len(), 1, "a one-rank call returns one output");
    v.swap_remove(0)
}

impl<E: Executor> Buffer<E> {
    /// [`Buffer::get_dispatch_layout`] of this process's one rank.
    pub fn layout_one(
        &mut self,
        topk_idx: &<T<E> as Tensors>::Idx,
        num_experts: usize,
    ) -> Result<<T<E> as Tensors>::Layout> {
        self.get_dispatch_layout(std::slice::from_ref(topk_idx), num_experts)
            .map(only)
    }

    /// [`Buffer::dispatch`] of this process's one rank.
    pub fn dispatch_one(
        &mut self,
        inputs: &<T<E> as Tensors>::Inputs,
        layout: &<T<E> as Tensors>::Layout,
        num_experts: usize,
        args: &NormalDispatchArgs,
    ) -> Result<<T<E> as Tensors>::Dispatch> {
        self.dispatch(
            std::slice::from_ref(inputs),
            std::slice::from_ref(layout),
            num_experts,
            args,
        )
        .map(only)
    }

    /// [`Buffer::dispatch_cached`] of this process's one rank.
    pub fn dispatch_cached_one(
        &mut self,
        x: &<T<E> as Tensors>::Rows,
        handle: &<T<E> as Tensors>::Handle,
    ) -> Result<<T<E> as Tensors>::Rows> {
        self.dispatch_cached(&[x], std::slice::from_ref(handle))
            .map(only)
    }

    /// [`Buffer::combine`] of this process's one rank.
    pub fn combine_one<'a>(
        &mut self,
        handle: &'a <T<E> as Tensors>::Handle,
        args: &'a <T<E> as Tensors>::CombineIn<'a>,
    ) -> Result<<T<E> as Tensors>::Combined> {
        self.combine(std::slice::from_ref(handle), std::slice::from_ref(args))
            .map(only)
    }
}
