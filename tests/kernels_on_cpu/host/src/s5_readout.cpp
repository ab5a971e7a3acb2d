// kernels/s5_readout.cu compiled as host C++, and its entry points for the launcher.
#include "../../../../kernels/s5_readout.cu"
#include "launcher.h"

#define S5R_ENTRIES(SUFFIX, T) KERNEL_ENTRY(s5_readout_fwd_##SUFFIX), KERNEL_ENTRY(s5_readout_bwd_##SUFFIX),
static const KernelEntry entries[] = {S5R_DTYPES(S5R_ENTRIES)};

const KernelEntry *s5_readout_kernels(size_t *n) {
    *n = sizeof(entries) / sizeof(entries[0]);
    return entries;
}
