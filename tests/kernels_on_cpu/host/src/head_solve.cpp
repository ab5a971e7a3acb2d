// kernels/head_solve.cu compiled as host C++, and its entry points for the launcher.
#include "../../../../kernels/head_solve.cu"
#include "launcher.h"

#define HEAD_ENTRIES(SUFFIX, T, OPS)                                                              \
    KERNEL_ENTRY(head_pivots_##SUFFIX), KERNEL_ENTRY(head_sweep_##SUFFIX),                        \
        KERNEL_ENTRY(head_staged_##SUFFIX), KERNEL_ENTRY(head_reduce_##SUFFIX),
static const KernelEntry entries[] = {HEAD_DTYPES(HEAD_ENTRIES)};

const KernelEntry *head_solve_kernels(size_t *n) {
    *n = sizeof(entries) / sizeof(entries[0]);
    return entries;
}
