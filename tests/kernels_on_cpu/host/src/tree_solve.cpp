// kernels/tree_solve.cu compiled as host C++, and its entry points for the launcher.
#include "../../../../kernels/tree_solve.cu"
#include "launcher.h"

#define TREE_ENTRIES(SUFFIX, T, OPS)                                                              \
    KERNEL_ENTRY(tree_fwd_##SUFFIX), KERNEL_ENTRY(tree_bwd_##SUFFIX),                             \
        KERNEL_ENTRY(tree_block_fwd_##SUFFIX), KERNEL_ENTRY(tree_block_bwd_##SUFFIX),
static const KernelEntry entries[] = {TREE_DTYPES(TREE_ENTRIES)};

const KernelEntry *tree_solve_kernels(size_t *n) {
    *n = sizeof(entries) / sizeof(entries[0]);
    return entries;
}
