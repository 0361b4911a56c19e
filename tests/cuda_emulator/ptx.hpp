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
    for (int k = 0; k < 16; ++k) {
      const float av = half_of(w.a[(row % 8) * 4 + (k % 8) / 2][(row / 8) + 2 * (k / 8)], k);
      const float bv = half_of(w.b[col * 4 + (k % 8) / 2][k / 8], k);
      acc += (double)av * (double)bv;
    }
    out[e] = (float)acc;
  }
  w.bar.arrive_and_wait();
  for (int e = 0; e < 4; ++e) d[e] = out[e];
}

inline float from_elem(elem_t h) { return elem_to_float(h); }
