// kernels/s5_discretize.cu compiled as host C++, and its entry points for the launcher.
#include "../../../../kernels/s5_discretize.cu"
#include "launcher.h"

#define S5D_ENTRIES(SUFFIX, T)                                                                  \
    KERNEL_ENTRY(s5_discretize_fwd_##SUFFIX), KERNEL_ENTRY(s5_discretize_bwd_##SUFFIX),
static const KernelEntry entries[] = {S5D_DTYPES(S5D_ENTRIES)};

const KernelEntry *s5_discretize_kernels(size_t *n) {
    *n = sizeof(entries) / sizeof(entries[0]);
    return entries;
}
