// kernels/tree_sweep.cu compiled as host C++, and its entry points for the launcher.
#include "../../../../kernels/tree_sweep.cu"
#include "launcher.h"

#define SWEEP_ENTRIES(SUFFIX, T, OPS)                                                             \
    KERNEL_ENTRY(tree_pivots_##SUFFIX), KERNEL_ENTRY(tree_sweep_fwd_##SUFFIX),                    \
        KERNEL_ENTRY(tree_sweep_bwd_##SUFFIX), KERNEL_ENTRY(tree_block_pivots_##SUFFIX),          \
        KERNEL_ENTRY(tree_sweep_block_fwd_##SUFFIX), KERNEL_ENTRY(tree_sweep_block_bwd_##SUFFIX),
static const KernelEntry entries[] = {SWEEP_DTYPES(SWEEP_ENTRIES)};

const KernelEntry *tree_sweep_kernels(size_t *n) {
    *n = sizeof(entries) / sizeof(entries[0]);
    return entries;
}
