// kernels/adamw.cu compiled as host C++, and its entry points for the launcher.
#include "../../../../kernels/adamw.cu"
#include "launcher.h"

#define ADAMW_ENTRIES(SUFFIX, T) KERNEL_ENTRY(adamw_step_##SUFFIX),
static const KernelEntry entries[] = {ADAMW_DTYPES(ADAMW_ENTRIES)};

const KernelEntry *adamw_kernels(size_t *n) {
    *n = sizeof(entries) / sizeof(entries[0]);
    return entries;
}
