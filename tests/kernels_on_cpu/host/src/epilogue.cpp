// kernels/epilogue.cu compiled as host C++, and its entry points for the launcher.
#include "../../../../kernels/epilogue.cu"
#include "launcher.h"

#define EPILOGUE_ENTRIES(SUFFIX, T)                                                             \
    KERNEL_ENTRY(epilogue_fwd_##SUFFIX), KERNEL_ENTRY(epilogue_bwd_##SUFFIX),
#define GATE_ENTRIES(SUFFIX, T) KERNEL_ENTRY(gate_fwd_##SUFFIX), KERNEL_ENTRY(gate_bwd_##SUFFIX),
static const KernelEntry entries[] = {EPILOGUE_DTYPES(EPILOGUE_ENTRIES) GATE_DTYPES(GATE_ENTRIES)};

const KernelEntry *epilogue_kernels(size_t *n) {
    *n = sizeof(entries) / sizeof(entries[0]);
    return entries;
}
