// Rotary position embedding in place on CUDA: each thread rotates one pair of one head row.
//
//   x_a' = x_a cos(m θ_i) − x_b sin(m θ_i),   x_b' = x_a sin(m θ_i) + x_b cos(m θ_i)
//   pairs (i, i + half) or (2i, 2i + 1) of the first 2·half features of each row
//
// x is a contiguous (B, H, T, D) or (B, T, H, D) tensor; cos and sin are f32 tables of (T, half)
// or (B, T, half) rows. bf16 and f16 values are rotated in f32 and rounded once, f64 in f64, as
// the CPU's in-place rotation does. The backward is the same kernel with −sin (a rotation by −θ).
//
// Specialised by the host through -D options: POSENC_ROPE_DTYPE (0 f32, 1 bf16, 2 f16, 3 f64).
// No header is included, except under POSENC_EMULATE (tests/cuda_emulator), which names a header
// of CPU versions of the two conversions.

#ifndef POSENC_ROPE_DTYPE
#error "POSENC_ROPE_DTYPE must be defined"
#endif

typedef unsigned long long u64;
typedef long long i64;

#if POSENC_ROPE_DTYPE == 0
typedef float elem_t;
typedef float acc_t;
__device__ __forceinline__ acc_t load(elem_t x) { return x; }
__device__ __forceinline__ elem_t store(acc_t x) { return x; }
#elif POSENC_ROPE_DTYPE == 3
typedef double elem_t;
typedef double acc_t;
__device__ __forceinline__ acc_t load(elem_t x) { return x; }
__device__ __forceinline__ elem_t store(acc_t x) { return x; }
#else
typedef unsigned short elem_t;  // bf16 or f16 bits
typedef float acc_t;
#if POSENC_ROPE_DTYPE == 1
#define HALF_TYPE "bf16"
#else
#define HALF_TYPE "f16"
#endif
#ifdef POSENC_EMULATE
// tests/cuda_emulator: the conversions below computed on the CPU.
#include POSENC_EMULATE
#else
__device__ __forceinline__ acc_t load(elem_t x) {
  float r;
  asm("cvt.f32." HALF_TYPE " %0, %1;" : "=f"(r) : "h"(x));
  return r;
}
__device__ __forceinline__ elem_t store(acc_t x) {
  elem_t r;
  asm("cvt.rn." HALF_TYPE ".f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
}
#endif
#endif

// Must match `RopeParams` in src/cuda/rope.rs field for field.
struct RopeParams {
  u64 x;            // elem_t*
  u64 cos, sin;     // const float*: rows of `half`
  i64 pairs;        // B · rows · half: one thread each
  i64 rows;         // head rows per sequence: H · T
  i64 heads, len;   // H, T
  i64 dim, half;    // D, rotated pairs per row
  int batched;      // tables hold (B, T, half)
  int interleaved;  // pairs (2i, 2i + 1), else (i, i + half)
  int heads_first;  // (B, H, T, D), else (B, T, H, D)
  float sin_sign;   // 1, or −1 for the backward
};

extern "C" __global__ void posenc_rope_inplace(const RopeParams p) {
  elem_t* x = reinterpret_cast<elem_t*>(p.x);
  const float* cos = reinterpret_cast<const float*>(p.cos);
  const float* sin = reinterpret_cast<const float*>(p.sin);
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < p.pairs; idx += stride) {
    const i64 r = idx / p.half, i = idx % p.half;
    const i64 bi = r / p.rows, within = r % p.rows;
    const i64 ti = p.heads_first ? within % p.len : within / p.heads;
    const i64 t = (p.batched ? bi * p.len + ti : ti) * p.half + i;
    const acc_t c = cos[t], s = p.sin_sign * sin[t];
    elem_t* row = x + r * p.dim;
    const i64 a = p.interleaved ? 2 * i : i;
    const i64 b = p.interleaved ? 2 * i + 1 : i + p.half;
    const acc_t xa = load(row[a]), xb = load(row[b]);
    row[a] = store(xa * c - xb * s);
    row[b] = store(xa * s + xb * c);
  }
}
