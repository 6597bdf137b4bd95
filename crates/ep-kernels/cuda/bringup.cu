// Bring-up kernel: plain stores (no NVSHMEM device code, no -rdc) through a pointer that may be a
// peer's symmetric buffer obtained with nvshmem_ptr. Used by the two-process bring-up test.
#include <stdint.h>

// dst[i] = value + i for i in [0, n).
extern "C" __global__ void ep_bringup_fill(uint64_t *dst, uint64_t value, uint64_t n) {
    uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        dst[i] = value + i;
    }
}
