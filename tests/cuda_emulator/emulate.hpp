// A CUDA emulator for the crate's kernels on the CPU: one fiber per CUDA thread, real
// barriers for __syncthreads and for each warp's collective operations, and the few PTX
// instructions the kernels use (ldmatrix, mma.m16n8k16, cvt to bf16/f16) computed from their
// definitions in the PTX ISA (fragment layouts, "Matrix Fragments for mma.m16n8k16").
//
// The kernel sources are compiled unchanged apart from their inline-PTX helpers, which they
// leave out under POSENC_EMULATE; this header provides the same functions. Global memory is
// host memory (addresses are host pointers), `__shared__` arrays are statics shared by the
// block's threads, and the grid's blocks run one after another.
//
// What this checks: indexing, fragment layouts, barriers and masking, on real data; with
// -fsanitize=address, every read and write stays in its buffer. What it does not: PTX syntax
// and register use (.ci/cuda-kernels assembles each specialisation), timing, and races that
// only a GPU's scheduling would show.

#pragma once

#include <ucontext.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};

// The running thread's and block's indices: every CUDA thread is a fiber (ucontext) of one OS
// thread, switched only at barriers, so plain globals hold the running one's.
inline Dim3 threadIdx, blockIdx, gridDim, blockDim;

namespace emu {

struct Barrier;

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  unsigned idx = 0;
  bool done = false;
  // The barrier this thread waits at, and the generation it waits to see pass.
  const Barrier* waiting = nullptr;
  unsigned waiting_for = 0;
};

inline std::vector<Fiber> fibers;
inline ucontext_t main_ctx;
inline unsigned current = 0;
inline const std::function<void()>* body = nullptr;

inline void switch_to(unsigned to) {
  const unsigned from = current;
  current = to;
  threadIdx = {to, 0, 0};
  swapcontext(&fibers[from].ctx, &fibers[to].ctx);
}

struct Barrier {
  unsigned count, arrived = 0, generation = 0;
  explicit Barrier(unsigned n) : count(n) {}
  void arrive_and_wait();
};

// How the next thread to run is chosen, a fixed seed so that runs repeat. Blocks alternate
// between two schedules, both meant to expose a missing barrier as a wrong answer:
// - at random among the threads that can run: warps drift apart a little;
// - by a random ranking of the warps: the first-ranked warp runs until it waits at a barrier
//   of the whole block, as far ahead of the others as a GPU could let it.
inline unsigned long long seed = 0x9e3779b97f4a7c15ull;
inline bool ranked = false;
inline std::vector<unsigned> rank;  // per warp

inline unsigned next_random() {
  seed = seed * 6364136223846793005ull + 1442695040888963407ull;
  return (unsigned)(seed >> 33);
}

inline bool ready(const Fiber& f) {
  return !f.done && (f.waiting == nullptr || f.waiting->generation != f.waiting_for);
}

// Lets another thread run (the current one waits at a barrier).
inline void yield() {
  const unsigned n = fibers.size();
  unsigned best = n, best_rank = ~0u;
  const unsigned start = next_random() % n;
  for (unsigned step = 0; step < n; ++step) {
    const unsigned t = (start + step) % n;
    if (t == current || !ready(fibers[t])) continue;
    const unsigned r = ranked ? rank[t / 32] : 0;
    if (r < best_rank) {
      best = t;
      best_rank = r;
      if (!ranked) break;
    }
  }
  if (best < n) switch_to(best);
}

inline void Barrier::arrive_and_wait() {
  const unsigned g = generation;
  if (++arrived == count) {
    arrived = 0;
    ++generation;
    return;
  }
  Fiber& me = fibers[current];
  me.waiting = this;
  me.waiting_for = g;
  while (generation == g) yield();
  fibers[current].waiting = nullptr;
}

struct Warp {
  Barrier bar{32};
  const void* ptrs[32];
  unsigned a[32][4];
  unsigned b[32][2];
  float f[32];
  unsigned long long u[32];
};

struct Block {
  Barrier* bar = nullptr;
  std::vector<Warp*> warps;
};

inline Block block;

inline int lane() { return threadIdx.x % 32; }
inline Warp& warp() { return *block.warps[threadIdx.x / 32]; }

inline void entry() {
  (*body)();
  fibers[current].done = true;
  // On to an unfinished thread; when none is left, back to the launch (uc_link).
  for (unsigned step = 1; step < fibers.size(); ++step) {
    const unsigned to = (current + step) % fibers.size();
    if (!fibers[to].done) {
      current = to;
      threadIdx = {to, 0, 0};
      setcontext(&fibers[to].ctx);
    }
  }
}

// Runs `kernel` over the grid, `threads` threads per block (a multiple of 32), blocks in order.
inline void launch(Dim3 grid, unsigned threads, const std::function<void()>& kernel) {
  gridDim = grid;
  blockDim = {threads, 1, 1};
  Barrier bar(threads);
  block.bar = &bar;
  block.warps.clear();
  for (unsigned w = 0; w < (threads + 31) / 32; ++w) block.warps.push_back(new Warp);
  body = &kernel;
  // Stacks are kept from launch to launch; AddressSanitizer's marks from the frames of
  // finished threads are cleared before a stack is used again.
  fibers.resize(threads);
  for (auto& f : fibers) f.stack.resize(1 << 18);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = {x, y, z};
        ranked = !ranked;
        rank.resize((threads + 31) / 32);
        for (unsigned w = 0; w < rank.size(); ++w) rank[w] = w;
        for (unsigned w = rank.size(); w > 1; --w) std::swap(rank[w - 1], rank[next_random() % w]);
        for (unsigned t = 0; t < threads; ++t) {
          Fiber& f = fibers[t];
          f.idx = t;
          f.done = false;
          f.waiting = nullptr;
#if defined(__SANITIZE_ADDRESS__)
          ASAN_UNPOISON_MEMORY_REGION(f.stack.data(), f.stack.size());
#endif
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = f.stack.data();
          f.ctx.uc_stack.ss_size = f.stack.size();
          f.ctx.uc_link = &main_ctx;
          makecontext(&f.ctx, entry, 0);
        }
        current = 0;
        threadIdx = {0, 0, 0};
        swapcontext(&main_ctx, &fibers[0].ctx);
      }
  for (Warp* w : block.warps) delete w;
  block.warps.clear();
  block.bar = nullptr;
}

inline float bf16_to_float(unsigned short h) {
  unsigned u = (unsigned)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline unsigned short float_to_bf16(float f) {  // round to nearest even
  unsigned u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  u += 0x7fff + ((u >> 16) & 1);
  return (unsigned short)(u >> 16);
}

inline float f16_to_float(unsigned short h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return (float)x;
}

inline unsigned short float_to_f16(float f) {  // the conversion rounds to nearest even
  _Float16 x = (_Float16)f;
  unsigned short h;
  std::memcpy(&h, &x, 2);
  return h;
}

}  // namespace emu

inline void __syncthreads() { emu::block.bar->arrive_and_wait(); }

// One thread runs at a time: an atomic add is an add.
inline float atomicAdd(float* a, float v) {
  const float old = *a;
  *a += v;
  return old;
}

inline int atomicMin(int* a, int v) {
  const int old = *a;
  if (v < old) *a = v;
  return old;
}

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}

// Every lane of the warp takes part (the kernels pass a full mask).
inline float __shfl_sync(unsigned, float v, int src) {
  emu::Warp& w = emu::warp();
  w.f[emu::lane()] = v;
  w.bar.arrive_and_wait();
  const float r = w.f[src & 31];
  w.bar.arrive_and_wait();
  return r;
}

inline unsigned long long __shfl_sync(unsigned, unsigned long long v, int src) {
  emu::Warp& w = emu::warp();
  w.u[emu::lane()] = v;
  w.bar.arrive_and_wait();
  const unsigned long long r = w.u[src & 31];
  w.bar.arrive_and_wait();
  return r;
}

inline float __shfl_xor_sync(unsigned mask, float v, int m) {
  return __shfl_sync(mask, v, emu::lane() ^ m);
}
