// kernels/scan.cu compiled as host C++, and its entry points for the launcher.
#include "../../../../kernels/scan.cu"
#include "launcher.h"

#define SCAN_ENTRIES(SUFFIX, T, OPS) KERNEL_ENTRY(scan_fwd_##SUFFIX), KERNEL_ENTRY(scan_bwd_##SUFFIX),
static const KernelEntry entries[] = {SCAN_DTYPES(SCAN_ENTRIES)};

const KernelEntry *scan_kernels(size_t *n) {
    *n = sizeof(entries) / sizeof(entries[0]);
    return entries;
}
