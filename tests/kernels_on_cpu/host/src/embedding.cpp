// kernels/embedding.cu compiled as host C++, and its entry points for the launcher.
#include "../../../../kernels/embedding.cu"
#include "launcher.h"

#define EMBEDDING_ENTRIES(SUFFIX, T)                                                            \
    KERNEL_ENTRY(embedding_fwd_##SUFFIX), KERNEL_ENTRY(embedding_bwd_##SUFFIX),
static const KernelEntry entries[] = {EMBEDDING_DTYPES(EMBEDDING_ENTRIES)};

const KernelEntry *embedding_kernels(size_t *n) {
    *n = sizeof(entries) / sizeof(entries[0]);
    return entries;
}
