// kernels/cross_entropy.cu compiled as host C++, and its entry points for the launcher.
#include "../../../../kernels/cross_entropy.cu"
#include "launcher.h"

#define CE_ENTRIES(SUFFIX, T)                                                                   \
    KERNEL_ENTRY(cross_entropy_fwd_##SUFFIX), KERNEL_ENTRY(cross_entropy_bwd_##SUFFIX),
static const KernelEntry entries[] = {CE_DTYPES(CE_ENTRIES)};

const KernelEntry *cross_entropy_kernels(size_t *n) {
    *n = sizeof(entries) / sizeof(entries[0]);
    return entries;
}
