// kernels/batch_norm.cu compiled as host C++, and its entry points for the launcher.
#include "../../../../kernels/batch_norm.cu"
#include "launcher.h"

#define BATCH_NORM_ENTRIES(SUFFIX, T)                                                           \
    KERNEL_ENTRY(batch_norm_stats_##SUFFIX), KERNEL_ENTRY(batch_norm_apply_##SUFFIX),           \
        KERNEL_ENTRY(batch_norm_bwd_stats_##SUFFIX), KERNEL_ENTRY(batch_norm_bwd_##SUFFIX),     \
        KERNEL_ENTRY(batch_norm_running_##SUFFIX),
#define BATCH_NORM_SUM_ENTRIES(SUFFIX, F)                                                       \
    KERNEL_ENTRY(batch_norm_sums_##SUFFIX), KERNEL_ENTRY(batch_norm_pair_##SUFFIX),
static const KernelEntry entries[] = {BATCH_NORM_DTYPES(BATCH_NORM_ENTRIES)
                                          BATCH_NORM_SUM_DTYPES(BATCH_NORM_SUM_ENTRIES)};

const KernelEntry *batch_norm_kernels(size_t *n) {
    *n = sizeof(entries) / sizeof(entries[0]);
    return entries;
}
