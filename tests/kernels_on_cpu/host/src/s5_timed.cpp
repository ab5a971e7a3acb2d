// kernels/s5_timed.cu compiled as host C++, and its entry points for the launcher.
#include "../../../../kernels/s5_timed.cu"
#include "launcher.h"

#define S5T_ENTRIES(SUFFIX, T)                                                                  \
    KERNEL_ENTRY(s5_timed_fwd_##SUFFIX), KERNEL_ENTRY(s5_timed_bwd_##SUFFIX),                   \
        KERNEL_ENTRY(s5_timed_sums_##SUFFIX),
static const KernelEntry entries[] = {S5T_DTYPES(S5T_ENTRIES)};

const KernelEntry *s5_timed_kernels(size_t *n) {
    *n = sizeof(entries) / sizeof(entries[0]);
    return entries;
}
