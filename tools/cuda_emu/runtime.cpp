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

enum class State : uint8_t { runnable, barrier, collective, done };
enum class Kind : uint8_t { sync, shfl, ballot, mma, mma_bf16, ldmatrix };
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
  }
  return "?";
}

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

void finish_lane(Lane& l) {
  perform_copies(l, l.copies.size());
  l.group_end.clear();
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
                  l.state == State::barrier ? "at __syncthreads" : kind_name(l.kind));
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

// ------------------------------------------------------------------ launch

constexpr size_t kMaxSmemOptin = 232448;  // an H100 / H200's opt-in limit per block

static std::atomic<uint64_t> g_kernel_launches{0};

uint64_t kernel_launches() {
  return g_kernel_launches.load();
}

void launch_impl(const LaunchConfig& cfg, void (*body)(void*), void* ctx) {
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

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  const auto* a = reinterpret_cast<EmuEvent*>(start);
  const auto* b = reinterpret_cast<EmuEvent*>(end);
  if (!a->recorded || !b->recorded) return fail(cudaErrorInvalidResourceHandle);
  *ms = std::chrono::duration<float, std::milli>(b->t - a->t).count();
  return cudaSuccess;
}

}  // extern "C"
