// Runs a grid of a kernel from kernels/*.cu on the CPU. The threads of a block are fibers
// (ucontext), run one at a time, each until it reaches __syncthreads() or returns; when every
// thread of the block has reached the barrier, the block's next round starts. Up to RESIDENT
// blocks are resident at once, each on its own OS thread (so each has its own `__shared__`
// memory, which is thread_local), and they take turns round by round: a block that reads
// global memory another block writes (a wrong workspace or output offset) sees the other
// block's values, as it would on a GPU. Only one fiber runs at any time, so a run is
// deterministic. The order of the threads within a round, of the blocks' turns and of the
// blocks themselves is ascending, descending or a seeded shuffle: a thread that reads shared
// memory before the barrier that should have ordered it after another thread's write sees a
// stale value in some order.
//
// Checked besides: the argument list against the kernel's signature, the CUDA limits on grid
// and block sizes, threads that wait at different barriers or leave while others wait, and
// writes past the launch's dynamic shared memory; with MYO_KERNEL_BOUNDS, the block against the
// most threads the kernel is compiled for (below).
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda_host.h"
#include "launcher.h"

thread_local uint3 threadIdx, blockIdx, blockDim, gridDim;

// Dynamic shared memory of the running block: more than any GPU's opt-in limit per block
// (227 KiB on H100). The CANARY bytes past the launch's size must stay poisoned.
static constexpr size_t SMEM_CAPACITY = 256 * 1024, CANARY = 4096;
thread_local __attribute__((aligned(16))) unsigned char smem[SMEM_CAPACITY];
static constexpr unsigned char POISON = 0xff; // NaN in every float format

const KernelEntry *scan_kernels(size_t *n);
const KernelEntry *tree_solve_kernels(size_t *n);
const KernelEntry *tree_lanes_kernels(size_t *n);
const KernelEntry *tree_sweep_kernels(size_t *n);
const KernelEntry *head_solve_kernels(size_t *n);
const KernelEntry *dropout_kernels(size_t *n);
const KernelEntry *adamw_kernels(size_t *n);
const KernelEntry *gelu_kernels(size_t *n);
const KernelEntry *layer_norm_kernels(size_t *n);
const KernelEntry *channel_kernels(size_t *n);
const KernelEntry *batch_norm_kernels(size_t *n);
const KernelEntry *s5_discretize_kernels(size_t *n);
const KernelEntry *s5_readout_kernels(size_t *n);
const KernelEntry *s5_timed_kernels(size_t *n);
const KernelEntry *epilogue_kernels(size_t *n);
const KernelEntry *masked_mean_kernels(size_t *n);
const KernelEntry *cross_entropy_kernels(size_t *n);
const KernelEntry *embedding_kernels(size_t *n);
const KernelEntry *gather_kernels(size_t *n);
const KernelEntry *grad_norm_kernels(size_t *n);

static std::vector<const KernelEntry *> registry() {
    std::vector<const KernelEntry *> all;
    for (auto list : {scan_kernels, tree_solve_kernels, tree_lanes_kernels, tree_sweep_kernels,
                      head_solve_kernels, dropout_kernels, adamw_kernels, gelu_kernels,
                      layer_norm_kernels, channel_kernels, batch_norm_kernels,
                      s5_discretize_kernels, s5_readout_kernels, s5_timed_kernels, epilogue_kernels,
                      masked_mean_kernels, cross_entropy_kernels, embedding_kernels, gather_kernels,
                      grad_norm_kernels}) {
        size_t n = 0;
        const KernelEntry *e = list(&n);
        for (size_t i = 0; i < n; ++i) all.push_back(e + i);
    }
    return all;
}

namespace {

enum State { RUNNABLE, AT_BARRIER, DONE };

// A copy a thread issued with cp.async (its source read then), landing at its wait.
struct AsyncCopy {
    void *dst;
    unsigned char bytes[16];
    size_t size;
};

struct Fiber {
    ucontext_t ctx;
    State state;
    int line;
    const char *file;
    std::vector<AsyncCopy> copies;
    std::string error; // a misuse of cp.async, reported by the scheduler
};

struct Block {
    const KernelEntry *entry;
    void *const *args;
    std::vector<Fiber> fibers;
    ucontext_t scheduler;
    size_t current;
    size_t shared_bytes;
};

thread_local Block *running = nullptr;

struct Failure {
    std::string what;
};

[[noreturn]] void fail(const char *fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    throw Failure{buf};
}

// The most threads per block each kernel is compiled for (its __launch_bounds__, which the host
// compile drops): lines "KERNEL THREADS" in the file MYO_KERNEL_BOUNDS names, made from the
// kernels' PTX by scripts/kernel-resources.sh. Unset: not checked. Read once.
struct LaunchBounds {
    std::string error;
    std::map<std::string, size_t> threads;
};

const LaunchBounds *compiled_bounds() {
    static const LaunchBounds *bounds = []() -> const LaunchBounds * {
        const char *path = getenv("MYO_KERNEL_BOUNDS");
        if (!path || !*path) return nullptr;
        auto *b = new LaunchBounds;
        FILE *f = fopen(path, "r");
        if (!f) {
            b->error = std::string("MYO_KERNEL_BOUNDS: cannot read ") + path;
            return b;
        }
        char name[256];
        size_t n;
        while (fscanf(f, "%255s %zu", name, &n) == 2) b->threads[name] = n;
        fclose(f);
        if (b->threads.empty()) b->error = std::string("MYO_KERNEL_BOUNDS: no kernels in ") + path;
        return b;
    }();
    return bounds;
}

void check_bounds(const char *name, size_t threads) {
    const LaunchBounds *b = compiled_bounds();
    if (!b) return;
    if (!b->error.empty()) fail("%s", b->error.c_str());
    const auto it = b->threads.find(name);
    if (it == b->threads.end()) fail("%s: not in MYO_KERNEL_BOUNDS", name);
    if (threads > it->second)
        fail("%s: a block of %zu threads, compiled for at most %zu (__launch_bounds__)", name,
             threads, it->second);
}

void fiber_main() {
    Block *b = running;
    b->entry->invoke(b->args);
    b->fibers[b->current].state = DONE;
    // returning resumes uc_link: the scheduler
}

// Stacks for the fibers of one block, each above a guard page.
struct Stacks {
    static constexpr size_t SIZE = 128 * 1024;
    size_t page, count;
    unsigned char *base;
    explicit Stacks(size_t n) : page((size_t)sysconf(_SC_PAGESIZE)), count(n) {
        void *p = mmap(nullptr, n * (SIZE + page), PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) fail("cannot map %zu fiber stacks", n);
        base = static_cast<unsigned char *>(p);
        for (size_t i = 0; i < n; ++i) mprotect(base + i * (SIZE + page), page, PROT_NONE);
    }
    ~Stacks() { munmap(base, count * (SIZE + page)); }
    void *stack(size_t i) const { return base + i * (SIZE + page) + page; }
};

std::vector<size_t> order_of(size_t n, int order, std::mt19937_64 &rng) {
    std::vector<size_t> idx(n);
    std::iota(idx.begin(), idx.end(), 0);
    if (order == 1) std::reverse(idx.begin(), idx.end());
    if (order == 2) std::shuffle(idx.begin(), idx.end(), rng);
    return idx;
}

uint3 unflatten(size_t i, uint3 dims) {
    return {(unsigned)(i % dims.x), (unsigned)(i / dims.x % dims.y),
            (unsigned)(i / ((size_t)dims.x * dims.y))};
}

// Starts the block `blockIdx` on this OS thread: poisoned shared memory, fresh fibers.
void begin_block(Block &b, const Stacks &stacks, size_t shared_bytes) {
    memset(smem, POISON, std::min(shared_bytes + CANARY, SMEM_CAPACITY));
    b.shared_bytes = shared_bytes;
    for (size_t t = 0; t < b.fibers.size(); ++t) {
        Fiber &f = b.fibers[t];
        f.copies.clear();
        f.error.clear();
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = stacks.stack(t);
        f.ctx.uc_stack.ss_size = Stacks::SIZE;
        f.ctx.uc_link = &b.scheduler;
        makecontext(&f.ctx, fiber_main, 0);
        f.state = RUNNABLE;
    }
}

// One round of the block: every thread, in `order`, runs to its next barrier or returns.
// Returns whether the block has finished; fails on diverging barriers and, at the end, on
// writes past the launch's dynamic shared memory.
bool block_round(Block &b, const std::vector<size_t> &order, size_t shared_bytes) {
    const size_t n = b.fibers.size();
    for (size_t t : order) {
        if (b.fibers[t].state != RUNNABLE) continue;
        threadIdx = unflatten(t, blockDim);
        b.current = t;
        swapcontext(&b.scheduler, &b.fibers[t].ctx);
        const Fiber &f = b.fibers[t];
        if (f.error.empty() && f.state == DONE && !f.copies.empty())
            fail("block (%u, %u, %u): thread %zu returned with %zu cp.async copies it did not "
                 "wait for",
                 blockIdx.x, blockIdx.y, blockIdx.z, t, f.copies.size());
        if (!f.error.empty())
            fail("block (%u, %u, %u): thread %zu: %s", blockIdx.x, blockIdx.y, blockIdx.z, t,
                 f.error.c_str());
    }
    size_t done = 0;
    const Fiber *waiting = nullptr;
    for (size_t t = 0; t < n; ++t) {
        const Fiber &f = b.fibers[t];
        if (f.state == DONE) {
            ++done;
        } else if (!waiting) {
            waiting = &f;
        } else if (f.line != waiting->line || f.file != waiting->file) {
            fail("block (%u, %u, %u): thread %zu waits at __syncthreads() at %s:%d, thread %zu "
                 "at %s:%d",
                 blockIdx.x, blockIdx.y, blockIdx.z, (size_t)(waiting - b.fibers.data()),
                 waiting->file, waiting->line, t, f.file, f.line);
        }
    }
    if (done > 0 && done < n)
        fail("block (%u, %u, %u): %zu threads returned while %zu wait at __syncthreads() at "
             "%s:%d",
             blockIdx.x, blockIdx.y, blockIdx.z, done, n - done, waiting->file, waiting->line);
    if (done < n) {
        for (Fiber &f : b.fibers) f.state = RUNNABLE;
        return false;
    }
    for (size_t i = shared_bytes; i < std::min(shared_bytes + CANARY, SMEM_CAPACITY); ++i)
        if (smem[i] != POISON)
            fail("block (%u, %u, %u) wrote byte %zu of dynamic shared memory, past the launch's "
                 "%zu bytes",
                 blockIdx.x, blockIdx.y, blockIdx.z, i, shared_bytes);
    return true;
}

// Blocks resident at once. Each runs on its own OS thread; the launcher hands a baton to one
// of them at a time, for one round.
constexpr size_t RESIDENT = 8;

struct Slot {
    std::condition_variable go; // the slot's turn, or quit
    bool active = false, start = false, done = false;
    uint3 block{};
    std::vector<size_t> order; // of the threads, for this round
    std::string error;
};

struct Grid {
    const KernelEntry *entry;
    void *const *args;
    uint3 grid, block;
    size_t threads, shared_bytes;
};

// The resident OS threads of one launching thread, kept (with their fiber stacks) from one
// launch to the next.
struct Pool {
    std::mutex m;
    std::condition_variable back; // the launcher's turn
    long turn = -1;               // the slot running a round, or -1: the launcher
    bool quit = false;
    const Grid *grid = nullptr;
    std::deque<Slot> slots; // not moved when it grows
    std::vector<std::thread> threads;

    void grow(size_t n);
    // Runs one round of slot `s` on its thread and waits for it.
    void give_turn(size_t s) {
        std::unique_lock<std::mutex> lock(m);
        turn = (long)s;
        slots[s].go.notify_one();
        back.wait(lock, [&] { return turn == -1; });
    }
    ~Pool() {
        {
            std::lock_guard<std::mutex> lock(m);
            quit = true;
            for (Slot &s : slots) s.go.notify_one();
        }
        for (std::thread &t : threads) t.join();
    }
};

// The OS thread of resident slot `me`: runs rounds of its blocks when given the turn.
void resident(Pool *pool, size_t me) {
    Block b{nullptr, nullptr, {}, {}, 0, 0};
    running = &b;
    std::unique_ptr<Stacks> stacks;
    std::unique_lock<std::mutex> lock(pool->m);
    for (;;) {
        Slot &s = pool->slots[me];
        s.go.wait(lock, [&] { return pool->turn == (long)me || pool->quit; });
        if (pool->quit) break;
        const Grid &g = *pool->grid;
        try {
            if (s.start) {
                if (!stacks || stacks->count < g.threads) stacks.reset(new Stacks(g.threads));
                gridDim = g.grid;
                blockDim = g.block;
                blockIdx = s.block;
                b.entry = g.entry;
                b.args = g.args;
                b.fibers.resize(g.threads);
                begin_block(b, *stacks, g.shared_bytes);
                s.start = false;
            }
            s.done = block_round(b, s.order, g.shared_bytes);
        } catch (const Failure &f) {
            s.error = f.what;
            s.done = true;
        }
        pool->turn = -1;
        pool->back.notify_one();
    }
    running = nullptr;
}

void Pool::grow(size_t n) {
    {
        std::lock_guard<std::mutex> lock(m); // resident threads index the deque
        while (slots.size() < n) slots.emplace_back();
    }
    while (threads.size() < n) threads.emplace_back(resident, this, threads.size());
}

thread_local Pool pool;

// Runs every block of the grid, RESIDENT at a time, to completion; returns the first error.
std::string run_grid(const Grid &g, int order, std::mt19937_64 &rng) {
    const size_t blocks = (size_t)g.grid.x * g.grid.y * g.grid.z;
    const std::vector<size_t> queue = order_of(blocks, order, rng);
    const size_t resident = std::min(blocks, RESIDENT);
    size_t next = 0;
    pool.grow(resident);
    pool.grid = &g;
    auto assign = [&](Slot &s) {
        s.active = next < blocks;
        s.error.clear();
        if (s.active) {
            s.block = unflatten(queue[next++], g.grid);
            s.start = true;
            s.done = false;
        }
    };
    for (size_t i = 0; i < resident; ++i) assign(pool.slots[i]);
    for (bool any = true; any;) {
        any = false;
        for (size_t i : order_of(resident, order, rng)) {
            Slot &s = pool.slots[i];
            if (!s.active) continue;
            any = true;
            s.order = order_of(g.threads, order, rng);
            pool.give_turn(i);
            if (!s.error.empty()) return s.error;
            if (s.done) assign(s);
        }
    }
    return "";
}

} // namespace

void cuda_host_syncthreads(int line, const char *file) {
    Block *b = running;
    if (!b) {
        fprintf(stderr, "__syncthreads() outside a kernel launch\n");
        abort();
    }
    Fiber &f = b->fibers[b->current];
    f.state = AT_BARRIER;
    f.line = line;
    f.file = file;
    swapcontext(&f.ctx, &b->scheduler);
}

void cuda_host_copy_async(void *dst, const void *src, size_t bytes) {
    Block *b = running;
    if (!b) {
        fprintf(stderr, "cp.async outside a kernel launch\n");
        abort();
    }
    Fiber &f = b->fibers[b->current];
    unsigned char *d = static_cast<unsigned char *>(dst);
    if (!f.error.empty()) return;
    if (bytes != 4 && bytes != 8 && bytes != 16) {
        f.error = "a cp.async of " + std::to_string(bytes) + " bytes (4, 8 or 16)";
    } else if (d < smem || d + bytes > smem + b->shared_bytes) {
        f.error = "a cp.async to memory that is not the launch's dynamic shared memory";
    } else if ((uintptr_t)src % bytes != 0 || (uintptr_t)dst % bytes != 0) {
        f.error = "a cp.async of " + std::to_string(bytes) + " bytes not aligned to its size";
    }
    if (!f.error.empty()) return;
    AsyncCopy c{dst, {}, bytes};
    memcpy(c.bytes, src, bytes);
    memset(dst, POISON, bytes);
    f.copies.push_back(c);
}

void cuda_host_wait_async() {
    Block *b = running;
    if (!b) {
        fprintf(stderr, "cp.async.wait_all outside a kernel launch\n");
        abort();
    }
    Fiber &f = b->fibers[b->current];
    for (const AsyncCopy &c : f.copies) memcpy(c.dst, c.bytes, c.size);
    f.copies.clear();
}

extern "C" {

struct HostArg {
    int kind; // ArgKind
    void *ptr;
    int value;
    unsigned long long wide;
};

static const char *kind_name(int kind) {
    return kind == ARG_POINTER ? "a pointer"
           : kind == ARG_I32   ? "an int"
           : kind == ARG_U64   ? "an unsigned long long"
                               : "a struct";
}

size_t kernels_on_cpu_count() { return registry().size(); }

const char *kernels_on_cpu_name(size_t i) {
    const auto all = registry();
    return i < all.size() ? all[i]->name : nullptr;
}

// Runs the grid; returns 0, or 1 with a message in `err`.
int kernels_on_cpu_launch(const char *name, const unsigned grid[3], const unsigned block[3],
                          size_t shared_bytes, const HostArg *args, size_t nargs, int order,
                          uint64_t seed, char *err, size_t err_len) {
    try {
        const KernelEntry *entry = nullptr;
        for (const KernelEntry *e : registry())
            if (strcmp(e->name, name) == 0) entry = e;
        if (!entry) fail("no kernel named %s in kernels/*.cu", name);
        if (nargs != entry->nargs)
            fail("%s takes %zu arguments, the launch passes %zu", name, entry->nargs, nargs);
        std::vector<void *> slots(nargs);
        std::vector<void *> argv(nargs);
        for (size_t i = 0; i < nargs; ++i) {
            if (args[i].kind != entry->kinds[i])
                fail("argument %zu of %s is %s, the launch passes %s", i, name,
                     kind_name(entry->kinds[i]), kind_name(args[i].kind));
            if (args[i].kind == ARG_STRUCT && args[i].wide != entry->sizes[i])
                fail("argument %zu of %s is a struct of %zu bytes, the launch passes %llu", i,
                     name, entry->sizes[i], args[i].wide);
            slots[i] = args[i].ptr;
            argv[i] = args[i].kind == ARG_POINTER  ? (void *)&slots[i]
                      : args[i].kind == ARG_I32    ? (void *)&args[i].value
                      : args[i].kind == ARG_STRUCT ? args[i].ptr
                                                   : (void *)&args[i].wide;
        }
        const uint3 g{grid[0], grid[1], grid[2]}, bd{block[0], block[1], block[2]};
        const size_t threads = (size_t)bd.x * bd.y * bd.z;
        if (threads == 0 || threads > 1024 || bd.x > 1024 || bd.y > 1024 || bd.z > 64)
            fail("%s: block (%u, %u, %u) is outside CUDA's limits", name, bd.x, bd.y, bd.z);
        check_bounds(name, threads);
        if (g.x == 0 || g.y == 0 || g.z == 0 || g.x > 0x7fffffffu || g.y > 65535 || g.z > 65535)
            fail("%s: grid (%u, %u, %u) is outside CUDA's limits", name, g.x, g.y, g.z);
        if (shared_bytes + CANARY > SMEM_CAPACITY)
            fail("%s: %zu bytes of dynamic shared memory, more than any GPU has", name,
                 shared_bytes);

        std::mt19937_64 rng(seed);
        const Grid grid{entry, argv.data(), g, bd, threads, shared_bytes};
        const std::string error = run_grid(grid, order, rng);
        if (!error.empty()) fail("%s", error.c_str());
        return 0;
    } catch (const Failure &f) {
        snprintf(err, err_len, "%s", f.what.c_str());
        return 1;
    }
}
}
