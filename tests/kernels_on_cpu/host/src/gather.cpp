// kernels/gather.cu compiled as host C++, and its entry points for the launcher.
#include "../../../../kernels/gather.cu"
#include "launcher.h"

#define GATHER_ENTRIES(SUFFIX, T) KERNEL_ENTRY(gather_fwd_##SUFFIX), KERNEL_ENTRY(gather_bwd_##SUFFIX),
static const KernelEntry entries[] = {GATHER_DTYPES(GATHER_ENTRIES)};

const KernelEntry *gather_kernels(size_t *n) {
    *n = sizeof(entries) / sizeof(entries[0]);
    return entries;
}
