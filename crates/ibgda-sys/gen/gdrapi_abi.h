/* ep-rs's declaration of the subset of the GDRCopy 2.x user-space ABI (libgdrapi.so.2) that
 * ibgda-sys binds, written against GDRCopy 2.5's documented API. generate.sh uses the real
 * gdrapi.h instead when GDRAPI_H points at one. */
#include <stdint.h>
#include <stddef.h>

struct gdr;
typedef struct gdr *gdr_t;
typedef struct gdr_mh_s {
    unsigned long h;
} gdr_mh_t;

gdr_t gdr_open(void);
int gdr_close(gdr_t g);
int gdr_pin_buffer(gdr_t g, unsigned long addr, size_t size, uint64_t p2p_token, uint32_t va_space, gdr_mh_t *handle);
int gdr_unpin_buffer(gdr_t g, gdr_mh_t handle);
int gdr_map(gdr_t g, gdr_mh_t handle, void **va, size_t size);
int gdr_unmap(gdr_t g, gdr_mh_t handle, void *va, size_t size);
void gdr_runtime_get_version(int *major, int *minor);
int gdr_driver_get_version(gdr_t g, int *major, int *minor);
