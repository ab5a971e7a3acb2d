// kernels/gelu.cu compiled as host C++, and its entry points for the launcher.
#include "../../../../kernels/gelu.cu"
#include "launcher.h"

#define GELU_ENTRIES(SUFFIX, T) KERNEL_ENTRY(gelu_fwd_##SUFFIX), KERNEL_ENTRY(gelu_bwd_##SUFFIX),
static const KernelEntry entries[] = {GELU_DTYPES(GELU_ENTRIES)};

const KernelEntry *gelu_kernels(size_t *n) {
    *n = sizeof(entries) / sizeof(entries[0]);
    return entries;
}
