/* Input of generate.sh: the rdma-core headers ibgda-sys binds. */
#include <infiniband/verbs.h>
#include <infiniband/mlx5dv.h>
