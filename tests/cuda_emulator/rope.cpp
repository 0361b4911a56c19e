// posenc_rope_inplace (src/cuda/rope_in_place.cu), run by the CPU emulator against the
// rotation written out in f64:
//
//   x_a' = x_a cos θ − s x_b sin θ,   x_b' = s x_a sin θ + x_b cos θ   (s = 1, or −1 backward)
//
// for pairs (i, i + half) or (2i, 2i + 1) of the first 2·half features of each head row, rows
// (B, H, T, D) or (B, T, H, D), tables of (T, half) or (B, T, half) rows, with a grid smaller
// than the pairs (the kernel's stride loop). Built once per dtype by .ci/cuda-emulate
// (-DPOSENC_ROPE_DTYPE, -DPOSENC_EMULATE='"rope_ptx.hpp"'). Exits non-zero when a rotated value
// is off by more than one rounding of the element type (and of the arithmetic), or an unrotated
// feature changed.

#include "emulate.hpp"
#include "../../src/cuda/rope_in_place.cu"

#include <cstdio>
#include <random>
#include <string>

namespace {

double to_double(elem_t x) {
#if POSENC_ROPE_DTYPE == 0 || POSENC_ROPE_DTYPE == 3
  return x;
#else
  return load(x);
#endif
}

elem_t from_double(double x) {
#if POSENC_ROPE_DTYPE == 0
  return (float)x;
#elif POSENC_ROPE_DTYPE == 3
  return x;
#else
  return store((float)x);
#endif
}

// One rounding of the element type, relative.
constexpr double EPS = POSENC_ROPE_DTYPE == 0 ? 1.2e-7
                     : POSENC_ROPE_DTYPE == 1 ? 1.0 / 128
                     : POSENC_ROPE_DTYPE == 2 ? 1.0 / 1024
                                              : 2.3e-16;
// One rounding of the arithmetic (f32, f64 for f64), relative.
constexpr double ACC_EPS = POSENC_ROPE_DTYPE == 3 ? 1.2e-16 : 6e-8;

struct Case {
  int b, h, t, d, half;
  bool interleaved, heads_first, batched, backward;
  unsigned blocks;  // fewer than the pairs need: the stride loop
};

bool run(const Case& c, std::mt19937_64& g) {
  std::normal_distribution<double> n(0.0, 1.0);
  const size_t len = (size_t)c.b * c.h * c.t * c.d;
  std::vector<elem_t> x(len);
  for (auto& v : x) v = from_double(n(g));
  const std::vector<elem_t> x0 = x;
  const size_t rows = c.batched ? (size_t)c.b * c.t : (size_t)c.t;
  std::vector<float> cos(rows * c.half), sin(rows * c.half);
  for (size_t r = 0; r < rows; ++r)
    for (int i = 0; i < c.half; ++i) {
      const double th = (double)(r % c.t + 3 * (r / c.t)) * std::pow(10000.0, -2.0 * i / c.d);
      cos[r * c.half + i] = (float)std::cos(th);
      sin[r * c.half + i] = (float)std::sin(th);
    }
  RopeParams p{};
  p.x = (u64)x.data();
  p.cos = (u64)cos.data();
  p.sin = (u64)sin.data();
  p.pairs = (i64)c.b * c.h * c.t * c.half;
  p.rows = (i64)c.h * c.t;
  p.heads = c.h;
  p.len = c.t;
  p.dim = c.d;
  p.half = c.half;
  p.batched = c.batched;
  p.interleaved = c.interleaved;
  p.heads_first = c.heads_first;
  p.sin_sign = c.backward ? -1.0f : 1.0f;
  emu::launch({c.blocks, 1, 1}, 64, [&] { posenc_rope_inplace(p); });

  bool ok = true;
  for (int bi = 0; bi < c.b; ++bi)
    for (int r = 0; r < c.h * c.t; ++r) {
      const int ti = c.heads_first ? r % c.t : r / c.h;
      const size_t base = ((size_t)bi * c.h * c.t + r) * c.d;
      std::vector<char> rotated(c.d, 0);
      for (int i = 0; i < c.half; ++i) {
        const size_t tr = (size_t)(c.batched ? bi * c.t + ti : ti) * c.half + i;
        const double co = cos[tr], si = (c.backward ? -1.0 : 1.0) * sin[tr];
        const int a = c.interleaved ? 2 * i : i, bb = c.interleaved ? 2 * i + 1 : i + c.half;
        const double xa = to_double(x0[base + a]), xb = to_double(x0[base + bb]);
        const double want[2] = {xa * co - xb * si, xa * si + xb * co};
        const int at[2] = {a, bb};
        for (int k = 0; k < 2; ++k) {
          const double got = to_double(x[base + at[k]]);
          // The result's rounding, and the arithmetic's (f32, or f64) on the two products.
          const double tol = EPS * std::fabs(want[k]) + 3 * ACC_EPS * (std::fabs(xa) + std::fabs(xb));
          if (!(std::fabs(got - want[k]) <= tol)) ok = false;
          rotated[at[k]] = 1;
        }
      }
      for (int f = 0; f < c.d; ++f)
        if (!rotated[f] && std::memcmp(&x[base + f], &x0[base + f], sizeof(elem_t)) != 0) ok = false;
    }
  return ok;
}

}  // namespace

int main() {
  std::mt19937_64 g(7);
  const Case cases[] = {
      {2, 3, 5, 16, 8, false, true, false, false, 1},
      {2, 3, 5, 16, 8, true, true, false, false, 2},
      {2, 3, 5, 16, 8, false, false, false, false, 3},
      {2, 3, 5, 16, 8, true, false, true, false, 1},
      {1, 2, 7, 16, 3, false, true, false, false, 1},  // partial: 6 of 16 features
      {1, 2, 7, 16, 5, true, false, true, false, 2},   // partial, interleaved
      {2, 2, 6, 32, 16, false, true, true, true, 1},   // the backward's rotation by −θ
      {3, 4, 9, 64, 32, true, false, false, true, 4},
  };
  int failures = 0;
  for (const Case& c : cases) {
    const bool ok = run(c, g);
    std::printf("%s rope dtype %d: B%d H%d T%d D%d half %d%s%s%s%s\n", ok ? "ok  " : "FAIL",
                POSENC_ROPE_DTYPE, c.b, c.h, c.t, c.d, c.half, c.interleaved ? " interleaved" : "",
                c.heads_first ? " (B, H, T, D)" : " (B, T, H, D)", c.batched ? " batched" : "",
                c.backward ? " backward" : "");
    failures += !ok;
  }
  return failures ? 1 : 0;
}
