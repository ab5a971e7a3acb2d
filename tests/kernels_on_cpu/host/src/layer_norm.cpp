// kernels/layer_norm.cu compiled as host C++, and its entry points for the launcher.
#include "../../../../kernels/layer_norm.cu"
#include "launcher.h"

#define LAYER_NORM_ENTRIES(SUFFIX, T)                                                           \
    KERNEL_ENTRY(layer_norm_fwd_##SUFFIX), KERNEL_ENTRY(layer_norm_bwd_##SUFFIX),               \
        KERNEL_ENTRY(layer_norm_sums_##SUFFIX),
static const KernelEntry entries[] = {LAYER_NORM_DTYPES(LAYER_NORM_ENTRIES)};

const KernelEntry *layer_norm_kernels(size_t *n) {
    *n = sizeof(entries) / sizeof(entries[0]);
    return entries;
}
