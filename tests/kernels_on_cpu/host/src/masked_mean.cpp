// kernels/masked_mean.cu compiled as host C++, and its entry points for the launcher.
#include "../../../../kernels/masked_mean.cu"
#include "launcher.h"

#define MASKED_MEAN_ENTRIES(SUFFIX, T)                                                          \
    KERNEL_ENTRY(masked_mean_fwd_##SUFFIX), KERNEL_ENTRY(masked_mean_bwd_##SUFFIX),
static const KernelEntry entries[] = {MASKED_MEAN_DTYPES(MASKED_MEAN_ENTRIES)};

const KernelEntry *masked_mean_kernels(size_t *n) {
    *n = sizeof(entries) / sizeof(entries[0]);
    return entries;
}
