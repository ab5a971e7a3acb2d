// kernels/dropout.cu compiled as host C++, and its entry points for the launcher.
#include "../../../../kernels/dropout.cu"
#include "launcher.h"

#define DROPOUT_ENTRIES(SUFFIX, T) KERNEL_ENTRY(dropout_keep_##SUFFIX),
static const KernelEntry entries[] = {DROPOUT_DTYPES(DROPOUT_ENTRIES)};

const KernelEntry *dropout_kernels(size_t *n) {
    *n = sizeof(entries) / sizeof(entries[0]);
    return entries;
}
