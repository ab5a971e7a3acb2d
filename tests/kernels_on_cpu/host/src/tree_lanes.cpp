// kernels/tree_lanes.cu compiled as host C++, and its entry points for the launcher.
#include "../../../../kernels/tree_lanes.cu"
#include "launcher.h"

#define LANE_ENTRIES(SUFFIX, T, OPS)                                                              \
    KERNEL_ENTRY(tree_lanes_fwd_##SUFFIX), KERNEL_ENTRY(tree_lanes_bwd_##SUFFIX),                 \
        KERNEL_ENTRY(tree_lanes_block_fwd_##SUFFIX), KERNEL_ENTRY(tree_lanes_block_bwd_##SUFFIX),
static const KernelEntry entries[] = {LANE_DTYPES(LANE_ENTRIES)};

const KernelEntry *tree_lanes_kernels(size_t *n) {
    *n = sizeof(entries) / sizeof(entries[0]);
    return entries;
}

// The index division of kernels/tree_steps.cuh (Divisor) outside a kernel, for its test.
extern "C" int kernels_on_cpu_divide(int n, int d) { return Divisor(d).div(n); }
