// A CUPTI injection library that records every kernel, memcpy and memset a CUDA program runs:
//
//   CUDA_INJECTION64_PATH=libcupti-trace.so MYO_CUPTI_TRACE=trace.csv myo bench step ...
//
// The driver loads it at the program's first CUDA call and calls InitializeInjection. Each
// record is one CSV line `kind,start_ns,end_ns,name` (kind K, M or S; GPU timestamps; the name
// last, since kernel names may contain commas), written as CUPTI hands its buffers back and
// at exit. scripts/cupti-summary.py turns a trace into kernels per step and the GPU-busy
// fraction. Built by scripts/gpu-bundle.sh against the CUPTI of the CUDA 13.0 wheels; needs
// libcupti.so.13 on the GPU machine (the PyTorch image has it).
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>

#define BUFFER_BYTES (8u << 20)

static FILE *out;

static void report(const char *what, CUptiResult r) {
    const char *msg = "unknown";
    cuptiGetResultString(r, &msg);
    fprintf(stderr, "cupti-trace: %s failed: %s\n", what, msg);
}

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = aligned_alloc(ACTIVITY_RECORD_ALIGNMENT, BUFFER_BYTES);
    *size = *buffer ? BUFFER_BYTES : 0;
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer,
                                      size_t size, size_t valid) {
    (void)ctx, (void)stream, (void)size;
    CUpti_Activity *r = NULL;
    while (out && cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS) {
        switch (r->kind) {
        case CUPTI_ACTIVITY_KIND_KERNEL:
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
            const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)r;
            fprintf(out, "K,%llu,%llu,%s\n", (unsigned long long)k->start,
                    (unsigned long long)k->end, k->name ? k->name : "?");
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY: {
            const CUpti_ActivityMemcpy6 *m = (const CUpti_ActivityMemcpy6 *)r;
            fprintf(out, "M,%llu,%llu,memcpy kind %u, %llu bytes\n", (unsigned long long)m->start,
                    (unsigned long long)m->end, (unsigned)m->copyKind,
                    (unsigned long long)m->bytes);
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMSET: {
            const CUpti_ActivityMemset4 *m = (const CUpti_ActivityMemset4 *)r;
            fprintf(out, "S,%llu,%llu,memset %llu bytes\n", (unsigned long long)m->start,
                    (unsigned long long)m->end, (unsigned long long)m->bytes);
            break;
        }
        default:
            break;
        }
    }
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped) == CUPTI_SUCCESS && dropped)
        fprintf(stderr, "cupti-trace: %zu records dropped\n", dropped);
    free(buffer);
}

static void finish(void) {
    cuptiActivityFlushAll(1);
    if (out) fclose(out);
    out = NULL;
}

int InitializeInjection(void) {
    const char *path = getenv("MYO_CUPTI_TRACE");
    out = fopen(path ? path : "cupti-trace.csv", "w");
    if (!out) {
        perror("cupti-trace: cannot open the trace file");
        return 0;
    }
    CUptiResult r = cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
    if (r != CUPTI_SUCCESS) {
        report("cuptiActivityRegisterCallbacks", r);
        return 0;
    }
    const CUpti_ActivityKind kinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
                                        CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; ++i)
        if ((r = cuptiActivityEnable(kinds[i])) != CUPTI_SUCCESS) report("cuptiActivityEnable", r);
    atexit(finish);
    return 1;
}
