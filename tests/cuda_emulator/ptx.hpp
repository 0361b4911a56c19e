// The inline-PTX helpers of the tensor-core kernels (flash_forward.cu, flash_backward.cu),
// emulated: included by a kernel in place of its own helpers when POSENC_EMULATE names this
// file. `elem_t` (16-bit operand bits) and POSENC_BF16 come from the kernel.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with .bf16/.f16, and ldmatrix), with g = lane / 4,
// t = lane % 4:
//   A (16 × 16, row): a[0] = (g, 2t..2t+1), a[1] = (g+8, 2t..), a[2] = (g, 2t+8..), a[3] = (g+8, 2t+8..)
//   B (16 × 8, col):  b0 = (2t..2t+1, g), b1 = (2t+8..2t+9, g)
//   C, D (16 × 8):    c[0], c[1] = (g, 2t), (g, 2t+1); c[2], c[3] = (g+8, 2t), (g+8, 2t+1)
//   ldmatrix .x4: matrix m's row r is at the address of lane 8m + r; lane l receives
//   (l / 4, 2(l % 4)..+1) of each matrix, or with .trans (2(l % 4)..+1, l / 4); the lower
//   column (row) in the lower half.

#pragma once

#include "emulate.hpp"

// One warp's mma: each lane publishes its A and B registers to the warp, then computes its
// four outputs, (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1), as d + Σ_k product(w, row,
// col, k) over `ks` in double, rounded to f32 once.
template <class Product>
inline void warp_mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1, int ks,
                     Product product) {
  emu::Warp& w = emu::warp();
  const int l = emu::lane();
  for (int i = 0; i < 4; ++i) w.a[l][i] = a[i];
  w.b[l][0] = b0;
  w.b[l][1] = b1;
  w.bar.arrive_and_wait();
  const int g = l / 4, t = l % 4;
  float out[4];
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e / 2), col = 2 * t + (e % 2);
    double acc = d[e];
    for (int k = 0; k < ks; ++k) acc += product(w, row, col, k);
    out[e] = (float)acc;
  }
  w.bar.arrive_and_wait();
  for (int e = 0; e < 4; ++e) d[e] = out[e];
}

#if POSENC_F32
// f32 operands: the kernel composes its products from TF32 ones (mma.m16n8k8 .tf32) and reads
// fragments by shuffles; only the two PTX instructions are emulated here.
//   A (16 × 8, row): a0 = (g, t), a1 = (g+8, t), a2 = (g, t+4), a3 = (g+8, t+4)
//   B (8 × 8, col):  b0 = (t, g), b1 = (t+4, g)
//   C, D: as below.

inline float elem_to_float(elem_t x) { return x; }

// cvt.rna.tf32.f32: to 10 bits of mantissa, to nearest, ties away from zero (the f32 bits with
// the lower 13 cleared); NaN and infinities as they are.
inline unsigned tf32(float x) {
  unsigned u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) == 0x7f800000u) return u;
  return (u + 0x1000u) & ~0x1fffu;
}

// The 19 bits of a TF32 operand the tensor cores read.
inline double tf32_value(unsigned u) { return (double)__uint_as_float(u & ~0x1fffu); }

// d += a · b: products exact, each output's sum in double, rounded to f32 once.
inline void mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  // A's (row, k) is register (row / 8) + 2 (k / 4) of lane 4 (row % 8) + k % 4; B's (k, col)
  // register k / 4 of lane 4 col + k % 4.
  warp_mma(d, a, b[0], b[1], 8, [](const emu::Warp& w, int row, int col, int k) {
    return tf32_value(w.a[(row % 8) * 4 + k % 4][(row / 8) + 2 * (k / 4)]) *
           tf32_value(w.b[col * 4 + k % 4][k / 4]);
  });
}
#else

inline float elem_to_float(elem_t h) {
#if POSENC_BF16
  return emu::bf16_to_float(h);
#else
  return emu::f16_to_float(h);
#endif
}

inline elem_t to_elem(float x) {
#if POSENC_BF16
  return emu::float_to_bf16(x);
#else
  return emu::float_to_f16(x);
#endif
}

inline unsigned pack(float lo, float hi) {
  return (unsigned)to_elem(lo) | ((unsigned)to_elem(hi) << 16);
}

inline void ldsm_x4_impl(unsigned (&r)[4], const elem_t* p, bool trans) {
  emu::Warp& w = emu::warp();
  const int l = emu::lane();
  w.ptrs[l] = p;
  w.bar.arrive_and_wait();
  for (int m = 0; m < 4; ++m) {
    elem_t lo, hi;
    if (trans) {
      const elem_t* r0 = static_cast<const elem_t*>(w.ptrs[8 * m + 2 * (l % 4)]);
      const elem_t* r1 = static_cast<const elem_t*>(w.ptrs[8 * m + 2 * (l % 4) + 1]);
      lo = r0[l / 4];
      hi = r1[l / 4];
    } else {
      const elem_t* row = static_cast<const elem_t*>(w.ptrs[8 * m + l / 4]);
      lo = row[2 * (l % 4)];
      hi = row[2 * (l % 4) + 1];
    }
    r[m] = (unsigned)lo | ((unsigned)hi << 16);
  }
  w.bar.arrive_and_wait();
}

inline void ldsm_x4(unsigned (&r)[4], const elem_t* p) { ldsm_x4_impl(r, p, false); }
inline void ldsm_x4_trans(unsigned (&r)[4], const elem_t* p) { ldsm_x4_impl(r, p, true); }

// One 16-bit half of a fragment register.
inline float half_of(unsigned reg, int k) {
  return elem_to_float((elem_t)((k % 2) ? (reg >> 16) : (reg & 0xffff)));
}

// d += a · b: products exact, each output's sum in double, rounded to f32 once.
inline void mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  warp_mma(d, a, b0, b1, 16, [](const emu::Warp& w, int row, int col, int k) {
    const float av = half_of(w.a[(row % 8) * 4 + (k % 8) / 2][(row / 8) + 2 * (k / 8)], k);
    const float bv = half_of(w.b[col * 4 + (k % 8) / 2][k / 8], k);
    return (double)av * (double)bv;
  });
}

inline float from_elem(elem_t h) { return elem_to_float(h); }
#endif  // POSENC_F32
