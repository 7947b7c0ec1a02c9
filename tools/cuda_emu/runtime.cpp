// The CPU emulation of CUDA (cuda_emu.h says what is emulated and how): the block scheduler
// over fibers, barriers and warp collectives, the tensor-core product, cp.async, device memory
// with guard pages, the race check, and the subset of the CUDA runtime API that hybridlm
// calls (the same C declarations as cuda_runtime_api.h, so this file replaces libcudart).
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <cuda.h>  // CUtensorMap and cuTensorMapEncodeTiled's types

#include "cuda_emu.h"

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace hlm::emu {

namespace {

[[noreturn]] void die(const char* fmt, ...) {
  std::va_list ap;
  va_start(ap, fmt);
  std::fprintf(stderr, "cuda_emu: ");
  std::vfprintf(stderr, fmt, ap);
  std::fprintf(stderr, "\n");
  va_end(ap);
  std::fflush(stderr);
  std::abort();
}

thread_local cudaError_t t_last_error = cudaSuccess;

size_t page_size() {
  static const size_t p = size_t(sysconf(_SC_PAGESIZE));
  return p;
}
size_t round_up(size_t x, size_t m) {
  return (x + m - 1) / m * m;
}

// ------------------------------------------------------------------ guarded memory

// `bytes` (rounded up to 256) that end where an inaccessible page begins: an access past the end
// faults. The start is 256-byte aligned, as cudaMalloc's.
struct Guarded {
  char* map = nullptr;
  size_t map_bytes = 0;
  char* ptr = nullptr;
  size_t bytes = 0;
};
Guarded guarded_alloc(size_t bytes) {
  Guarded g;
  g.bytes = round_up(bytes == 0 ? 1 : bytes, 256);
  const size_t body = round_up(g.bytes, page_size());
  g.map_bytes = body + page_size();
  void* m = mmap(nullptr, g.map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return Guarded{};
  g.map = static_cast<char*>(m);
  if (mprotect(g.map + body, page_size(), PROT_NONE) != 0) die("mprotect failed");
  g.ptr = g.map + body - g.bytes;
  return g;
}
void guarded_free(const Guarded& g) {
  if (g.map) munmap(g.map, g.map_bytes);
}

// Device allocations by start address (for cudaFree and the race check's snapshots).
std::mutex g_alloc_mu;
std::map<uintptr_t, Guarded>& allocations() {
  static std::map<uintptr_t, Guarded> m;
  return m;
}

// ------------------------------------------------------------------ fibers

struct Context {
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
};

#if defined(__x86_64__)
// hlm_emu_switch(save, load): saves the callee-saved registers, MXCSR and the x87 control word
// on the current stack, stores the stack pointer at *save, and resumes the context whose stack
// pointer is `load`. A new context starts in hlm_emu_fiber_start, which calls r13(r12).
extern "C" void hlm_emu_switch(void** save, void* load);
extern "C" void hlm_emu_fiber_start();
asm(R"(
  .text
  .globl hlm_emu_switch
  .type hlm_emu_switch, @function
hlm_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  fnstcw (%rsp)
  stmxcsr 8(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  fldcw (%rsp)
  ldmxcsr 8(%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size hlm_emu_switch, .-hlm_emu_switch

  .globl hlm_emu_fiber_start
  .type hlm_emu_fiber_start, @function
hlm_emu_fiber_start:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size hlm_emu_fiber_start, .-hlm_emu_fiber_start
)");

void switch_context(Context& from, Context& to) {
  hlm_emu_switch(&from.sp, to.sp);
}
void make_context(Context& c, char* stack, size_t bytes, void (*fn)(void*), void* arg) {
  // From the saved stack pointer up: x87 control word (8 bytes), MXCSR (8), r15, r14, r13, r12,
  // rbx, rbp, the return address; the top is 16-byte aligned, so hlm_emu_fiber_start runs with
  // an aligned stack and its call enters fn as the ABI requires.
  const uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + bytes) & ~uintptr_t(15);
  auto* sp = reinterpret_cast<uint64_t*>(top - 72);
  std::memset(sp, 0, 72);
  uint16_t cw;
  uint32_t mxcsr;
  asm volatile("fnstcw %0" : "=m"(cw));
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  std::memcpy(sp, &cw, sizeof cw);
  std::memcpy(sp + 1, &mxcsr, sizeof mxcsr);
  sp[4] = reinterpret_cast<uint64_t>(fn);   // r13
  sp[5] = reinterpret_cast<uint64_t>(arg);  // r12
  sp[8] = reinterpret_cast<uint64_t>(&hlm_emu_fiber_start);
  c.sp = sp;
}
#else
void switch_context(Context& from, Context& to) {
  swapcontext(&from.uc, &to.uc);
}
void fiber_trampoline(unsigned fn_hi, unsigned fn_lo, unsigned arg_hi, unsigned arg_lo) {
  auto fn = reinterpret_cast<void (*)(void*)>((uintptr_t(fn_hi) << 32) | fn_lo);
  fn(reinterpret_cast<void*>((uintptr_t(arg_hi) << 32) | arg_lo));
}
void make_context(Context& c, char* stack, size_t bytes, void (*fn)(void*), void* arg) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  const auto f = reinterpret_cast<uintptr_t>(fn), a = reinterpret_cast<uintptr_t>(arg);
  makecontext(&c.uc, reinterpret_cast<void (*)()>(&fiber_trampoline), 4, unsigned(f >> 32),
              unsigned(f), unsigned(a >> 32), unsigned(a));
}
#endif

// Fiber stacks, kept for reuse: 256 KiB each with a guard page below (a stack overflow faults).
constexpr size_t kStackBytes = 256 * 1024;
struct Stack {
  char* map = nullptr;
  char* lo = nullptr;
};
thread_local std::vector<Stack> t_stacks;
char* stack_for(size_t i) {
  while (t_stacks.size() <= i) {
    const size_t bytes = kStackBytes + page_size();
    void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) die("cannot map a fiber stack");
    if (mprotect(m, page_size(), PROT_NONE) != 0) die("mprotect failed");
    t_stacks.push_back({static_cast<char*>(m), static_cast<char*>(m) + page_size()});
  }
  return t_stacks[i].lo;
}

// ------------------------------------------------------------------ the block scheduler

enum class State : uint8_t { runnable, barrier, collective, wgroup, done };
enum class Kind : uint8_t {
  sync,
  shfl,
  ballot,
  mma,
  mma_bf16,
  ldmatrix,
  wgmma,
  wg_commit,
  wg_wait
};
const char* kind_name(Kind k) {
  switch (k) {
    case Kind::sync:
      return "__syncwarp";
    case Kind::shfl:
      return "__shfl*_sync";
    case Kind::ballot:
      return "__ballot_sync / __any_sync / __all_sync";
    case Kind::mma:
      return "mma.sync (tf32)";
    case Kind::mma_bf16:
      return "mma.sync (bf16)";
    case Kind::ldmatrix:
      return "ldmatrix";
    case Kind::wgmma:
      return "wgmma.mma_async";
    case Kind::wg_commit:
      return "wgmma.commit_group";
    case Kind::wg_wait:
      return "wgmma.wait_group";
  }
  return "?";
}

// The arguments of one wgmma.mma_async as a thread issues it.
struct WgmmaArgs {
  WgmmaType type;
  int n;
  float* d;
  uint64_t desc_a, desc_b;
  const uint32_t* a;  // nullptr: A from desc_a
  bool accumulate;
  int scale_a, scale_b, trans_a, trans_b;
  bool same_op(const WgmmaArgs& o) const {
    return type == o.type && n == o.n && desc_a == o.desc_a && desc_b == o.desc_b &&
           (a == nullptr) == (o.a == nullptr) && accumulate == o.accumulate &&
           scale_a == o.scale_a && scale_b == o.scale_b && trans_a == o.trans_a &&
           trans_b == o.trans_b;
  }
};

// One wgmma of a warpgroup, issued and not yet retired: the A registers as they were at the
// issue, the accumulator registers of its 128 threads.
struct WgmmaOp {
  WgmmaArgs args{};
  uint32_t a[128][4] = {};
  float* d[128] = {};
};

struct WarpGroup {
  int arrived = 0;                // threads waiting at a warpgroup collective
  std::vector<WgmmaOp> ops;       // issued, not retired (the oldest first)
  std::vector<size_t> group_end;  // the end (in ops) of each committed group
};

// An emulated CUtensorMap (cuTensorMapEncodeTiled below writes it into the 128 opaque bytes).
struct TensorMap {
  uint64_t magic;
  uint64_t base;
  uint64_t dim[5];
  uint64_t stride[5];  // bytes; stride[0] is the element size
  uint32_t box[5];
  uint32_t rank, elem_bytes, swizzle_span;  // swizzle_span: 0 (none), 32, 64 or 128 bytes
};
static_assert(sizeof(TensorMap) <= sizeof(CUtensorMap), "the emulated map must fit a CUtensorMap");
constexpr uint64_t kTensorMapMagic = 0x50414d544d4c4831ull;

struct TmaLoad {
  void* dst;
  TensorMap map;
  int32_t c[5];
  uint64_t* bar;
};
struct BulkStore {
  TensorMap map;
  int32_t c[5];
  const void* src;
};

struct Copy {
  void* dst;
  const void* src;
  int bytes;
};

struct Lane {
  Context ctx;
  uint3 tid;
  int index = 0;  // linear thread index in the block
  State state = State::runnable;
  // warp collective in progress
  Kind kind = Kind::sync;
  unsigned mask = 0;
  uint64_t value = 0, result = 0;
  int arg = 0, width = 32;
  Shfl mode = Shfl::idx;
  const uint32_t* a = nullptr;
  const uint32_t* b = nullptr;
  float* d = nullptr;
  // ldmatrix: this lane's row address, whether transposed, and its four result registers
  const void* row = nullptr;
  bool trans = false;
  uint32_t* frag = nullptr;
  // cp.async: copies not yet performed, and the end (in `copies`) of each committed group
  std::vector<Copy> copies;
  std::vector<size_t> group_end;
  // wgmma in progress (a warpgroup collective): its arguments; wgmma.wait_group: the count
  const WgmmaArgs* wg = nullptr;
  // cp.async.bulk tensor stores not yet performed, and the end of each committed bulk group
  std::vector<BulkStore> stores;
  std::vector<size_t> store_group_end;
};

struct Block {
  std::vector<Lane> lanes;
  int live = 0;              // lanes not done
  int at_barrier = 0;        // lanes waiting at the barrier
  int barrier_count = 0;     // sum of their predicates
  int barrier_result = 0;    // the count of the last released barrier
  std::vector<int> arrived;  // lanes waiting at a collective, per warp
  std::vector<int> exited;   // lanes done, per warp
  std::vector<int> queue;    // runnable lanes not running: a ring of lanes.size() slots
  size_t head = 0, count = 0;
  bool reverse = false;  // lanes enter the queue in reverse index order
  void (*body)(void*) = nullptr;
  void* ctx = nullptr;
  char* smem = nullptr;
  size_t smem_bytes = 0;
  std::vector<WarpGroup> wgs;  // per 128 threads
  std::vector<TmaLoad> tma;    // tensor loads issued, not yet performed
  int poll_misses = 0;         // mbarrier polls that failed since anything last changed
};

thread_local Block* t_block = nullptr;
thread_local Lane* t_lane = nullptr;
thread_local Context t_scheduler;

void enqueue(Block& b, Lane& l) {
  l.state = State::runnable;
  b.queue[(b.head + b.count++) % b.queue.size()] = l.index;
}

// Leaves the running lane (its context saved in `from`) for the next runnable lane, or for the
// scheduler when none is runnable (all done, or a deadlock).
void switch_away(Context& from) {
  Block& b = *t_block;
  if (b.count == 0) {
    switch_context(from, t_scheduler);
    return;
  }
  Lane& next = b.lanes[size_t(b.queue[b.head])];
  b.head = (b.head + 1) % b.queue.size();
  --b.count;
  t_lane = &next;
  t_thread_idx = next.tid;
  switch_context(from, next.ctx);
}

void yield() {
  switch_away(t_lane->ctx);
}

void perform_copies(Lane& l, size_t upto) {
  for (size_t i = 0; i < upto; ++i)
    std::memcpy(l.copies[i].dst, l.copies[i].src, l.copies[i].bytes);
  l.copies.erase(l.copies.begin(), l.copies.begin() + std::ptrdiff_t(upto));
  for (size_t& e : l.group_end) e -= upto;
}

// Every lane of L[0..n) waiting in state `waiting` enters the run queue (in the block's order),
// but the running lane (the last to arrive), which goes on. For a warp collective (L a warp,
// n <= 32) only the lanes of `mask`: lanes of a disjoint mask may wait at another one.
void wake(Block& b, Lane* L, int n, State waiting, unsigned mask = 0xffffffffu) {
  for (int j = 0; j < n; ++j) {
    const int i = b.reverse ? n - 1 - j : j;
    Lane& l = L[i];
    if (l.state != waiting || (i < 32 && !((mask >> i) & 1u))) continue;
    if (&l == t_lane)
      l.state = State::runnable;
    else
      enqueue(b, l);
  }
}

// Releases the barrier (from its last arrival, or from a lane's exit: then the running lane is
// done and not among the waiting).
void release_barrier(Block& b) {
  b.poll_misses = 0;
  b.barrier_result = b.barrier_count;
  b.barrier_count = 0;
  b.at_barrier = 0;
  wake(b, b.lanes.data(), int(b.lanes.size()), State::barrier);
}

float tf32(uint32_t bits) {
  return __uint_as_float(bits & 0xffffe000u);
}

// The accumulators C [16][8] of an m16n8 mma from the lanes' d registers (c0 (g, 2t),
// c1 (g, 2t + 1), c2 (g + 8, 2t), c3 (g + 8, 2t + 1)); D = A B + C with A [16][K], B [K][8]
// summed in FP64 (C first, k in order) and rounded once, back into the d registers.
template <int K>
void mma_finish(Lane* L, const float (&A)[16][K], const float (&B)[K][8]) {
  double S[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    S[g][2 * t] = L[l].d[0];
    S[g][2 * t + 1] = L[l].d[1];
    S[g + 8][2 * t] = L[l].d[2];
    S[g + 8][2 * t + 1] = L[l].d[3];
  }
  // The loop over j inside, so that it vectorises.
  for (int i = 0; i < 16; ++i)
    for (int k = 0; k < K; ++k)
      for (int j = 0; j < 8; ++j) S[i][j] += double(A[i][k]) * double(B[k][j]);
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    L[l].d[0] = float(S[g][2 * t]);
    L[l].d[1] = float(S[g][2 * t + 1]);
    L[l].d[2] = float(S[g + 8][2 * t]);
    L[l].d[3] = float(S[g + 8][2 * t + 1]);
  }
}

// Completes the collective of the lanes `mask` of warp w (each of them waits at it).
void complete_collective(Block& b, int w, unsigned mask) {
  b.poll_misses = 0;
  Lane* L = &b.lanes[size_t(w) * 32];
  const int n = std::min(32, int(b.lanes.size()) - 32 * w);
  const Lane* first = t_lane;
  for (int i = 0; i < n; ++i) {
    if (!((mask >> i) & 1u)) continue;
    if (L[i].kind != first->kind || L[i].mask != mask)
      die("warp %d of block (%u,%u,%u): lanes %d and %d meet at different warp collectives (%s, "
          "mask %08x; %s, mask %08x)",
          w, t_block_idx.x, t_block_idx.y, t_block_idx.z, first->index % 32, i,
          kind_name(first->kind), mask, kind_name(L[i].kind), L[i].mask);
  }
  switch (first->kind) {
    case Kind::sync:
      break;
    case Kind::ballot: {
      unsigned bits = 0;
      for (int i = 0; i < n; ++i)
        if ((mask >> i) & 1u) bits |= (L[i].value ? 1u : 0u) << i;
      for (int i = 0; i < n; ++i)
        if ((mask >> i) & 1u) L[i].result = bits;
      break;
    }
    case Kind::shfl: {
      uint64_t res[32];
      for (int i = 0; i < n; ++i) {
        if (!((mask >> i) & 1u)) continue;
        const int width = L[i].width, base = i & ~(width - 1), arg = L[i].arg;
        int src = i;
        switch (L[i].mode) {
          case Shfl::idx:
            src = base + (arg & (width - 1));
            break;
          case Shfl::up:
            src = i - arg >= base ? i - arg : i;
            break;
          case Shfl::down:
            src = i + arg < base + width ? i + arg : i;
            break;
          case Shfl::bfly:
            src = (i ^ arg) < base + width ? i ^ arg : i;
            break;
        }
        if (src >= n || !((mask >> src) & 1u))
          die("warp %d: lane %d shuffles from lane %d, which is not in the mask %08x", w, i, src,
              mask);
        res[i] = L[src].value;
      }
      for (int i = 0; i < n; ++i)
        if ((mask >> i) & 1u) L[i].result = res[i];
      break;
    }
    case Kind::mma: {
      if (mask != 0xffffffffu || n != 32) die("warp %d: mma.sync needs all 32 lanes", w);
      // Fragments (PTX ISA, mma.m16n8k8 .tf32): lane = 4 g + t;
      //   A (16 x 8): a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4)
      //   B (8 x 8):  b0 (t, g), b1 (t + 4, g)
      //   C, D (16 x 8): c0 (g, 2t), c1 (g, 2t + 1), c2 (g + 8, 2t), c3 (g + 8, 2t + 1)
      float A[16][8], B[8][8];
      for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, t = l & 3;
        A[g][t] = tf32(L[l].a[0]);
        A[g + 8][t] = tf32(L[l].a[1]);
        A[g][t + 4] = tf32(L[l].a[2]);
        A[g + 8][t + 4] = tf32(L[l].a[3]);
        B[t][g] = tf32(L[l].b[0]);
        B[t + 4][g] = tf32(L[l].b[1]);
      }
      mma_finish(L, A, B);
      break;
    }
    case Kind::mma_bf16: {
      if (mask != 0xffffffffu || n != 32) die("warp %d: mma.sync needs all 32 lanes", w);
      // Fragments (PTX ISA, mma.m16n8k16 .bf16): lane = 4 g + t, two bf16 per register, the
      // lower column (A) or row (B) in the low half;
      //   A (16 x 16): a0 (g, 2t..2t+1), a1 (g + 8, 2t..), a2 (g, 2t+8..), a3 (g + 8, 2t+8..)
      //   B (16 x 8):  b0 (2t..2t+1, g), b1 (2t+8..2t+9, g)
      //   C, D (16 x 8) as for m16n8k8.
      float A[16][16], B[16][8];
      const auto lo = [](uint32_t r) { return __uint_as_float(r << 16); };
      const auto hi = [](uint32_t r) { return __uint_as_float(r & 0xffff0000u); };
      for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, t = l & 3;
        for (int r = 0; r < 4; ++r) {
          const int row = g + 8 * (r & 1), col = 2 * t + 8 * (r >> 1);
          A[row][col] = lo(L[l].a[r]);
          A[row][col + 1] = hi(L[l].a[r]);
        }
        for (int r = 0; r < 2; ++r) {
          B[2 * t + 8 * r][g] = lo(L[l].b[r]);
          B[2 * t + 8 * r + 1][g] = hi(L[l].b[r]);
        }
      }
      mma_finish(L, A, B);
      break;
    }
    case Kind::ldmatrix: {
      if (mask != 0xffffffffu || n != 32) die("warp %d: ldmatrix needs all 32 lanes", w);
      // .m8n8.x4.b16: lanes 8 i .. 8 i + 7 give the rows (16 bytes each) of matrix i; register
      // i of lane 4 g + t receives row g, elements 2t and 2t + 1 of matrix i (.trans: its
      // transpose, elements (2t, g) and (2t + 1, g)).
      uint16_t M[4][8][8];
      for (int l = 0; l < 32; ++l) {
        const uintptr_t a = reinterpret_cast<uintptr_t>(L[l].row);
        if (a % 16 != 0)
          die("warp %d: ldmatrix row address %p of lane %d is not 16-byte aligned", w, L[l].row, l);
        std::memcpy(M[l >> 3][l & 7], L[l].row, 16);
      }
      const bool tr = L[0].trans;
      for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, t = l & 3;
        for (int i = 0; i < 4; ++i) {
          const uint16_t e0 = tr ? M[i][2 * t][g] : M[i][g][2 * t];
          const uint16_t e1 = tr ? M[i][2 * t + 1][g] : M[i][g][2 * t + 1];
          L[l].frag[i] = uint32_t(e0) | (uint32_t(e1) << 16);
        }
      }
      break;
    }
    case Kind::wgmma:
    case Kind::wg_commit:
    case Kind::wg_wait:
      die("warp %d: a warpgroup instruction met a warp collective", w);
  }
  wake(b, L, n, State::collective, mask);
  if (mask == 0xffffffffu) b.arrived[size_t(w)] = 0;
}

// The calling lane waits at a warp collective described by its fields; the last lane of the
// mask to arrive completes it for all. Lanes of disjoint masks may meet at collectives of their
// own at the same time (two half-warp reductions, say); lanes named in one mask that wait at
// another collective abort the run.
void collective() {
  Block& b = *t_block;
  Lane& me = *t_lane;
  const int w = me.index / 32, n = std::min(32, int(b.lanes.size()) - 32 * w);
  Lane* L = &b.lanes[size_t(w) * 32];
  if (!((me.mask >> (me.index % 32)) & 1u))
    die("lane %d of warp %d calls %s with mask %08x, which leaves it out", me.index % 32, w,
        kind_name(me.kind), me.mask);
  me.state = State::collective;
  if (b.exited[size_t(w)] > 0)
    for (int i = 0; i < n; ++i)
      if (((me.mask >> i) & 1u) && L[i].state == State::done)
        die("warp %d: %s with mask %08x names lane %d, which has exited", w, kind_name(me.kind),
            me.mask, i);
  if (me.mask == 0xffffffffu) {  // the common case: a count, no scan
    if (++b.arrived[size_t(w)] == 32)
      complete_collective(b, w, me.mask);
    else
      yield();
    return;
  }
  for (int i = 0; i < n; ++i)
    if (((me.mask >> i) & 1u) && L[i].state != State::collective) {
      yield();
      return;
    }
  complete_collective(b, w, me.mask);
}

void perform_stores(Lane& l, size_t upto);

void finish_lane(Lane& l) {
  perform_copies(l, l.copies.size());
  l.group_end.clear();
  perform_stores(l, l.stores.size());
  l.store_group_end.clear();
  l.state = State::done;
  Block& b = *t_block;
  --b.live;
  ++b.exited[size_t(l.index / 32)];
  if (b.at_barrier > 0 && b.at_barrier == b.live) release_barrier(b);
}

void lane_main(void* arg) {
  Lane* l = static_cast<Lane*>(arg);
  t_block->body(t_block->ctx);
  finish_lane(*l);
  switch_away(l->ctx);
  die("a finished thread was resumed");
}

[[noreturn]] void deadlock(const Block& b) {
  std::string s;
  for (const Lane& l : b.lanes) {
    if (l.state == State::done) continue;
    char buf[160];
    std::snprintf(buf, sizeof buf, "\n  thread (%u,%u,%u) warp %d lane %d: %s", l.tid.x, l.tid.y,
                  l.tid.z, l.index / 32, l.index % 32,
                  l.state == State::barrier    ? "at __syncthreads"
                  : l.state == State::runnable ? "polling an mbarrier"
                                               : kind_name(l.kind));
    s += buf;
    if (s.size() > 4000) {
      s += "\n  ...";
      break;
    }
  }
  die("block (%u,%u,%u) cannot proceed: %d threads wait, %d of them at the barrier, and no "
      "barrier or collective can complete:%s",
      t_block_idx.x, t_block_idx.y, t_block_idx.z, b.live, b.at_barrier, s.c_str());
}

void run_block(Block& b, bool reverse) {
  const int n = int(b.lanes.size());
  b.live = n;
  b.at_barrier = b.barrier_count = b.barrier_result = 0;
  std::fill(b.arrived.begin(), b.arrived.end(), 0);
  std::fill(b.exited.begin(), b.exited.end(), 0);
  b.queue.assign(size_t(n), 0);
  b.head = b.count = 0;
  b.reverse = reverse;
  for (WarpGroup& g : b.wgs) g = WarpGroup{};
  b.tma.clear();
  b.poll_misses = 0;
  for (int j = 0; j < n; ++j) {
    Lane& l = b.lanes[size_t(reverse ? n - 1 - j : j)];
    l.copies.clear();
    l.group_end.clear();
    make_context(l.ctx, stack_for(size_t(l.index)), kStackBytes, &lane_main, &l);
    enqueue(b, l);
  }
  // The lanes pass control among themselves; it comes back here when none is runnable.
  switch_away(t_scheduler);
  if (b.live > 0) deadlock(b);
  for (size_t g = 0; g < b.wgs.size(); ++g)
    if (!b.wgs[g].ops.empty())
      die("block (%u,%u,%u): warpgroup %zu ended with %zu wgmma not retired by wgmma.wait_group",
          t_block_idx.x, t_block_idx.y, t_block_idx.z, g, b.wgs[g].ops.size());
  t_lane = nullptr;
}

bool env_flag(const char* name) {
  const char* e = std::getenv(name);
  return e && *e && std::strcmp(e, "0") != 0;
}

void run_grid(const LaunchConfig& cfg, void (*body)(void*), void* ctx, bool reverse,
              const Guarded& smem) {
  const int nt = int(cfg.block.x * cfg.block.y * cfg.block.z);
  Block b;
  b.lanes.resize(size_t(nt));
  b.arrived.assign(size_t((nt + 31) / 32), 0);
  b.exited.assign(size_t((nt + 31) / 32), 0);
  for (int i = 0; i < nt; ++i) {
    Lane& l = b.lanes[size_t(i)];
    l.index = i;
    l.tid = uint3{unsigned(i) % cfg.block.x, (unsigned(i) / cfg.block.x) % cfg.block.y,
                  unsigned(i) / (cfg.block.x * cfg.block.y)};
  }
  b.body = body;
  b.ctx = ctx;
  b.smem = smem.ptr;
  b.smem_bytes = smem.bytes;
  b.wgs.resize(size_t((nt + 127) / 128));
  Block* outer_block = t_block;
  t_block = &b;
  t_block_dim = uint3{cfg.block.x, cfg.block.y, cfg.block.z};
  t_grid_dim = uint3{cfg.grid.x, cfg.grid.y, cfg.grid.z};
  const uint64_t nb = uint64_t(cfg.grid.x) * cfg.grid.y * cfg.grid.z;
  for (uint64_t j = 0; j < nb; ++j) {
    const uint64_t i = reverse ? nb - 1 - j : j;
    t_block_idx = uint3{unsigned(i % cfg.grid.x), unsigned((i / cfg.grid.x) % cfg.grid.y),
                        unsigned(i / (uint64_t(cfg.grid.x) * cfg.grid.y))};
    if (smem.ptr) std::memset(smem.ptr, 0xff, smem.bytes);
    run_block(b, reverse);
  }
  t_block = outer_block;
}

}  // namespace

// ------------------------------------------------------------------ device-side entry points

void* dynamic_smem() {
  return t_block->smem;
}

int syncthreads_count(int pred) {
  Block& b = *t_block;
  Lane& me = *t_lane;
  me.state = State::barrier;
  b.barrier_count += pred != 0;
  if (++b.at_barrier == b.live)
    release_barrier(b);
  else
    yield();
  return b.barrier_result;
}

void syncwarp(unsigned mask) {
  t_lane->kind = Kind::sync;
  t_lane->mask = mask;
  collective();
}

uint64_t shfl(unsigned mask, uint64_t value, Shfl mode, int arg, int width) {
  if (width < 1 || width > 32 || (width & (width - 1)) != 0)
    die("a shuffle's width must be a power of two in [1, 32], got %d", width);
  Lane& me = *t_lane;
  me.kind = Kind::shfl;
  me.mask = mask;
  me.value = value;
  me.mode = mode;
  me.arg = arg;
  me.width = width;
  collective();
  return me.result;
}

unsigned ballot(unsigned mask, int pred) {
  Lane& me = *t_lane;
  me.kind = Kind::ballot;
  me.mask = mask;
  me.value = pred != 0;
  collective();
  return unsigned(me.result);
}

void mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  Lane& me = *t_lane;
  me.kind = Kind::mma;
  me.mask = 0xffffffffu;
  me.a = a;
  me.b = b;
  me.d = d;
  collective();
}

void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  Lane& me = *t_lane;
  me.kind = Kind::mma_bf16;
  me.mask = 0xffffffffu;
  me.a = a;
  me.b = b;
  me.d = d;
  collective();
}

void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans) {
  Lane& me = *t_lane;
  me.kind = Kind::ldmatrix;
  me.mask = 0xffffffffu;
  me.row = row;
  me.trans = trans;
  me.frag = r;
  collective();
}

void cp_async(void* dst, const void* src, int bytes) {
  const uintptr_t s = reinterpret_cast<uintptr_t>(src), dd = reinterpret_cast<uintptr_t>(dst);
  if (s % unsigned(bytes) != 0 || dd % unsigned(bytes) != 0)
    die("cp.async of %d bytes from %p to %p: both addresses must be %d-byte aligned", bytes, src,
        dst, bytes);
  t_lane->copies.push_back({dst, src, bytes});
}

void cp_async_commit() {
  t_lane->group_end.push_back(t_lane->copies.size());
}

void cp_async_wait(int pending_groups) {
  Lane& l = *t_lane;
  const int groups = int(l.group_end.size());
  if (groups <= pending_groups) return;
  const size_t upto = l.group_end[size_t(groups - pending_groups - 1)];
  l.group_end.erase(l.group_end.begin(), l.group_end.begin() + (groups - pending_groups));
  perform_copies(l, upto);
}

// ------------------------------------------------------------------ Hopper: wgmma, mbarrier, TMA

namespace {

// The shared window: addresses count from the 1024-byte boundary at or below the dynamic shared
// memory's start, so that an address and its generic pointer agree modulo 1024.
uintptr_t smem_window(const Block& b) {
  return reinterpret_cast<uintptr_t>(b.smem) & ~uintptr_t(1023);
}

// The 16-byte chunk swizzles of wgmma and TMA (span 32, 64 or 128 bytes; 0: none): bits 4..6 of
// a shared address XOR bits 7..9, as many bits as the span has 16-byte chunks past the first.
uint32_t swizzle(uint32_t a, uint32_t span) {
  const uint32_t bits = span == 128 ? 7u : span == 64 ? 3u : span == 32 ? 1u : 0u;
  return a ^ (((a >> 7) & bits) << 4);
}

// The shared address of element (mn, k) of a wgmma operand (mn: the row of A or the column of B;
// K elements of esz bytes each) under its descriptor, in the canonical layouts of the PTX ISA
// ("Shared memory matrix layout"; core matrices of 8 rows x 16 bytes):
//   K-major (the K elements of a row contiguous):
//     no swizzle: row mn % 8 of a core matrix at 16 bytes, core matrices along M/N at SBO,
//                 along K at LBO;
//     swizzle of span S (32, 64, 128): 8 rows of S bytes per atom, atoms along M/N at SBO,
//                 the K bytes contiguous from the start (LBO unused);
//   M/N-major (transposed: the M/N elements of a k contiguous):
//     no swizzle: core matrix rows are k % 8 (16 bytes of 8 M/N elements), core matrices along
//                 K at LBO, along M/N at SBO;
//     swizzle of span S: 8 k-rows of S bytes per atom, atoms along K at SBO, along M/N at LBO.
// Then the swizzle of the descriptor's mode on the address.
uint32_t operand_address(uint64_t desc, int mn, int k, int esz, bool mn_major) {
  const uint32_t start = uint32_t(desc & 0x3fff) << 4;
  const uint32_t lbo = uint32_t((desc >> 16) & 0x3fff) << 4;
  const uint32_t sbo = uint32_t((desc >> 32) & 0x3fff) << 4;
  const uint32_t mode = uint32_t(desc >> 62);
  const uint32_t span = mode == 1 ? 128 : mode == 2 ? 64 : mode == 3 ? 32 : 0;
  uint32_t a;
  if (!mn_major) {
    const uint32_t kb = uint32_t(k * esz), r = uint32_t(mn);
    a = span == 0 ? start + (r % 8) * 16 + (r / 8) * sbo + (kb / 16) * lbo + kb % 16
                  : start + (r % 8) * span + (r / 8) * sbo + kb;
  } else {
    const uint32_t mb = uint32_t(mn * esz), r = uint32_t(k);
    a = span == 0 ? start + (r % 8) * 16 + (r / 8) * lbo + (mb / 16) * sbo + mb % 16
                  : start + (r % 8) * span + (r / 8) * sbo + (mb / span) * lbo + mb % span;
  }
  return swizzle(a, span);
}

float operand_value(const Block& b, uint32_t address, WgmmaType type) {
  if (type == WgmmaType::bf16) {
    uint16_t h;
    std::memcpy(&h, smem_pointer(address, 2), 2);
    return __uint_as_float(uint32_t(h) << 16);
  }
  uint32_t u;
  std::memcpy(&u, smem_pointer(address, 4), 4);
  (void)b;
  return __uint_as_float(u & 0xffffe000u);  // TF32: the low 13 bits are ignored
}

// D = A B (+ D): A [64][K] from the descriptor or the issue's registers, B [K][N] from its
// descriptor, products and the accumulator summed in FP64 and rounded once.
void run_wgmma(const Block& b, const WgmmaOp& op) {
  const WgmmaArgs& w = op.args;
  const bool bf = w.type == WgmmaType::bf16;
  const int K = bf ? 16 : 8, esz = bf ? 2 : 4, N = w.n;
  std::vector<double> A(size_t(64) * K), B(size_t(K) * N);
  if (w.a) {
    // Registers: warp j of the warpgroup holds rows 16 j .. 16 j + 15 in mma.sync's A fragment
    // (lane = 4 g + t): bf16 a_r = (g + 8 (r % 2), 2 t + 8 (r / 2) .. + 1), two per register;
    // tf32 a_r = (g + 8 (r % 2), t + 4 (r / 2)).
    for (int i = 0; i < 128; ++i) {
      const int row0 = 16 * (i / 32) + ((i % 32) >> 2), t = i & 3;
      for (int r = 0; r < 4; ++r) {
        const int row = row0 + 8 * (r & 1);
        const uint32_t v = op.a[i][r];
        if (bf) {
          const int col = 2 * t + 8 * (r >> 1);
          A[size_t(row) * K + col] = __uint_as_float(v << 16);
          A[size_t(row) * K + col + 1] = __uint_as_float(v & 0xffff0000u);
        } else {
          A[size_t(row) * K + t + 4 * (r >> 1)] = __uint_as_float(v & 0xffffe000u);
        }
      }
    }
  } else {
    for (int m = 0; m < 64; ++m)
      for (int k = 0; k < K; ++k)
        A[size_t(m) * K + k] =
            operand_value(b, operand_address(w.desc_a, m, k, esz, w.trans_a != 0), w.type);
  }
  for (int n = 0; n < N; ++n)
    for (int k = 0; k < K; ++k)
      B[size_t(k) * N + n] =
          operand_value(b, operand_address(w.desc_b, n, k, esz, w.trans_b != 0), w.type);
  // Accumulators (PTX ISA, wgmma D fragment): warp j, lane 4 g + t, register 4 c + e holds
  // row 16 j + g + 8 (e / 2), column 8 c + 2 t + e % 2.
  std::vector<double> D(size_t(64) * N, 0.0);
  if (w.accumulate)
    for (int i = 0; i < 128; ++i) {
      const int row0 = 16 * (i / 32) + ((i % 32) >> 2), t = i & 3;
      for (int r = 0; r < N / 2; ++r)
        D[size_t(row0 + 8 * ((r >> 1) & 1)) * N + 8 * (r >> 2) + 2 * t + (r & 1)] = op.d[i][r];
    }
  const double sa = w.scale_a, sb = w.scale_b;
  for (int m = 0; m < 64; ++m)
    for (int k = 0; k < K; ++k) {
      const double a = sa * A[size_t(m) * K + k];
      for (int n = 0; n < N; ++n) D[size_t(m) * N + n] += a * (sb * B[size_t(k) * N + n]);
    }
  for (int i = 0; i < 128; ++i) {
    const int row0 = 16 * (i / 32) + ((i % 32) >> 2), t = i & 3;
    for (int r = 0; r < N / 2; ++r)
      op.d[i][r] = float(D[size_t(row0 + 8 * ((r >> 1) & 1)) * N + 8 * (r >> 2) + 2 * t + (r & 1)]);
  }
}

// Completes the warpgroup collective of warpgroup g (each of its 128 threads waits at it).
void complete_wg(Block& b, int g) {
  b.poll_misses = 0;
  Lane* L = &b.lanes[size_t(g) * 128];
  WarpGroup& wg = b.wgs[size_t(g)];
  const Lane& first = *t_lane;
  for (int i = 0; i < 128; ++i) {
    const bool same =
        L[i].kind == first.kind &&
        (first.kind != Kind::wgmma ? L[i].arg == first.arg : L[i].wg->same_op(*first.wg));
    if (!same)
      die("warpgroup %d of block (%u,%u,%u): threads %d and %d meet at different warpgroup "
          "instructions (%s, %s) or with different operands",
          g, t_block_idx.x, t_block_idx.y, t_block_idx.z, first.index, L[i].index,
          kind_name(first.kind), kind_name(L[i].kind));
  }
  switch (first.kind) {
    case Kind::wgmma: {
      WgmmaOp op;
      op.args = *first.wg;
      for (int i = 0; i < 128; ++i) {
        op.d[i] = L[i].wg->d;
        if (op.args.a)
          for (int r = 0; r < 4; ++r) op.a[i][r] = L[i].wg->a[r];
      }
      op.args.d = nullptr;
      op.args.a = op.args.a ? op.a[0] : nullptr;  // a marker only: the values are in op.a
      wg.ops.push_back(op);
      break;
    }
    case Kind::wg_commit:
      wg.group_end.push_back(wg.ops.size());
      break;
    case Kind::wg_wait: {
      const int groups = int(wg.group_end.size()), keep = first.arg;
      if (groups > keep) {
        const size_t upto = wg.group_end[size_t(groups - keep - 1)];
        for (size_t i = 0; i < upto; ++i) run_wgmma(b, wg.ops[i]);
        wg.ops.erase(wg.ops.begin(), wg.ops.begin() + std::ptrdiff_t(upto));
        wg.group_end.erase(wg.group_end.begin(), wg.group_end.begin() + (groups - keep));
        for (size_t& e : wg.group_end) e -= upto;
      }
      break;
    }
    default:
      die("not a warpgroup instruction");
  }
  for (int j = 0; j < 128; ++j) {
    const int i = b.reverse ? 127 - j : j;
    if (L[i].state != State::wgroup) continue;
    if (&L[i] == t_lane)
      L[i].state = State::runnable;
    else
      enqueue(b, L[i]);
  }
  wg.arrived = 0;
}

// The calling thread waits at a warpgroup collective (its kind and arguments set); the last of
// the 128 to arrive completes it.
void wg_collective() {
  Block& b = *t_block;
  Lane& me = *t_lane;
  const int g = me.index / 128;
  if (128 * (g + 1) > int(b.lanes.size()))
    die("%s: the block's %zu threads leave warpgroup %d with fewer than 128", kind_name(me.kind),
        b.lanes.size(), g);
  for (int w = 4 * g; w < 4 * g + 4; ++w)
    if (b.exited[size_t(w)] > 0)
      die("%s: a thread of warpgroup %d has exited", kind_name(me.kind), g);
  me.state = State::wgroup;
  if (++b.wgs[size_t(g)].arrived == 128)
    complete_wg(b, g);
  else
    yield();
}

// mbarrier state in its 8 bytes: pending arrivals (bits 0..19), the expected count (20..39), the
// transaction count (40..60, signed), a mark of initialisation (61..62 = 01) and the phase (63).
struct Mbar {
  uint32_t pending, expected;
  int32_t tx;
  uint32_t phase;
};
Mbar mbar_load(const uint64_t* bar) {
  const uint64_t v = *bar;
  if (((v >> 61) & 3) != 1)
    die("mbarrier at %p used before mbarrier.init", static_cast<const void*>(bar));
  Mbar m;
  m.pending = uint32_t(v & 0xfffff);
  m.expected = uint32_t((v >> 20) & 0xfffff);
  const uint32_t tx = uint32_t((v >> 40) & 0x1fffff);
  m.tx = int32_t(tx << 11) >> 11;
  m.phase = uint32_t(v >> 63);
  return m;
}
void mbar_store(uint64_t* bar, const Mbar& m) {
  if (m.tx > 0xfffff || m.tx < -0xfffff)
    die("mbarrier at %p: transaction count %d outside [-(2^20 - 1), 2^20 - 1]",
        static_cast<void*>(bar), m.tx);
  *bar = uint64_t(m.pending) | (uint64_t(m.expected) << 20) |
         (uint64_t(uint32_t(m.tx) & 0x1fffff) << 40) | (uint64_t(1) << 61) |
         (uint64_t(m.phase) << 63);
}
// The phase completes when every expected arrival has come and the transactions are done.
void mbar_advance(Mbar& m) {
  if (m.pending == 0 && m.tx == 0) {
    m.phase ^= 1;
    m.pending = m.expected;
  }
}

// The byte offset in global memory of box element `e` (dims innermost first) of a map at coords
// c, or -1 when it lies outside the tensor.
// A store's innermost extent counts whole 16-byte units: an H100 writes the elements past the
// tensor's last one up to its 16-byte boundary (measured 2026-12-07: a bf16 tensor 100 wide, with
// rows of 112, got elements 100 to 103 written), while a load reads them as zeros.
int64_t global_offset(const TensorMap& m, const int32_t* c, const uint32_t* e, bool store) {
  int64_t off = 0;
  for (uint32_t d = 0; d < m.rank; ++d) {
    const int64_t x = int64_t(c[d]) + e[d];
    int64_t extent = int64_t(m.dim[d]);
    if (d == 0 && store) extent = (extent * m.elem_bytes + 15) / 16 * 16 / m.elem_bytes;
    if (x < 0 || x >= extent) return -1;
    off += x * int64_t(m.stride[d]);
  }
  return off;
}

// Visits every element of a box: f(global offset or -1, shared address of the element).
template <class F>
void for_box(const TensorMap& m, const int32_t* c, uint32_t dst, bool store, F&& f) {
  uint32_t e[5] = {0, 0, 0, 0, 0};
  uint64_t n = 1;
  for (uint32_t d = 0; d < m.rank; ++d) n *= m.box[d];
  for (uint64_t i = 0; i < n; ++i) {
    uint64_t r = i;
    for (uint32_t d = 0; d < m.rank; ++d) {
      e[d] = uint32_t(r % m.box[d]);
      r /= m.box[d];
    }
    f(global_offset(m, c, e, store), swizzle(dst + uint32_t(i * m.elem_bytes), m.swizzle_span));
  }
}

const TensorMap& checked_map(const void* map) {
  const auto* m = static_cast<const TensorMap*>(map);
  if (m->magic != kTensorMapMagic)
    die("cp.async.bulk.tensor: %p is not a tensor map from cuTensorMapEncodeTiled", map);
  return *m;
}

void perform_tma(Block& b, const TmaLoad& t) {
  const uint32_t dst = smem_address(t.dst);
  char* g = reinterpret_cast<char*>(t.map.base);
  uint32_t bytes = 0;
  for_box(t.map, t.c, dst, false, [&](int64_t off, uint32_t s) {
    void* p = smem_pointer(s, t.map.elem_bytes);
    if (off < 0)
      std::memset(p, 0,
                  t.map.elem_bytes);  // out of bounds: zeros (CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    else
      std::memcpy(p, g + off, t.map.elem_bytes);
    bytes += t.map.elem_bytes;
  });
  Mbar m = mbar_load(t.bar);
  m.tx -= int32_t(bytes);
  mbar_advance(m);
  mbar_store(t.bar, m);
  b.poll_misses = 0;
}

void perform_stores(Lane& l, size_t upto) {
  for (size_t i = 0; i < upto; ++i) {
    const BulkStore& st = l.stores[i];
    char* g = reinterpret_cast<char*>(st.map.base);
    for_box(st.map, st.c, smem_address(st.src), true, [&](int64_t off, uint32_t s) {
      if (off >= 0) std::memcpy(g + off, smem_pointer(s, st.map.elem_bytes), st.map.elem_bytes);
    });
  }
  l.stores.erase(l.stores.begin(), l.stores.begin() + std::ptrdiff_t(upto));
  for (size_t& e : l.store_group_end) e -= upto;
}

}  // namespace

uint32_t smem_address(const void* p) {
  const Block* b = t_block;
  const auto a = reinterpret_cast<uintptr_t>(p);
  if (!b || !b->smem || a < reinterpret_cast<uintptr_t>(b->smem) ||
      a > reinterpret_cast<uintptr_t>(b->smem) + b->smem_bytes)
    die("%p is not in the block's dynamic shared memory (in the emulation only dynamic shared "
        "memory has a shared-window address: wgmma, TMA and cvta operands must live there)",
        p);
  return uint32_t(a - smem_window(*b));
}

void* smem_pointer(uint32_t address, size_t bytes) {
  const Block& b = *t_block;
  const uintptr_t p = smem_window(b) + address, lo = reinterpret_cast<uintptr_t>(b.smem);
  if (p < lo || p + bytes > lo + b.smem_bytes)
    die("shared address %#x (%zu bytes) lies outside the block's %zu bytes of dynamic shared "
        "memory",
        address, bytes, b.smem_bytes);
  return reinterpret_cast<void*>(p);
}

void wgmma(WgmmaType type, int n, float* d, uint64_t desc_a, const uint32_t* a, uint64_t desc_b,
           bool accumulate, int scale_a, int scale_b, int trans_a, int trans_b) {
  if (n < 8 || n > 256 || n % 8 != 0) die("wgmma: N = %d is not a multiple of 8 in [8, 256]", n);
  if (type == WgmmaType::tf32 && (trans_a || trans_b))
    die("wgmma: tf32 operands are K-major only (no transpose)");
  if ((scale_a != 1 && scale_a != -1) || (scale_b != 1 && scale_b != -1))
    die("wgmma: imm-scale-a / imm-scale-b must be 1 or -1");
  for (uint64_t desc : {desc_a, desc_b})
    if ((desc >> 49) & 7) die("wgmma: a descriptor's base offset (bits 49..51) is not emulated");
  const WgmmaArgs args{type,       n,       d,       a ? 0 : desc_a,  desc_b, a,
                       accumulate, scale_a, scale_b, a ? 0 : trans_a, trans_b};
  Lane& me = *t_lane;
  me.kind = Kind::wgmma;
  me.wg = &args;
  wg_collective();
  me.wg = nullptr;
}

void wgmma_fence() {}

void wgmma_commit() {
  t_lane->kind = Kind::wg_commit;
  t_lane->arg = 0;
  wg_collective();
}

void wgmma_wait(int pending_groups) {
  t_lane->kind = Kind::wg_wait;
  t_lane->arg = pending_groups;
  wg_collective();
}

void mbarrier_init(uint64_t* bar, uint32_t count) {
  if (count < 1 || count > 0xfffff) die("mbarrier.init: count %u outside [1, 2^20 - 1]", count);
  if (reinterpret_cast<uintptr_t>(bar) % 8) die("mbarrier at %p: not 8-byte aligned", bar);
  mbar_store(bar, Mbar{count, count, 0, 0});
  t_block->poll_misses = 0;
}

uint64_t mbarrier_arrive(uint64_t* bar, uint32_t tx_bytes) {
  Mbar m = mbar_load(bar);
  if (m.pending == 0) die("mbarrier at %p: an arrival beyond its expected count", bar);
  const uint64_t token = uint64_t(m.phase) << 63;
  m.tx += int32_t(tx_bytes);
  --m.pending;
  mbar_advance(m);
  mbar_store(bar, m);
  t_block->poll_misses = 0;
  return token;
}

void mbarrier_expect_tx(uint64_t* bar, uint32_t tx_bytes) {
  Mbar m = mbar_load(bar);
  m.tx += int32_t(tx_bytes);
  mbar_store(bar, m);
  t_block->poll_misses = 0;
}

bool mbarrier_try_wait_parity(uint64_t* bar, uint32_t parity) {
  Block& b = *t_block;
  // The tensor loads that complete on bar land now, in the order they were issued.
  for (size_t i = 0; i < b.tma.size();)
    if (b.tma[i].bar == bar) {
      const TmaLoad t = b.tma[i];
      b.tma.erase(b.tma.begin() + std::ptrdiff_t(i));
      perform_tma(b, t);
    } else {
      ++i;
    }
  if (mbar_load(bar).phase != (parity & 1)) return true;
  // Not yet: the other threads run. Polls that keep failing while nothing else happens (every
  // runnable thread polls) can never succeed.
  if (++b.poll_misses > 4 * b.live + 64) deadlock(b);
  if (b.count > 0) {  // another thread can run (else this one polls again at once)
    enqueue(b, *t_lane);
    yield();
  }
  return false;
}

namespace {

// The checks a tensor copy's map and coordinates share. The innermost coordinate must fall on a
// 16-byte boundary of the row: an H100 stops the kernel with an illegal instruction otherwise
// (measured 2026-12-07: loads at bf16 inner coordinates 85, 90 and -7 faulted; at 8, 80, 88, -8
// and -16 they did not, nor at outer coordinates outside the tensor), which no check of the map
// tells.
const TensorMap& checked_copy(const void* map, const int32_t* coords, int rank) {
  const TensorMap& m = checked_map(map);
  if (uint32_t(rank) != m.rank)
    die("cp.async.bulk.tensor.%dd with a tensor map of rank %u", rank, m.rank);
  if ((int64_t(coords[0]) * m.elem_bytes) % 16 != 0)
    die("cp.async.bulk.tensor: the innermost coordinate %d (%u-byte elements) is not on a 16-byte "
        "boundary (an illegal instruction on the GPU)",
        coords[0], m.elem_bytes);
  return m;
}

}  // namespace

void tma_load(void* dst, const void* map, const int32_t* coords, int rank, uint64_t* bar) {
  const TensorMap& m = checked_copy(map, coords, rank);
  if (reinterpret_cast<uintptr_t>(dst) % 128)
    die("cp.async.bulk.tensor: the shared destination %p is not 128-byte aligned", dst);
  (void)smem_address(dst);
  (void)mbar_load(bar);
  TmaLoad t{dst, m, {0, 0, 0, 0, 0}, bar};
  for (int d = 0; d < rank; ++d) t.c[d] = coords[d];
  t_block->tma.push_back(t);
  t_block->poll_misses = 0;
}

void tma_store(const void* map, const int32_t* coords, int rank, const void* src) {
  const TensorMap& m = checked_copy(map, coords, rank);
  // A store may run past the tensor's end, not before its start: on an H100 every store at a
  // negative coordinate, inner or outer, stopped with an illegal instruction (2026-12-07).
  for (int d = 0; d < rank; ++d)
    if (coords[d] < 0)
      die("cp.async.bulk.tensor: a tensor store at the negative coordinate %d of dimension %d (an "
          "illegal instruction on the GPU)",
          coords[d], d);
  if (reinterpret_cast<uintptr_t>(src) % 128)
    die("cp.async.bulk.tensor: the shared source %p is not 128-byte aligned", src);
  (void)smem_address(src);
  BulkStore st{m, {0, 0, 0, 0, 0}, src};
  for (int d = 0; d < rank; ++d) st.c[d] = coords[d];
  t_lane->stores.push_back(st);
}

void bulk_commit() {
  t_lane->store_group_end.push_back(t_lane->stores.size());
}

void bulk_wait(int pending_groups) {
  Lane& l = *t_lane;
  const int groups = int(l.store_group_end.size());
  if (groups <= pending_groups) return;
  const size_t upto = l.store_group_end[size_t(groups - pending_groups - 1)];
  l.store_group_end.erase(l.store_group_end.begin(),
                          l.store_group_end.begin() + (groups - pending_groups));
  perform_stores(l, upto);
}

// ------------------------------------------------------------------ launch

constexpr size_t kMaxSmemOptin = 232448;  // an H100 / H200's opt-in limit per block

static std::atomic<uint64_t> g_kernel_launches{0};

uint64_t kernel_launches() {
  return g_kernel_launches.load();
}

static std::mutex g_names_mu;
static std::vector<std::pair<std::string, uint64_t>> g_names;  // in first-launch order

std::vector<std::pair<std::string, uint64_t>> kernel_launches_by_name() {
  std::lock_guard<std::mutex> lock(g_names_mu);
  return g_names;
}

static void count_name(const char* kernel) {
  std::lock_guard<std::mutex> lock(g_names_mu);
  for (auto& [name, n] : g_names)
    if (name == kernel) {
      ++n;
      return;
    }
  g_names.emplace_back(kernel, 1);
}

void launch_impl(const char* kernel, const LaunchConfig& cfg, void (*body)(void*), void* ctx) {
  const uint64_t nt = uint64_t(cfg.block.x) * cfg.block.y * cfg.block.z;
  if (nt == 0 || nt > 1024 || cfg.block.z > 64 || cfg.grid.x == 0 || cfg.grid.y == 0 ||
      cfg.grid.z == 0 || cfg.grid.x > 2147483647u || cfg.grid.y > 65535 || cfg.grid.z > 65535) {
    t_last_error = cudaErrorInvalidConfiguration;
    return;
  }
  if (cfg.smem > kMaxSmemOptin) {
    t_last_error = cudaErrorInvalidValue;
    return;
  }
  if (t_block) die("a kernel launched another kernel (dynamic parallelism is not emulated)");
  ++g_kernel_launches;
  count_name(kernel);
  const Guarded smem = cfg.smem ? guarded_alloc(cfg.smem) : Guarded{};
  if (cfg.smem && !smem.ptr) die("cannot map %zu bytes of shared memory", cfg.smem);
  // The exact dynamic size, so that an access past it reaches the guard page.
  Guarded exact = smem;
  if (smem.ptr) {
    exact.ptr = smem.ptr + (smem.bytes - round_up(cfg.smem, 16));
    exact.bytes = round_up(cfg.smem, 16);
  }

  const bool reverse = env_flag("HLM_EMU_REVERSE");
  if (!env_flag("HLM_EMU_RACECHECK")) {
    run_grid(cfg, body, ctx, reverse, exact);
    guarded_free(smem);
    return;
  }
  // Race check: both orders from the same device memory must leave the same bytes.
  std::vector<std::pair<const Guarded*, std::string>> before;
  {
    std::lock_guard<std::mutex> lock(g_alloc_mu);
    for (auto& [start, g] : allocations()) before.emplace_back(&g, std::string(g.ptr, g.bytes));
  }
  run_grid(cfg, body, ctx, false, exact);
  std::vector<std::string> forward;
  for (auto& [g, bytes] : before) {
    forward.emplace_back(g->ptr, g->bytes);
    std::memcpy(g->ptr, bytes.data(), g->bytes);
  }
  run_grid(cfg, body, ctx, true, exact);
  for (size_t i = 0; i < before.size(); ++i) {
    const Guarded& g = *before[i].first;
    if (std::memcmp(g.ptr, forward[i].data(), g.bytes) == 0) continue;
    size_t at = 0;
    while (g.ptr[at] == forward[i][at]) ++at;
    die("race check: the launch (grid %u x %u x %u, block %u x %u x %u) leaves different bytes "
        "when its threads and blocks run in reverse order: allocation %p (%zu bytes), first "
        "difference at byte %zu",
        cfg.grid.x, cfg.grid.y, cfg.grid.z, cfg.block.x, cfg.block.y, cfg.block.z,
        static_cast<const void*>(g.ptr), g.bytes, at);
  }
  guarded_free(smem);
}

}  // namespace hlm::emu

// ------------------------------------------------------------------ the CUDA runtime API subset

using hlm::emu::t_last_error;

namespace {

cudaError_t fail(cudaError_t e) {
  t_last_error = e;
  return e;
}

struct EmuEvent {
  std::chrono::steady_clock::time_point t;
  bool recorded = false;
};

}  // namespace

extern "C" {

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : fail(cudaErrorInvalidDevice);
}

cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device) {
  if (device != 0) return fail(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrMultiProcessorCount:
      *value = 132;
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = int(hlm::emu::kMaxSmemOptin);
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlock:
      *value = 49152;
      return cudaSuccess;
    case cudaDevAttrMaxThreadsPerBlock:
      *value = 1024;
      return cudaSuccess;
    case cudaDevAttrWarpSize:
      *value = 32;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor:
      *value = 9;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor:
      *value = 0;
      return cudaSuccess;
    default:
      return fail(cudaErrorInvalidValue);
  }
}

cudaError_t cudaFuncSetAttribute(const void* func, enum cudaFuncAttribute attr, int value) {
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize &&
      (value < 0 || size_t(value) > hlm::emu::kMaxSmemOptin))
    return fail(cudaErrorInvalidValue);
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** ptr, size_t size) {
  const auto g = hlm::emu::guarded_alloc(size);
  if (!g.ptr) return fail(cudaErrorMemoryAllocation);
  std::lock_guard<std::mutex> lock(hlm::emu::g_alloc_mu);
  hlm::emu::allocations()[reinterpret_cast<uintptr_t>(g.ptr)] = g;
  *ptr = g.ptr;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  if (!ptr) return cudaSuccess;
  std::lock_guard<std::mutex> lock(hlm::emu::g_alloc_mu);
  auto& m = hlm::emu::allocations();
  const auto it = m.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == m.end()) return fail(cudaErrorInvalidValue);
  hlm::emu::guarded_free(it->second);
  m.erase(it);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, enum cudaMemcpyKind) {
  if (count) std::memmove(dst, src, count);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, enum cudaMemcpyKind,
                            cudaStream_t) {
  if (count) std::memmove(dst, src, count);
  return cudaSuccess;
}

// Pinned host memory is plain host memory here.
cudaError_t cudaMallocHost(void** ptr, size_t size) {
  *ptr = std::malloc(size ? size : 1);
  return *ptr ? cudaSuccess : fail(cudaErrorMemoryAllocation);
}

cudaError_t cudaFreeHost(void* ptr) {
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaMemset(void* ptr, int value, size_t count) {
  if (count) std::memset(ptr, value, count);
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t) {
  return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
  const cudaError_t e = t_last_error;
  t_last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) {
  return t_last_error;
}

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    default:
      return "unknown error (CPU emulation)";
  }
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  *event = reinterpret_cast<cudaEvent_t>(new EmuEvent);
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  return cudaEventCreate(event);
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete reinterpret_cast<EmuEvent*>(event);
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t) {
  auto* e = reinterpret_cast<EmuEvent*>(event);
  e->t = std::chrono::steady_clock::now();
  e->recorded = true;
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t) {
  return cudaSuccess;
}

// Every recorded event has passed: the emulation runs each call to its end before returning.
cudaError_t cudaEventQuery(cudaEvent_t) {
  return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  const auto* a = reinterpret_cast<EmuEvent*>(start);
  const auto* b = reinterpret_cast<EmuEvent*>(end);
  if (!a->recorded || !b->recorded) return fail(cudaErrorInvalidResourceHandle);
  *ms = std::chrono::duration<float, std::milli>(b->t - a->t).count();
  return cudaSuccess;
}

// The driver's tensor-map encoder, emulated: the checks its documentation lists, then the map's
// fields in the opaque bytes (TensorMap). Interleaved layouts, element strides other than 1 and
// the NaN out-of-bounds fill are not emulated.
CUresult cuTensorMapEncodeTiled(CUtensorMap* tensorMap, CUtensorMapDataType tensorDataType,
                                cuuint32_t tensorRank, void* globalAddress,
                                const cuuint64_t* globalDim, const cuuint64_t* globalStrides,
                                const cuuint32_t* boxDim, const cuuint32_t* elementStrides,
                                CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
                                CUtensorMapL2promotion, CUtensorMapFloatOOBfill oobFill) {
  uint32_t esz = 0;
  switch (tensorDataType) {
    case CU_TENSOR_MAP_DATA_TYPE_UINT8:
      esz = 1;
      break;
    case CU_TENSOR_MAP_DATA_TYPE_UINT16:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT16:
    case CU_TENSOR_MAP_DATA_TYPE_BFLOAT16:
      esz = 2;
      break;
    case CU_TENSOR_MAP_DATA_TYPE_UINT32:
    case CU_TENSOR_MAP_DATA_TYPE_INT32:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ:
    case CU_TENSOR_MAP_DATA_TYPE_TFLOAT32:
    case CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ:
      esz = 4;
      break;
    case CU_TENSOR_MAP_DATA_TYPE_UINT64:
    case CU_TENSOR_MAP_DATA_TYPE_INT64:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT64:
      esz = 8;
      break;
    default:
      return CUDA_ERROR_INVALID_VALUE;
  }
  if (!tensorMap || tensorRank < 1 || tensorRank > 5 || !globalAddress ||
      reinterpret_cast<uintptr_t>(globalAddress) % 16 != 0)
    return CUDA_ERROR_INVALID_VALUE;
  if (interleave != CU_TENSOR_MAP_INTERLEAVE_NONE || oobFill != CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    hlm::emu::die("cuTensorMapEncodeTiled: interleaved layouts and the NaN fill are not emulated");
  hlm::emu::TensorMap m{};
  m.magic = hlm::emu::kTensorMapMagic;
  m.base = reinterpret_cast<uint64_t>(globalAddress);
  m.rank = tensorRank;
  m.elem_bytes = esz;
  m.stride[0] = esz;
  for (uint32_t d = 0; d < tensorRank; ++d) {
    if (globalDim[d] < 1 || globalDim[d] > (uint64_t(1) << 32) || boxDim[d] < 1 ||
        boxDim[d] > 256 || elementStrides[d] < 1 || elementStrides[d] > 8)
      return CUDA_ERROR_INVALID_VALUE;
    if (elementStrides[d] != 1)
      hlm::emu::die("cuTensorMapEncodeTiled: element strides other than 1 are not emulated");
    m.dim[d] = globalDim[d];
    m.box[d] = boxDim[d];
    if (d > 0) {
      const uint64_t st = globalStrides[d - 1];
      if (st % 16 != 0 || st >= (uint64_t(1) << 40)) return CUDA_ERROR_INVALID_VALUE;
      m.stride[d] = st;
    }
  }
  const uint32_t inner = boxDim[0] * esz;
  if (inner % 16 != 0) return CUDA_ERROR_INVALID_VALUE;
  switch (swizzle) {
    case CU_TENSOR_MAP_SWIZZLE_NONE:
      m.swizzle_span = 0;
      break;
    case CU_TENSOR_MAP_SWIZZLE_32B:
      m.swizzle_span = 32;
      break;
    case CU_TENSOR_MAP_SWIZZLE_64B:
      m.swizzle_span = 64;
      break;
    case CU_TENSOR_MAP_SWIZZLE_128B:
      m.swizzle_span = 128;
      break;
    default:
      hlm::emu::die("cuTensorMapEncodeTiled: swizzle mode %d is not emulated", int(swizzle));
  }
  if (m.swizzle_span && inner > m.swizzle_span) return CUDA_ERROR_INVALID_VALUE;
  // A swizzled box narrower than its span: how the hardware places its rows is not emulated.
  if (m.swizzle_span && inner != m.swizzle_span)
    hlm::emu::die(
        "cuTensorMapEncodeTiled: a swizzled box's inner dimension (%u bytes) must fill "
        "its %u-byte span in the emulation",
        inner, m.swizzle_span);
  std::memset(tensorMap, 0, sizeof(CUtensorMap));
  std::memcpy(tensorMap, &m, sizeof m);
  return CUDA_SUCCESS;
}

cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** funcPtr, unsigned int,
                                             unsigned long long,
                                             cudaDriverEntryPointQueryResult* driverStatus) {
  const bool found = symbol && std::strcmp(symbol, "cuTensorMapEncodeTiled") == 0;
  *funcPtr = found ? reinterpret_cast<void*>(&cuTensorMapEncodeTiled) : nullptr;
  if (driverStatus)
    *driverStatus = found ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  return found ? cudaSuccess : fail(cudaErrorSymbolNotFound);
}

}  // extern "C"
