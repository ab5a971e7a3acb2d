// kernels/adamw.cu compiled as host C++, and its entry points for the launcher.
#include "../../../../kernels/adamw.cu"
#include "launcher.h"

#define ADAMW_ENTRIES(NAME, T, G, C) KERNEL_ENTRY(NAME),
static const KernelEntry entries[] = {ADAMW_INSTANCES(ADAMW_ENTRIES)};

const KernelEntry *adamw_kernels(size_t *n) {
    *n = sizeof(entries) / sizeof(entries[0]);
    return entries;
}
