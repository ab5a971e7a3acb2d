// kernels/grad_norm.cu compiled as host C++, and its entry points for the launcher.
#include "../../../../kernels/grad_norm.cu"
#include "launcher.h"

#define GRAD_NORM_PARTS_ENTRY(SUFFIX, T) KERNEL_ENTRY(grad_norm_parts_##SUFFIX),
#define GRAD_NORM_SUM_ENTRY(SUFFIX, T) KERNEL_ENTRY(grad_norm_sum_##SUFFIX),
static const KernelEntry entries[] = {GRAD_NORM_PARTS_DTYPES(GRAD_NORM_PARTS_ENTRY)
                                          GRAD_NORM_SUM_DTYPES(GRAD_NORM_SUM_ENTRY)};

const KernelEntry *grad_norm_kernels(size_t *n) {
    *n = sizeof(entries) / sizeof(entries[0]);
    return entries;
}
