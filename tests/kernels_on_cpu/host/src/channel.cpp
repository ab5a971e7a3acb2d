// kernels/channel.cu compiled as host C++, and its entry points for the launcher.
#include "../../../../kernels/channel.cu"
#include "launcher.h"

#define CHANNEL_ENTRIES(SUFFIX, T)                                                              \
    KERNEL_ENTRY(channel_fwd_##SUFFIX), KERNEL_ENTRY(channel_bwd_##SUFFIX),                     \
        KERNEL_ENTRY(channel_sums_##SUFFIX),
static const KernelEntry entries[] = {CHANNEL_DTYPES(CHANNEL_ENTRIES)};

const KernelEntry *channel_kernels(size_t *n) {
    *n = sizeof(entries) / sizeof(entries[0]);
    return entries;
}
