//! What the low-latency GPU tests share: the kernel variant `EP_LL_VARIANT` names, and this
//! process's one-PE NVSHMEM session for variant (b).

use std::sync::{Arc, OnceLock};

use ep_kernels::gpu::LlVariant;
use ep_kernels::nvshmem::{Bootstrap, BringUp, NvshmemSession, SoloRendezvous};

/// `EP_LL_VARIANT`: `pointers` (default, variant (a)) or `nvshmem` (variant (b)).
pub(crate) fn variant() -> LlVariant {
    match std::env::var("EP_LL_VARIANT").as_deref() {
        Ok("nvshmem") => LlVariant::Nvshmem,
        Ok("pointers") | Err(_) => LlVariant::Pointers,
        Ok(other) => panic!("EP_LL_VARIANT={other}: use pointers or nvshmem"),
    }
}

/// This process's one-PE NVSHMEM session (NVSHMEM initialises once per process).
pub(crate) fn session() -> Arc<NvshmemSession> {
    static S: OnceLock<Arc<NvshmemSession>> = OnceLock::new();
    S.get_or_init(|| {
        let s = BringUp::new(0, 1, Bootstrap::UniqueId(&SoloRendezvous))
            .device(0)
            .init()
            .expect("NVSHMEM with one PE (variant (b) needs NVSHMEM: EP_TEST_NVSHMEM_LIB or NVSHMEM_HOME)");
        eprintln!("{}", s.report());
        Arc::new(s)
    })
    .clone()
}
