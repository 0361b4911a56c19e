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

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#include <cmath>
#include <cstdint>
#include <algorithm>
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

// The running thread's and block's indices: every CUDA thread is a fiber of one OS
// thread, switched only at barriers, so plain globals hold the running one's.
inline Dim3 threadIdx, blockIdx, gridDim, blockDim;

namespace emu {

// Fibers switch by saving the callee-saved registers on the running stack and loading the
// other fiber's stack pointer (x86-64 System V): ucontext's swapcontext also saves the
// signal mask, a system call per switch, and under AddressSanitizer clears the shadow of the
// whole new stack, which together made up most of the emulator's time.
#if !defined(__x86_64__)
#error "the emulator's fiber switch is written for x86-64"
#endif
extern "C" void posenc_emu_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl posenc_emu_switch
  .type posenc_emu_switch, @function
posenc_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  stmxcsr 8(%rsp)
  fnstcw (%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr 8(%rsp)
  fldcw (%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size posenc_emu_switch, .-posenc_emu_switch
)");

struct Barrier;

struct Fiber {
  void* sp = nullptr;
  std::vector<char> stack;
  unsigned idx = 0;
  bool done = false;
  // The barrier this thread waits at, and the generation it waits to see pass.
  const Barrier* waiting = nullptr;
  unsigned waiting_for = 0;
  // Not done, and not waiting at a barrier that has yet to pass (kept with `ready_in_warp`).
  bool runnable = false;
};

inline std::vector<Fiber> fibers;
inline void* main_sp = nullptr;
inline unsigned current = 0;
inline const std::function<void()>* body = nullptr;
#if defined(__SANITIZE_ADDRESS__)
// The launching thread's own stack, learnt at the first switch into a fiber.
inline const void* main_stack_bottom = nullptr;
inline size_t main_stack_size = 0;
#endif

// Switches from the stack whose pointer is saved in `*save` to `load`, whose stack spans
// `bottom .. bottom + size`; `leaving` is true when the running fiber never resumes.
inline void switch_stack(void** save, void* load, const void* bottom, size_t size, bool leaving) {
#if defined(__SANITIZE_ADDRESS__)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(leaving ? nullptr : &fake, bottom, size);
  posenc_emu_switch(save, load);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  (void)bottom, (void)size, (void)leaving;
  posenc_emu_switch(save, load);
#endif
}

inline void switch_to(unsigned to) {
  const unsigned from = current;
  current = to;
  threadIdx = {to, 0, 0};
  switch_stack(&fibers[from].sp, fibers[to].sp, fibers[to].stack.data(), fibers[to].stack.size(),
               false);
}

struct Barrier {
  unsigned count, arrived = 0, generation = 0;
  std::vector<unsigned> waiters;
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
inline std::vector<unsigned> rank;     // per warp
inline std::vector<unsigned> by_rank;  // the warps, first-ranked first
// Runnable threads per warp, so that a choice skips warps with none.
inline std::vector<unsigned> ready_in_warp;

inline unsigned next_random() {
  seed = seed * 6364136223846793005ull + 1442695040888963407ull;
  return (unsigned)(seed >> 33);
}

inline void set_runnable(unsigned t, bool on) {
  if (fibers[t].runnable == on) return;
  fibers[t].runnable = on;
  if (on)
    ++ready_in_warp[t / 32];
  else
    --ready_in_warp[t / 32];
}

// The first runnable thread of warp `w` in the cyclic order that starts at `start`.
inline unsigned first_in_warp(unsigned w, unsigned start) {
  const unsigned lo = w * 32, hi = std::min<unsigned>(lo + 32, fibers.size());
  const unsigned from = (start > lo && start < hi) ? start : lo;
  for (unsigned t = from; t < hi; ++t)
    if (fibers[t].runnable) return t;
  for (unsigned t = lo; t < from; ++t)
    if (fibers[t].runnable) return t;
  return fibers.size();
}

// Lets another thread run (the current one waits at a barrier): at random, the first
// runnable thread after a random start; ranked, the first such thread of the best-ranked warp
// that has one.
inline void yield() {
  const unsigned n = fibers.size();
  const unsigned start = next_random() % n;
  unsigned best = n;
  if (ranked) {
    for (unsigned w : by_rank)
      if (ready_in_warp[w] > 0) {
        best = first_in_warp(w, start);
        break;
      }
  } else {
    for (unsigned step = 0; step < n && best == n; ++step) {
      const unsigned t = (start + step) % n;
      if (ready_in_warp[t / 32] == 0) {
        // The rest of this warp has none either (at most the warp's last thread, or n).
        const unsigned end = std::min<unsigned>((t / 32 + 1) * 32, n);
        step += end - t - 1;
        continue;
      }
      if (fibers[t].runnable) best = t;
    }
  }
  if (best < n) switch_to(best);
}

inline void Barrier::arrive_and_wait() {
  const unsigned g = generation;
  if (++arrived == count) {
    arrived = 0;
    ++generation;
    for (unsigned t : waiters) set_runnable(t, true);
    waiters.clear();
    return;
  }
  Fiber& me = fibers[current];
  me.waiting = this;
  me.waiting_for = g;
  waiters.push_back(current);
  set_runnable(current, false);
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

// Where every fiber starts (entered by the switch's `ret`); it never returns.
[[noreturn]] inline void entry() {
#if defined(__SANITIZE_ADDRESS__)
  // The first fiber ever entered is entered from the launch: the stack left is the launch's.
  if (main_stack_bottom == nullptr)
    __sanitizer_finish_switch_fiber(nullptr, &main_stack_bottom, &main_stack_size);
  else
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
  (*body)();
  fibers[current].done = true;
  set_runnable(current, false);
  // On to an unfinished thread; when none is left, back to the launch.
  void* discarded = nullptr;
  for (unsigned step = 1; step < fibers.size(); ++step) {
    const unsigned to = (current + step) % fibers.size();
    if (!fibers[to].done) {
      current = to;
      threadIdx = {to, 0, 0};
      switch_stack(&discarded, fibers[to].sp, fibers[to].stack.data(), fibers[to].stack.size(),
                   true);
    }
  }
#if defined(__SANITIZE_ADDRESS__)
  switch_stack(&discarded, main_sp, main_stack_bottom, main_stack_size, true);
#else
  switch_stack(&discarded, main_sp, nullptr, 0, true);
#endif
  __builtin_unreachable();
}

// A fresh stack laid out as posenc_emu_switch leaves a suspended one: the control words, six
// zeroed registers, and `entry` as the return address, 16-byte aligned as at a call.
inline void* fresh_stack(std::vector<char>& stack) {
  auto top = reinterpret_cast<uintptr_t>(stack.data() + stack.size()) & ~uintptr_t{15};
  auto* slot = reinterpret_cast<uint64_t*>(top) - 2;  // the return address, 16-byte aligned
  slot[0] = reinterpret_cast<uint64_t>(&entry);
  slot[1] = 0;
  uint64_t* sp = slot - 8;  // six registers and the 16 bytes of control words
  for (int i = 0; i < 8; ++i) sp[i] = 0;
  const uint32_t mxcsr = 0x1f80;  // the defaults: every exception masked, round to nearest
  const uint16_t fcw = 0x037f;
  std::memcpy(reinterpret_cast<char*>(sp) + 8, &mxcsr, 4);
  std::memcpy(sp, &fcw, 2);
  return sp;
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
        by_rank.assign(rank.size(), 0);
        for (unsigned w = 0; w < rank.size(); ++w) by_rank[rank[w]] = w;
        ready_in_warp.assign(rank.size(), 0);
        for (unsigned t = 0; t < threads; ++t) {
          Fiber& f = fibers[t];
          f.idx = t;
          f.done = false;
          f.waiting = nullptr;
          f.runnable = false;
          set_runnable(t, true);
#if defined(__SANITIZE_ADDRESS__)
          ASAN_UNPOISON_MEMORY_REGION(f.stack.data(), f.stack.size());
#endif
          f.sp = fresh_stack(f.stack);
        }
        current = 0;
        threadIdx = {0, 0, 0};
        switch_stack(&main_sp, fibers[0].sp, fibers[0].stack.data(), fibers[0].stack.size(),
                     false);
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
