// The emulator's scheduler and runtime calls (see emu.h for what it does and checks).
#include "emu.h"

#include <stdarg.h>

#include <map>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#else
#define EMU_ASAN 0
#endif

// Fiber switch: save the callee-saved registers on the current stack, store its pointer in *save, load the
// other stack's pointer and restore its registers. x86-64 System V only; elsewhere (or with
// -DHEXISEQ_EMU_UCONTEXT, to test that path) the build falls back to ucontext (slower: it saves the signal mask
// with a system call on every switch).
#if defined(__x86_64__) && !defined(HEXISEQ_EMU_UCONTEXT)
extern "C" void hexiseq_emu_switch(void **save, void *load);
__asm__(".text\n"
        ".globl hexiseq_emu_switch\n"
        ".hidden hexiseq_emu_switch\n"
        ".type hexiseq_emu_switch,@function\n"
        "hexiseq_emu_switch:\n"
        "    pushq %rbp\n    pushq %rbx\n    pushq %r12\n    pushq %r13\n    pushq %r14\n    pushq %r15\n"
        "    movq %rsp, (%rdi)\n"
        "    movq %rsi, %rsp\n"
        "    popq %r15\n    popq %r14\n    popq %r13\n    popq %r12\n    popq %rbx\n    popq %rbp\n"
        "    ret\n"
        ".size hexiseq_emu_switch, .-hexiseq_emu_switch\n");
#define EMU_ASM_SWITCH 1
#else
#include <ucontext.h>
#define EMU_ASM_SWITCH 0
#endif

namespace hexiseq_emu {

uint3 block_idx;
dim3 block_dim, grid_dim;
uint64_t ldmatrix_calls = 0, ldmatrix_extra_passes = 0;

namespace {

enum State { RUNNABLE, AT_BLOCK_BARRIER, AT_WARP_BARRIER, DONE };
const char *state_name(State s) {
    switch (s) {
    case RUNNABLE: return "runnable";
    case AT_BLOCK_BARRIER: return "__syncthreads";
    case AT_WARP_BARRIER: return "warp collective";
    default: return "exited";
    }
}

constexpr size_t kStackBytes = 128 * 1024;  // per thread: the kernels keep small arrays on the stack
constexpr int kSmemOptInLimit = 166912;      // sm_80's opt-in maximum (163 KiB); sm_90 allows 227 KiB
int smem_optin_limit = kSmemOptInLimit;       // the emulated device's (set_smem_optin_limit)
constexpr int kSmemDefaultLimit = 48 * 1024; // without cudaFuncSetAttribute
constexpr size_t kExchangeBytes = 2048;      // per warp and parity: mma_sync needs 512 floats

struct AsyncCopy {
    void *dst;
    const void *src; // nullptr: zero-fill
};

struct Fiber {
    std::vector<std::vector<AsyncCopy>> groups; // committed cp.async groups, oldest first
    std::vector<AsyncCopy> open_group;         // issued since the last commit
    void *sp = nullptr;
    unsigned char *stack = nullptr;
    ThreadState ts{};
    State state = DONE;
    const char *waiting_in = "";
#if !EMU_ASM_SWITCH
    ucontext_t uc;
#endif
#if EMU_ASAN
    void *fake_stack = nullptr;
#endif
};

struct Emu {
    std::vector<Fiber> fibers;
    Fiber *cur = nullptr;
    void *sched_sp = nullptr;
#if !EMU_ASM_SWITCH
    ucontext_t sched_uc;
#endif
#if EMU_ASAN
    void *sched_fake_stack = nullptr;
    const void *main_bottom = nullptr;
    size_t main_size = 0;
#endif
    const std::function<void()> *body = nullptr;
    const char *kernel = "";
    int live = 0, at_block = 0;
    std::vector<int> warp_size, warp_live, warp_arrived;
    std::vector<unsigned char> exchange;
    Schedule schedule = SCHEDULE_ROUND_ROBIN;
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    unsigned char *smem = nullptr;
    size_t smem_cap = 0, smem_launch = 0; // the array's size; the running launch's dynamic size
    std::map<const void *, int> max_smem;
    cudaError_t last_error = cudaSuccess;
    uint64_t ready[1024 / 64] = {0}; // bit i: thread i is RUNNABLE (the scheduler's picks in O(words))
    ~Emu() {
        for (Fiber &f : fibers)
            free(f.stack);
    }
} g;

uint64_t next_random() { // xorshift64*
    g.rng ^= g.rng >> 12;
    g.rng ^= g.rng << 25;
    g.rng ^= g.rng >> 27;
    return g.rng * 0x2545f4914f6cdd1dull;
}

void switch_to_scheduler(Fiber *f, bool exiting) {
#if EMU_ASAN
    __sanitizer_start_switch_fiber(exiting ? nullptr : &f->fake_stack, g.main_bottom, g.main_size);
#else
    (void)exiting;
#endif
#if EMU_ASM_SWITCH
    hexiseq_emu_switch(&f->sp, g.sched_sp);
#else
    swapcontext(&f->uc, &g.sched_uc);
#endif
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(f->fake_stack, nullptr, nullptr);
#endif
}

int max_dynamic_smem(const void *kernel) {
    auto it = g.max_smem.find(kernel);
    return it == g.max_smem.end() ? kSmemDefaultLimit : it->second;
}

void set_state(Fiber &f, State st) {
    const size_t i = (size_t)(&f - g.fibers.data());
    f.state = st;
    if (st == RUNNABLE)
        g.ready[i / 64] |= 1ull << (i % 64);
    else
        g.ready[i / 64] &= ~(1ull << (i % 64));
}

// Lowest runnable thread >= from, or -1.
int next_ready(int from, int n) {
    for (int w = from / 64; w * 64 < n; ++w) {
        uint64_t bits = g.ready[w];
        if (w == from / 64)
            bits &= ~0ull << (from % 64);
        if (bits)
            return w * 64 + __builtin_ctzll(bits);
    }
    return -1;
}

// Highest runnable thread < n, or -1.
int last_ready(int n) {
    for (int w = (n - 1) / 64; w >= 0; --w)
        if (g.ready[w])
            return w * 64 + 63 - __builtin_clzll(g.ready[w]);
    return -1;
}

void release_block() {
    for (Fiber &f : g.fibers)
        if (f.state == AT_BLOCK_BARRIER)
            set_state(f, RUNNABLE);
    g.at_block = 0;
}

void fiber_main() {
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &g.main_bottom, &g.main_size);
#endif
    Fiber *f = g.cur;
    (*g.body)();
    if (!f->groups.empty() || !f->open_group.empty())
        fail("thread exited with cp.async copies in flight (no cp.async.wait_group 0)");
    set_state(*f, DONE);
    g.live--;
    const int w = f->ts.warp;
    g.warp_live[w]--;
    if (g.warp_arrived[w] > 0)
        fail("thread exited while lanes of its warp wait in a warp collective (undefined behaviour)");
    if (g.at_block > 0 && g.at_block == g.live)
        release_block(); // exited threads no longer take part in __syncthreads
    switch_to_scheduler(f, true);
    __builtin_unreachable();
}

#if !EMU_ASM_SWITCH
void fiber_main_uc() { fiber_main(); }
#endif

void start_fiber(Fiber &f) {
    f.groups.clear();
    f.open_group.clear();
#if EMU_ASAN
    __asan_unpoison_memory_region(f.stack, kStackBytes); // frames left by the previous block's thread
#endif
#if EMU_ASM_SWITCH
    // Initial frame: six zeroed callee-saved registers, then the "return address" fiber_main, then a slot
    // that makes the stack pointer 8 mod 16 on entry, as after a call.
    uintptr_t top = ((uintptr_t)(f.stack + kStackBytes)) & ~(uintptr_t)15;
    void **sp = (void **)(top - 8 * sizeof(void *));
    for (int i = 0; i < 6; ++i)
        sp[i] = nullptr;
    sp[6] = (void *)&fiber_main;
    sp[7] = nullptr;
    f.sp = sp;
#else
    getcontext(&f.uc);
    f.uc.uc_stack.ss_sp = f.stack;
    f.uc.uc_stack.ss_size = kStackBytes;
    f.uc.uc_link = nullptr;
    makecontext(&f.uc, fiber_main_uc, 0);
#endif
    set_state(f, RUNNABLE);
}

void resume(Fiber &f) {
    g.cur = &f;
#if EMU_ASAN
    __sanitizer_start_switch_fiber(&g.sched_fake_stack, f.stack, kStackBytes);
#endif
#if EMU_ASM_SWITCH
    hexiseq_emu_switch(&g.sched_sp, f.sp);
#else
    swapcontext(&g.sched_uc, &f.uc);
#endif
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(g.sched_fake_stack, nullptr, nullptr);
#endif
    g.cur = nullptr;
}

void run_block(int nthreads) {
    if ((int)g.fibers.size() < nthreads)
        g.fibers.resize(nthreads);
    const int nwarps = (nthreads + 31) / 32;
    g.warp_size.assign(nwarps, 0);
    g.warp_live.assign(nwarps, 0);
    g.warp_arrived.assign(nwarps, 0);
    g.exchange.assign((size_t)nwarps * 2 * kExchangeBytes, 0);
    for (int i = 0; i < nthreads; ++i) {
        Fiber &f = g.fibers[i];
        if (!f.stack)
            f.stack = static_cast<unsigned char *>(malloc(kStackBytes));
        if (!f.stack) {
            fprintf(stderr, "hexiseq_emu: out of memory for thread stacks\n");
            abort();
        }
        f.ts.idx = uint3{(unsigned)i % block_dim.x, (unsigned)i / block_dim.x % block_dim.y,
                         (unsigned)i / block_dim.x / block_dim.y};
        f.ts.warp = i / 32;
        f.ts.lane = i % 32;
        f.ts.collective = 0;
        g.warp_size[i / 32]++;
        g.warp_live[i / 32]++;
        start_fiber(f);
    }
    g.live = nthreads;
    g.at_block = 0;
    while (g.live > 0) {
        bool ran = false;
        if (g.schedule == SCHEDULE_ROUND_ROBIN) { // one pass in index order
            for (int i = next_ready(0, nthreads); i >= 0; i = i + 1 < nthreads ? next_ready(i + 1, nthreads) : -1) {
                resume(g.fibers[i]);
                ran = true;
            }
        } else {
            int i;
            if (g.schedule == SCHEDULE_LOWEST_FIRST) {
                i = next_ready(0, nthreads);
            } else if (g.schedule == SCHEDULE_HIGHEST_FIRST) {
                i = last_ready(nthreads);
            } else { // the first runnable thread at or after a random one, wrapping around
                i = next_ready((int)(next_random() % (uint64_t)nthreads), nthreads);
                if (i < 0)
                    i = next_ready(0, nthreads);
            }
            if (i >= 0) {
                resume(g.fibers[i]);
                ran = true;
            }
        }
        if (!ran && g.live > 0) {
            fprintf(stderr, "hexiseq_emu: %s block (%u,%u,%u): deadlock, %d threads wait forever:\n", g.kernel,
                    block_idx.x, block_idx.y, block_idx.z, g.live);
            int shown = 0;
            for (int i = 0; i < nthreads && shown < 8; ++i)
                if (g.fibers[i].state != DONE) {
                    fprintf(stderr, "  thread %d waits in %s (%s)\n", i, state_name(g.fibers[i].state),
                            g.fibers[i].waiting_in);
                    shown++;
                }
            abort();
        }
    }
}

} // namespace

void set_schedule(Schedule s, uint64_t seed) {
    g.schedule = s;
    g.rng = seed ? seed : 0x9e3779b97f4a7c15ull;
}

ThreadState *current_thread() {
    if (!g.cur) {
        fprintf(stderr, "hexiseq_emu: a device built-in was used outside a kernel\n");
        abort();
    }
    return &g.cur->ts;
}

void fail(const char *fmt, ...) {
    fprintf(stderr, "hexiseq_emu: %s", g.kernel);
    if (g.cur)
        fprintf(stderr, " block (%u,%u,%u) thread (%u,%u,%u)", block_idx.x, block_idx.y, block_idx.z,
                g.cur->ts.idx.x, g.cur->ts.idx.y, g.cur->ts.idx.z);
    fprintf(stderr, ": ");
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n");
    abort();
}

void sync_block() {
    Fiber *f = g.cur;
    if (!f)
        fail("__syncthreads outside a kernel");
    g.at_block++;
    if (g.at_block == g.live) {
        release_block();
        return;
    }
    set_state(*f, AT_BLOCK_BARRIER);
    f->waiting_in = "__syncthreads";
    switch_to_scheduler(f, false);
}

void sync_warp(unsigned mask, const char *what) {
    Fiber *f = g.cur;
    if (!f)
        fail("%s outside a kernel", what);
    const int w = f->ts.warp;
    const unsigned full = g.warp_size[w] == 32 ? 0xffffffffu : (1u << g.warp_size[w]) - 1u;
    if (mask != full)
        fail("%s with mask 0x%08x: the emulator takes whole warps only (0x%08x)", what, mask, full);
    if (g.warp_live[w] != g.warp_size[w])
        fail("%s while %d lanes of the warp have exited (undefined behaviour)", what,
             g.warp_size[w] - g.warp_live[w]);
    f->ts.collective++;
    if (++g.warp_arrived[w] == g.warp_size[w]) {
        g.warp_arrived[w] = 0;
        const int first = w * 32;
        for (int i = first; i < first + g.warp_size[w]; ++i)
            if (g.fibers[i].state == AT_WARP_BARRIER)
                set_state(g.fibers[i], RUNNABLE);
        return;
    }
    set_state(*f, AT_WARP_BARRIER);
    f->waiting_in = what;
    switch_to_scheduler(f, false);
}

void *warp_exchange_buffer(size_t bytes) {
    Fiber *f = g.cur;
    if (bytes > kExchangeBytes)
        fail("warp exchange of %zu bytes exceeds the emulator's %zu", bytes, kExchangeBytes);
    return &g.exchange[((size_t)f->ts.warp * 2 + (f->ts.collective & 1u)) * kExchangeBytes];
}

bool in_shared_memory(const void *p, size_t bytes) { // within the running launch's dynamic shared memory
    const unsigned char *q = static_cast<const unsigned char *>(p);
    return g.smem && q >= g.smem && q + bytes <= g.smem + g.smem_launch;
}

void cp_async16(void *dst, const void *src, bool valid) {
    Fiber *f = g.cur;
    if (!f)
        fail("cp.async outside a kernel");
    if ((uintptr_t)dst % 16 != 0 || !in_shared_memory(dst, 16))
        fail("cp.async destination %p is not a 16-byte aligned shared-memory address", dst);
    if (valid && (uintptr_t)src % 16 != 0)
        fail("cp.async source %p is not 16-byte aligned", src);
    f->open_group.push_back(AsyncCopy{dst, valid ? src : nullptr});
}

void cp_async_commit() {
    Fiber *f = g.cur;
    f->groups.push_back(std::move(f->open_group)); // an empty group is legal
    f->open_group.clear();
}

void cp_async_wait(int allowed) {
    Fiber *f = g.cur;
    while ((int)f->groups.size() > allowed) {
        for (const AsyncCopy &c : f->groups.front()) {
            if (c.src)
                memcpy(c.dst, c.src, 16);
            else
                memset(c.dst, 0, 16);
        }
        f->groups.erase(f->groups.begin());
    }
}

int set_max_dynamic_smem(const void *kernel, int bytes) {
    if (bytes < 0 || bytes > smem_optin_limit)
        return cudaErrorInvalidValue;
    g.max_smem[kernel] = bytes;
    return cudaSuccess;
}

void set_smem_optin_limit(int bytes) {
    smem_optin_limit = bytes;
    g.max_smem.clear(); // opt-ins made for a device with more are void
}

void set_last_error(cudaError_t e) {
    if (g.last_error == cudaSuccess)
        g.last_error = e;
}

int launch(const void *kernel, const char *name, const char *where, dim3 grid, dim3 block, size_t smem,
           unsigned char *shared, const std::function<void()> &body) {
    const uint64_t nthreads = (uint64_t)block.x * block.y * block.z;
    if (nthreads == 0 || nthreads > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
        grid.x > 2147483647u || grid.y > 65535u || grid.z > 65535u)
        return cudaErrorInvalidConfiguration;
    if (smem > (size_t)max_dynamic_smem(kernel))
        return cudaErrorInvalidValue; // the hardware refuses the launch
    if (smem > kSharedMemoryBytes) {
        fprintf(stderr, "hexiseq_emu: %s asks %zu bytes of shared memory; the test gave the emulator %zu\n", name,
                smem, kSharedMemoryBytes);
        abort();
    }
    static std::string label; // "kernel (launched by function [with T = ...])", for the messages
    label = std::string(name) + " (launched by " + where + ")";
    g.kernel = label.c_str();
    g.body = &body;
    g.smem = shared;
    g.smem_cap = kSharedMemoryBytes;
    g.smem_launch = smem;
    block_dim = block;
    grid_dim = grid;
    const uint64_t nblocks = (uint64_t)grid.x * grid.y * grid.z;
    for (uint64_t n = 0; n < nblocks; ++n) {
        block_idx = uint3{(unsigned)(n % grid.x), (unsigned)(n / grid.x % grid.y), (unsigned)(n / grid.x / grid.y)};
        memset(g.smem, 0xff, smem);                      // unwritten shared memory reads as NaN
        memset(g.smem + smem, 0xa5, g.smem_cap - smem); // canary past the launch's size
#if EMU_ASAN
        __asan_poison_memory_region(g.smem + smem, g.smem_cap - smem);
#endif
        run_block((int)nthreads);
#if EMU_ASAN
        __asan_unpoison_memory_region(g.smem + smem, g.smem_cap - smem);
#endif
        for (size_t i = smem; i < g.smem_cap; ++i)
            if (g.smem[i] != 0xa5) {
                fprintf(stderr, "hexiseq_emu: %s block (%u,%u,%u) wrote shared memory byte %zu, past its %zu bytes\n",
                        g.kernel, block_idx.x, block_idx.y, block_idx.z, i, smem);
                abort();
            }
    }
    g.kernel = "";
    g.body = nullptr;
    return cudaSuccess;
}

} // namespace hexiseq_emu

cudaError_t cudaGetLastError() {
    cudaError_t e = hexiseq_emu::g.last_error;
    hexiseq_emu::g.last_error = cudaSuccess;
    return e;
}

const char *cudaGetErrorName(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    }
    return "cudaErrorUnknown";
}

const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    }
    return "unknown error";
}

cudaError_t cudaMallocAsync(void **p, size_t bytes, cudaStream_t) {
    *p = malloc(bytes ? bytes : 1);
    if (!*p)
        return cudaErrorMemoryAllocation;
    memset(*p, 0xff, bytes); // fresh device memory is not zeroed
    return cudaSuccess;
}

cudaError_t cudaFreeAsync(void *p, cudaStream_t) {
    free(p);
    return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t) {
    memset(p, value, bytes);
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device) {
    *device = 0;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device) {
    if (device != 0)
        return cudaErrorInvalidValue;
    if (attr == cudaDevAttrMultiProcessorCount) { // an H100 SXM's
        *value = 132;
        return cudaSuccess;
    }
    if (attr != cudaDevAttrMaxSharedMemoryPerBlockOptin)
        return cudaErrorInvalidValue;
    *value = hexiseq_emu::smem_optin_limit;
    return cudaSuccess;
}
