// The kernels of src/attention/cuda/flash_forward.cu, run by the CPU emulator against
// attention written out from its formula in f64:
//
//   s_ij = cap · tanh(q_i · k_j / cap) + Σ terms        (keys the row's rule hides: −FLT_MAX)
//   m_i = max(sink, max_j s_ij),  l_i = e^(sink − m_i) + Σ_j e^(s_ij − m_i)
//   out_i = Σ_j P_ij (v_j + a[c(i, j)]),  P_ij = e^(s_ij − m_i) / l_i,  stats_i = (m_i, 1 / l_i)
//
// and its backward for a loss L = Σ dO · out:
//
//   dP_ij = dO_i · (v_j + a[c(i, j)]),  δ_i = Σ_j P_ij dP_ij,
//   dS_ij = P_ij (dP_ij − δ_i) (1 − tanh²(s / cap))
//   dq_i = Σ_j dS_ij k_j,  dk_j = Σ_i dS_ij q_i,  dv_j = Σ_i P_ij dO_i,  dsink = −Σ_i P_i,sink δ_i
//   d term[c(i, j)] = Σ P_ij (dP_ij − δ_i) over the (b, h, i, j) that read the entry
//   W[b, h, i, c] = Σ_j P_ij over the keys whose clamped column is c (a value term's
//   gathered weights, from which the host takes the table's gradient Σ W_ic dO_i)
//
// (a row masked whole has constant weights: dS = 0). posenc_flash_forward (and, for split
// keys, posenc_flash_combine) gives the output and statistics; posenc_flash_delta and
// posenc_flash_backward the gradients.
//
// Built once per specialisation by .ci/cuda-emulate (-DPOSENC_HEAD_DIM, -DPOSENC_BF16,
// -DPOSENC_F32, -DPOSENC_VALUES, -DPOSENC_EMULATE='"ptx.hpp"'). Exits non-zero when any case differs by more
// than the operand type's rounding allows, or writes outside its output rows.

#include "emulate.hpp"
#include "../../src/attention/cuda/flash_forward.cu"

#include <cfloat>
#include <cstdio>
#include <random>
#include <string>

namespace {

constexpr int D = HEAD_DIM;

struct Case {
  std::string name;
  int b = 1, h = 2, hkv = 2, tq = 64, tk = 64;
  i64 first = 0;
  bool causal = false;
  i64 window = -1;
  i64 chunk = 0;         // > 0: keys of the query's own chunk, counted from the leading padding
  float softcap = 0.0f;
  bool sinks = false;
  int padding = 0;       // 0 none, 1 per sequence (sequence 1 fully padded if b > 1), 2 shared
  int dense = 0;         // 0 none, 1 a bias shared by the batch, 2 a user's mask with −∞,
                         // 3 a bias per key shared by the batch and the queries (ALiBi's form),
                         // 4 a user's mask that takes a gradient, one row −∞ throughout,
                         // 5 ALiBi's causal row per key (steep slopes, no randomness)
  int relative = 0;      // 0 none, 1 a row per head (ALiBi, T5), 2 a row per query (Shaw's q·aᴷ)
  int rel_width = 9;
  i64 rel_shift = 4;
  int value_width = 0;   // > 0: a value term (POSENC_VALUES builds only)
  i64 value_shift = 0;
  int key_split = 0;     // > 0: keys per block, then the combining kernel (a value term's
                         // table then takes no gradient, as in training, which never splits)
  bool token_major = false;  // q stored (B, Tq, H, D)
  int first_row = 0, extra_rows = 0;
};

struct Rng {
  std::mt19937_64 g{12345};
  std::normal_distribution<double> n{0.0, 1.0};
  double operator()() { return n(g); }
};

struct Result {
  double err = 0.0, worst_ratio = 0.0;
  bool stray = false, bad_lse = false;
  double grad_err = 0.0, grad_ratio = 0.0;  // the backward's, when run
  bool backward = false;
};

// |got − want| against its tolerance: the worst ratio past it, and the largest error.
void check(double got, double want, double tol, double* err, double* ratio) {
  if (std::isnan(got) && std::isnan(want)) return;  // a row of −∞ gives NaN, as it should
  const double e = std::fabs(got - want);
  if (std::isnan(e)) {
    *err = INFINITY;
    *ratio = 1e9;
    return;
  }
  *err = std::max(*err, e);
  if (e > tol) *ratio = std::max(*ratio, e / tol);
}

Result run(const Case& c, Rng& rng) {
  const int b = c.b, h = c.h, hkv = c.hkv, tq = c.tq, tk = c.tk;
  const int out_rows = c.first_row + tq + c.extra_rows;
  // Operands rounded to the element type; the reference reads the same values.
  auto draw = [&](size_t n, double scale) {
    std::vector<elem_t> v(n);
    for (auto& x : v) x = to_elem((float)(rng() * scale));
    return v;
  };
  std::vector<elem_t> q = draw((size_t)b * h * tq * D, 1.5 / std::sqrt((double)D));
  std::vector<elem_t> k = draw((size_t)b * hkv * tk * D, 1.0);
  std::vector<elem_t> v = draw((size_t)b * hkv * tk * D, 1.0);
  // q's strides: (B, H, Tq, D) or (B, Tq, H, D).
  const i64 qs[3] = {(i64)h * tq * D, c.token_major ? (i64)D : (i64)tq * D,
                     c.token_major ? (i64)h * D : (i64)D};
  const i64 ks[3] = {(i64)hkv * tk * D, (i64)tk * D, (i64)D};
  auto qat = [&](int bi, int hi, int i, int d) {
    return elem_to_float(q[bi * qs[0] + hi * qs[1] + i * qs[2] + d]);
  };
  auto kat = [&](int bi, int hk, int j, int d) {
    return elem_to_float(k[bi * ks[0] + hk * ks[1] + j * ks[2] + d]);
  };
  auto vat = [&](int bi, int hk, int j, int d) {
    return elem_to_float(v[bi * ks[0] + hk * ks[1] + j * ks[2] + d]);
  };

  std::vector<unsigned char> pad;
  i64 pad_stride = 0;
  if (c.padding == 1) {
    pad.assign((size_t)b * tk, 1);
    for (int bi = 0; bi < b; ++bi)
      for (int j = 0; j < tk; ++j) {
        if (bi == 1) pad[bi * tk + j] = 0;                     // a sequence padded whole
        else if (j < 3 * bi + 2 || j % 7 == 3) pad[bi * tk + j] = 0;
      }
    pad_stride = tk;
  } else if (c.padding == 2) {
    pad.assign(tk, 1);
    for (int j = 0; j < tk; ++j)
      if (j % 5 == 1) pad[j] = 0;
  }
  std::vector<float> sinks(h);
  for (auto& s : sinks) s = (float)rng();

  Params p{};
  std::vector<std::vector<float>> term_store;
  auto term_value = [&](int t, int bi, int hi, int i, int j) -> double {
    const Term& term = p.terms[t];
    i64 col = j;
    if (term.width > 0) {
      col = j - i + term.shift;
      col = col < 0 ? 0 : (col >= term.width ? term.width - 1 : col);
    }
    const float* vals = reinterpret_cast<const float*>(term.values);
    return vals[bi * term.strides[0] + hi * term.strides[1] + i * term.strides[2] +
                col * term.strides[3]];
  };
  if (c.dense == 3 || c.dense == 5) {
    // (1, H, 1, Tk), broadcast over the batch and the queries: random, or (5) ALiBi's causal
    // row, slope 2^-(2 + 2h) times (j − the last key), down to −150 over 601 keys.
    std::vector<float> t((size_t)h * tk);
    for (size_t n = 0; n < t.size(); ++n) {
      const double slope = std::ldexp(1.0, -2 - 2 * (int)(n / tk));
      t[n] = c.dense == 5 ? (float)(slope * ((double)(n % tk) - (double)(tk - 1)))
                          : (float)(0.5 * rng());
    }
    term_store.push_back(std::move(t));
    Term& term = p.terms[p.n_terms++];
    term.values = (u64)term_store.back().data();
    term.strides[0] = 0;
    term.strides[1] = tk;
    term.strides[2] = 0;
    term.strides[3] = 1;
  } else if (c.dense) {
    // (1, H, Tq, Tk), broadcast over the batch.
    std::vector<float> t((size_t)h * tq * tk);
    for (size_t n = 0; n < t.size(); ++n) {
      t[n] = (float)(0.5 * rng());
      if (c.dense == 2 && (n % 11 == 4)) t[n] = -INFINITY;
      if (c.dense == 4 && n / tk == 5) t[n] = -INFINITY;  // head 0, query 5
    }
    term_store.push_back(std::move(t));
    Term& term = p.terms[p.n_terms++];
    term.values = (u64)term_store.back().data();
    term.strides[0] = 0;
    term.strides[1] = (i64)tq * tk;
    term.strides[2] = tk;
    term.strides[3] = 1;
  }
  if (c.relative) {
    const int w = c.rel_width;
    const size_t n = c.relative == 1 ? (size_t)h * w : (size_t)b * h * tq * w;
    std::vector<float> t(n);
    for (auto& x : t) x = (float)rng();
    term_store.push_back(std::move(t));
    Term& term = p.terms[p.n_terms++];
    term.values = (u64)term_store.back().data();
    if (c.relative == 1) {
      term.strides[0] = 0;
      term.strides[1] = w;
      term.strides[2] = 0;
    } else {
      term.strides[0] = (i64)h * tq * w;
      term.strides[1] = (i64)tq * w;
      term.strides[2] = w;
    }
    term.strides[3] = 1;
    term.shift = c.rel_shift;
    term.width = w;
  }
  std::vector<float> table;
  if (c.value_width > 0) {
    table.resize((size_t)c.value_width * D);
    for (auto& x : table) x = (float)rng();
  }

  const u64 sentinel = 0xffff;
  std::vector<elem_t> out((size_t)b * out_rows * h * D, (elem_t)sentinel);
  std::vector<float> stats((size_t)b * h * out_rows * 2, -12345.0f);
  p.q = (u64)q.data();
  p.k = (u64)k.data();
  p.v = (u64)v.data();
  p.out = (u64)out.data();
  p.stats = (u64)stats.data();
  p.padding = pad.empty() ? 0 : (u64)pad.data();
  p.padding_stride = pad_stride;
  p.sinks = c.sinks ? (u64)sinks.data() : 0;
  p.value_table = table.empty() ? 0 : (u64)table.data();
  p.value_shift = c.value_shift;
  p.value_width = c.value_width;
  for (int a = 0; a < 3; ++a) {
    p.q_strides[a] = qs[a];
    p.k_strides[a] = ks[a];
    p.v_strides[a] = ks[a];
  }
  p.out_rows = out_rows;
  p.first_row = c.first_row;
  p.first = c.first;
  p.window = c.window;
  p.chunk = c.chunk;
  p.batch = b;
  p.heads = h;
  p.kv_group = h / hkv;
  p.tq = tq;
  p.tk = tk;
  p.causal = c.causal;
  p.skip = c.padding == 0 && c.dense != 2 && c.dense != 4;
  p.softcap = c.softcap;
  int splits = 1;
  std::vector<float> partial;
  if (c.key_split > 0) {
    splits = (tk + c.key_split - 1) / c.key_split;
    partial.assign((size_t)b * h * splits * tq * (D + 2), 0.0f);
    p.partial = (u64)partial.data();
    p.key_split = c.key_split;
  }
  // A value term's gathered weights, for its table's gradient (the forward writes the end
  // columns, the backward the others).
  std::vector<float> value_weights;
  if (c.value_width > 0 && c.key_split == 0) {
    value_weights.assign((size_t)b * h * tq * c.value_width, 0.0f);
    p.value_weights = (u64)value_weights.data();
  }
  const unsigned tiles = c.key_split > 0 ? splits : (tq + BM - 1) / BM;
  emu::launch({tiles, (unsigned)h, (unsigned)b}, THREADS, [&] { posenc_flash_forward(p); });
  if (c.key_split > 0) {
    emu::launch({(unsigned)tq, (unsigned)h, (unsigned)b}, D,
                [&] { posenc_flash_combine(p, splits); });
  }

  // The reference, in f64.
  Result res;
  // The operand type's rounding; f32 operands: the error of three TF32 products and of f32
  // sums, and a floor for outputs near 0 as small.
  const double eps = POSENC_F32 ? 4e-6 : POSENC_BF16 ? 1.0 / 256 : 1.0 / 2048;
  const double tol_floor = POSENC_F32 ? 1e-7 : 1e-5;
  std::vector<double> s(tk), w(tk);
  // Kept for the backward, per (b, h, i, j): the weights, the raw products (for the soft
  // cap's derivative) and whether the key was seen; per (b, h, i): masked whole, the sink's weight.
  const size_t pairs = (size_t)b * h * tq * tk;
  std::vector<double> weights(pairs), raws(pairs), sink_weight((size_t)b * h * tq);
  std::vector<char> seens(pairs), masked((size_t)b * h * tq);
  for (int bi = 0; bi < b; ++bi)
    for (int hi = 0; hi < h; ++hi)
      for (int i = 0; i < tq; ++i) {
        const int hk = hi / (h / hkv);
        const i64 pos = c.first + i;
        for (int j = 0; j < tk; ++j) {
          bool seen = !(c.causal && j > pos);
          if (c.window >= 0) {
            if (c.causal) {
              if (j + c.window <= pos) seen = false;
            } else if (j + c.window < pos || j > pos + c.window) {
              seen = false;
            }
          }
          if (c.chunk > 0) {
            // Chunks counted from the sequence's first kept key (Tk when it keeps none).
            i64 left = 0;
            if (!pad.empty()) {
              left = tk;
              for (int jj = 0; jj < tk; ++jj)
                if (pad[bi * pad_stride + jj] != 0) {
                  left = jj;
                  break;
                }
            }
            const i64 c0 = left + (i64)std::floor((double)(pos - left) / c.chunk) * c.chunk;
            if (j < c0 || j >= c0 + c.chunk) seen = false;
          }
          if (!pad.empty() && pad[bi * pad_stride + j] == 0) seen = false;
          const size_t at = (((size_t)bi * h + hi) * tq + i) * tk + j;
          seens[at] = seen;
          if (!seen) {
            s[j] = -FLT_MAX;
            continue;
          }
          double x = 0.0;
          for (int d = 0; d < D; ++d) x += (double)qat(bi, hi, i, d) * kat(bi, hk, j, d);
          raws[at] = x;
          if (c.softcap > 0) x = c.softcap * std::tanh(x / c.softcap);
          for (int t = 0; t < p.n_terms; ++t) x += term_value(t, bi, hi, i, j);
          s[j] = x;
        }
        double m = c.sinks ? sinks[hi] : -INFINITY;
        for (int j = 0; j < tk; ++j) m = std::max(m, s[j]);
        double l = c.sinks ? std::exp(sinks[hi] - m) : 0.0;
        for (int j = 0; j < tk; ++j) {
          w[j] = std::exp(s[j] - m);
          l += w[j];
        }
        const size_t r0 = ((size_t)bi * h + hi) * tq + i;
        for (int j = 0; j < tk; ++j) weights[r0 * tk + j] = w[j] / l;
        masked[r0] = m == -FLT_MAX;
        sink_weight[r0] = c.sinks ? std::exp(sinks[hi] - m) / l : 0.0;
        const i64 row = (i64)bi * out_rows + c.first_row + i;
        const float* st = &stats[2 * ((size_t)(bi * h + hi) * out_rows + c.first_row + i)];
        // The maximum the kernel subtracted may differ from the reference's (tiles see the
        // keys in another order, sinks): compare the log-sum-exp, m + ln l.
        const double want_lse = m + std::log(l), got_lse = st[0] - std::log((double)st[1]);
        // A row of −∞: no log-sum-exp on either side (NaN or −∞).
        const bool neither = !std::isfinite(got_lse) && !std::isfinite(want_lse);
        if (!neither &&
            !(std::fabs(got_lse - want_lse) <= 1e-4 * std::max(1.0, std::fabs(want_lse))))
          res.bad_lse = true;
        for (int d = 0; d < D; ++d) {
          double acc = 0.0, mag = 0.0;
          for (int j = 0; j < tk; ++j) {
            const double x = vat(bi, hk, j, d);
            double a = 0.0;
            if (c.value_width > 0) {
              i64 col = j - i + c.value_shift;
              col = col < 0 ? 0 : (col >= c.value_width ? c.value_width - 1 : col);
              a = table[col * D + d];
            }
            acc += w[j] * (x + a);
            // P v and P a are summed apart (P rounded for the first): each its own rounding.
            mag += w[j] * (std::fabs(x) + std::fabs(a));
          }
          const double want = acc / l;
          const double got = elem_to_float(out[(row * h + hi) * D + d]);
          const double tol = 2 * eps * (mag / l + std::fabs(want)) + tol_floor;
          if (std::isnan(got) && std::isnan(want)) continue;
          const double e = std::fabs(got - want);
          if (!(e <= tol)) res.worst_ratio = std::max(res.worst_ratio, std::isnan(e) ? 1e9 : e / tol);
          if (!std::isnan(e)) res.err = std::max(res.err, e);
          else res.err = INFINITY;
        }
      }
  // Rows outside first_row..first_row + Tq stay as they were.
  for (int bi = 0; bi < b; ++bi)
    for (int r = 0; r < out_rows; ++r) {
      if (r >= c.first_row && r < c.first_row + tq) continue;
      for (int n = 0; n < h * D; ++n)
        if (out[((size_t)bi * out_rows + r) * h * D + n] != (elem_t)sentinel) res.stray = true;
      for (int hi = 0; hi < h; ++hi)
        if (stats[2 * ((size_t)(bi * h + hi) * out_rows + r)] != -12345.0f) res.stray = true;
    }
  res.backward = true;
  const int group = h / hkv;
  std::vector<elem_t> d_out = draw((size_t)b * tq * h * D, 1.0);  // (B, Tq, H, D)
  std::vector<float> delta((size_t)b * h * tq, -777.0f), dq((size_t)b * h * tq * D, 0.0f);
  std::vector<float> dk((size_t)b * hkv * tk * D, -777.0f), dv(dk.size(), -777.0f);
  std::vector<float> dsinks(h, 0.0f);
  // Each term's gradient, laid out as its values (sums over the axes it broadcasts); a user's
  // mask takes none, which the kernel must skip.
  std::vector<std::vector<float>> term_grads(p.n_terms);
  for (int t = 0; t < p.n_terms; ++t) {
    if (c.dense == 2 && t == 0) continue;
    term_grads[t].assign(term_store[t].size(), 0.0f);
    p.terms[t].grad = (u64)term_grads[t].data();
    for (int a = 0; a < 4; ++a) p.terms[t].grad_strides[a] = p.terms[t].strides[a];
    p.term_grads = 1;
  }
  auto dout_at = [&](int bi, int i, int hi, int d) {
    return (double)elem_to_float(d_out[(((size_t)bi * tq + i) * h + hi) * D + d]);
  };
  // A value term's dO_i · a[c] (f32, as the host's product gives it).
  const int vw = c.value_width;
  std::vector<float> value_dp((size_t)b * h * tq * std::max(vw, 1));
  for (int bi = 0; bi < b && vw > 0; ++bi)
    for (int hi = 0; hi < h; ++hi)
      for (int i = 0; i < tq; ++i)
        for (int col = 0; col < vw; ++col) {
          double x = 0.0;
          for (int d = 0; d < D; ++d) x += dout_at(bi, i, hi, d) * table[col * D + d];
          value_dp[(((size_t)bi * h + hi) * tq + i) * vw + col] = (float)x;
        }
  p.value_dp = vw > 0 ? (u64)value_dp.data() : 0;
  p.d_out = (u64)d_out.data();
  p.delta = (u64)delta.data();
  p.dq = (u64)dq.data();
  p.dk = (u64)dk.data();
  p.dv = (u64)dv.data();
  p.dsinks = c.sinks ? (u64)dsinks.data() : 0;
  const unsigned rows = (unsigned)((b * h * tq + THREADS - 1) / THREADS);
  emu::launch({rows, 1, 1}, THREADS, [&] { posenc_flash_delta(p); });
  emu::launch({(unsigned)((tk + BN - 1) / BN), (unsigned)hkv, (unsigned)b}, THREADS,
              [&] { posenc_flash_backward(p); });

  std::vector<double> rq(dq.size(), 0.0), rk(dk.size(), 0.0), rv(dv.size(), 0.0);
  std::vector<double> mq(dq.size(), 0.0), mk(dk.size(), 0.0), mv(dv.size(), 0.0);
  std::vector<double> rs(h, 0.0), ms(h, 0.0);
  std::vector<std::vector<double>> rt(p.n_terms), mt(p.n_terms);
  for (int t = 0; t < p.n_terms; ++t) {
    rt[t].assign(term_grads[t].size(), 0.0);
    mt[t].assign(term_grads[t].size(), 0.0);
  }
  std::vector<double> dpv(tk);
  std::vector<double> rw(value_weights.size(), 0.0);
  for (int bi = 0; bi < b; ++bi)
    for (int hi = 0; hi < h; ++hi)
      for (int i = 0; i < tq; ++i) {
        const int hk = hi / group;
        const size_t r0 = ((size_t)bi * h + hi) * tq + i;
        const double* pr = &weights[r0 * tk];
        double dl = 0.0, dl_mag = 0.0;
        for (int j = 0; j < tk; ++j) {
          double x = 0.0;
          i64 col = 0;
          if (vw > 0) {
            col = j - i + c.value_shift;
            col = col < 0 ? 0 : (col >= vw ? vw - 1 : col);
          }
          for (int d = 0; d < D; ++d) {
            const double a = vw > 0 ? table[col * D + d] : 0.0;
            x += dout_at(bi, i, hi, d) * (vat(bi, hk, j, d) + a);
          }
          dpv[j] = x;
          dl += pr[j] * x;
          if (!rw.empty()) rw[r0 * vw + col] += pr[j];
        }
        // δ is dO · O with O rounded to the output type.
        const i64 row = (i64)bi * out_rows + c.first_row + i;
        for (int d = 0; d < D; ++d)
          dl_mag += std::fabs(dout_at(bi, i, hi, d) * elem_to_float(out[(row * h + hi) * D + d]));
        rs[hi] -= sink_weight[r0] * dl;
        ms[hi] += sink_weight[r0] * (dl_mag + std::fabs(dl));
        for (int j = 0; j < tk; ++j) {
          const size_t at = r0 * tk + j;
          double ds = masked[r0] ? 0.0 : pr[j] * (dpv[j] - dl);
          double ds_mag = masked[r0] ? 0.0 : pr[j] * (std::fabs(dpv[j]) + dl_mag + std::fabs(dl));
          for (int t = 0; t < p.n_terms; ++t) {
            if (term_grads[t].empty() || !seens[at]) continue;
            const Term& term = p.terms[t];
            const size_t ta = bi * term.strides[0] + hi * term.strides[1] + i * term.strides[2] +
                              term_column(term, i, j) * term.strides[3];
            rt[t][ta] += ds;
            mt[t][ta] += ds_mag;
          }
          if (c.softcap > 0 && seens[at]) {
            const double t = std::tanh(raws[at] / c.softcap);
            ds *= 1.0 - t * t;
          }
          for (int d = 0; d < D; ++d) {
            const size_t qa = r0 * D + d, ka = (((size_t)bi * hkv + hk) * tk + j) * D + d;
            rq[qa] += ds * kat(bi, hk, j, d);
            mq[qa] += ds_mag * std::fabs(kat(bi, hk, j, d));
            rk[ka] += ds * qat(bi, hi, i, d);
            mk[ka] += ds_mag * std::fabs(qat(bi, hi, i, d));
            rv[ka] += pr[j] * dout_at(bi, i, hi, d);
            mv[ka] += pr[j] * std::fabs(dout_at(bi, i, hi, d));
          }
        }
      }
  // Each product reads P or dS rounded to the operand type (and δ the rounded output).
  for (size_t n = 0; n < rq.size(); ++n)
    check(dq[n], rq[n], 3 * eps * mq[n] + tol_floor, &res.grad_err, &res.grad_ratio);
  for (size_t n = 0; n < rk.size(); ++n) {
    check(dk[n], rk[n], 3 * eps * mk[n] + tol_floor, &res.grad_err, &res.grad_ratio);
    check(dv[n], rv[n], 2 * eps * mv[n] + tol_floor, &res.grad_err, &res.grad_ratio);
  }
  // A term's entries sum dS in f32 (atomically, in any order).
  for (int t = 0; t < p.n_terms; ++t)
    for (size_t n = 0; n < rt[t].size(); ++n)
      check(term_grads[t][n], rt[t][n], 3 * eps * mt[t][n] + tol_floor, &res.grad_err, &res.grad_ratio);
  if (c.sinks)
    for (int hi = 0; hi < h; ++hi)
      check(dsinks[hi], rs[hi], 3 * eps * ms[hi] + tol_floor, &res.grad_err, &res.grad_ratio);
  // The gathered weights: sums of f32 weights, every column written (0 where no key reads it).
  for (size_t n = 0; n < rw.size(); ++n)
    check(value_weights[n], rw[n], 1e-5 * rw[n] + 1e-6, &res.grad_err, &res.grad_ratio);
  return res;
}

std::vector<Case> cases() {
  std::vector<Case> all;
  auto add = [&](Case c) { all.push_back(c); };
  Case c;
  c.name = "plain, GQA 2, 100 queries";
  c.b = 2; c.h = 4; c.hkv = 2; c.tq = 100; c.tk = 100;
  add(c);
  c = Case{}; c.name = "causal, tiles skipped, a chunk at the end";
  c.b = 1; c.h = 2; c.hkv = 1; c.tq = 70; c.tk = 150; c.first = 80; c.causal = true;
  add(c);
  c = Case{}; c.name = "causal window 37"; c.tq = 130; c.tk = 130; c.causal = true; c.window = 37;
  add(c);
  c = Case{}; c.name = "causal chunks of 24, tiles skipped"; c.tq = 100; c.tk = 130;
  c.first = 30; c.causal = true; c.chunk = 24;
  add(c);
  c = Case{}; c.name = "causal chunks of 16 from each sequence's padding"; c.b = 3; c.tq = 66;
  c.tk = 66; c.causal = true; c.padding = 1; c.chunk = 16;
  add(c);
  c = Case{}; c.name = "bidirectional window 20, q token-major"; c.tq = 90; c.tk = 90;
  c.window = 20; c.token_major = true;
  add(c);
  c = Case{}; c.name = "padding per sequence (one padded whole), causal";
  c.b = 3; c.tq = 66; c.tk = 66; c.causal = true; c.padding = 1;
  add(c);
  c = Case{}; c.name = "shared padding, soft cap 5, sinks"; c.tq = 80; c.tk = 80; c.padding = 2;
  c.softcap = 5.0f; c.sinks = true;
  add(c);
  c = Case{}; c.name = "dense bias + per-head rows, causal"; c.b = 2; c.tq = 65; c.tk = 65;
  c.causal = true; c.dense = 1; c.relative = 1; c.rel_width = 130; c.rel_shift = 64;
  add(c);
  c = Case{}; c.name = "soft cap 3, per-head rows, sinks, GQA 2"; c.h = 4; c.hkv = 2;
  c.tq = 70; c.tk = 70; c.softcap = 3.0f; c.sinks = true; c.relative = 1; c.rel_width = 21;
  c.rel_shift = 10;
  add(c);
  c = Case{}; c.name = "bias per key, GQA 2, padding, causal"; c.b = 2; c.h = 4; c.hkv = 2;
  c.tq = 75; c.tk = 75; c.causal = true; c.dense = 3; c.padding = 1;
  add(c);
  c = Case{}; c.name = "learned mask, a row of -inf (NaN, no stray write)"; c.tq = 40;
  c.tk = 70; c.dense = 4;
  add(c);
  c = Case{}; c.name = "user mask with -inf + per-query rows"; c.b = 2; c.tq = 50; c.tk = 77;
  c.dense = 2; c.relative = 2; c.rel_width = 9; c.rel_shift = 4 + 27;
  add(c);
  c = Case{}; c.name = "output rows 5.. of 200"; c.tq = 64; c.tk = 64; c.first_row = 5;
  c.extra_rows = 131;
  add(c);
  c = Case{}; c.name = "decode: 1 query, split keys 128, sinks, causal"; c.b = 2; c.h = 4;
  c.hkv = 1; c.tq = 1; c.tk = 333; c.first = 332; c.causal = true; c.sinks = true;
  c.key_split = 128;
  add(c);
  c = Case{}; c.name = "decode: 2 queries, chunks of 50, split keys 64"; c.tq = 2; c.tk = 260;
  c.first = 258; c.causal = true; c.chunk = 50; c.key_split = 64;
  add(c);
  c = Case{}; c.name = "decode: 1 query, 601 keys, split keys 64, ALiBi's row per key";
  c.b = 1; c.h = 4; c.hkv = 2; c.tq = 1; c.tk = 601; c.first = 600; c.causal = true; c.dense = 5;
  c.key_split = 64;
  add(c);
  c = Case{}; c.name = "decode: 3 queries, split keys 64, per-head rows"; c.tq = 3; c.tk = 200;
  c.first = 197; c.causal = true; c.key_split = 64; c.relative = 1; c.rel_width = 17;
  c.rel_shift = 8 + 197;
  add(c);
#if POSENC_VALUES
  for (int w : {1, 2, 7, 129}) {
    c = Case{}; c.name = "value term, width " + std::to_string(w); c.b = 2; c.tq = 100;
    c.tk = 100; c.value_width = w; c.value_shift = w / 2; c.relative = 2; c.rel_width = w;
    c.rel_shift = w / 2;
    add(c);
  }
  c = Case{}; c.name = "value term, causal, decode split"; c.tq = 2; c.tk = 260; c.first = 258;
  c.causal = true; c.value_width = 9; c.value_shift = 4 + 258; c.key_split = 64;
  add(c);
  c = Case{}; c.name = "value term, padding"; c.b = 2; c.tq = 70; c.tk = 70; c.padding = 1;
  c.value_width = 7; c.value_shift = 3;
  add(c);
  c = Case{}; c.name = "value term, causal window 30, GQA 2, soft cap, sinks"; c.b = 2;
  c.h = 4; c.hkv = 2; c.tq = 130; c.tk = 130; c.causal = true; c.window = 30; c.softcap = 4.0f;
  c.sinks = true; c.value_width = 17; c.value_shift = 8;
  add(c);
  c = Case{}; c.name = "value term, 70 queries after 40 cached, Shaw's keys"; c.tq = 70;
  c.tk = 110; c.first = 40; c.causal = true; c.value_width = 11; c.value_shift = 5 + 40;
  c.relative = 2; c.rel_width = 11; c.rel_shift = 5 + 40;
  add(c);
#endif
  return all;
}

}  // namespace

int main() {
  Rng rng;
  int failures = 0;
  for (const Case& c : cases()) {
    const Result r = run(c, rng);
    const bool ok = r.worst_ratio == 0.0 && !r.stray && !r.bad_lse && r.grad_ratio == 0.0;
    char grads[64] = "";
    if (r.backward) std::snprintf(grads, sizeof grads, ", gradients %.2e", r.grad_err);
    std::printf("%s d%d %s%s: %-52s max |err| %.2e%s%s%s%s%s\n", ok ? "ok  " : "FAIL", D,
                POSENC_F32 ? "f32" : POSENC_BF16 ? "bf16" : "f16", POSENC_VALUES ? " values" : "", c.name.c_str(),
                r.err, grads, r.worst_ratio > 0 ? " (past tolerance)" : "",
                r.stray ? " (wrote outside its rows)" : "", r.bad_lse ? " (statistics)" : "",
                r.grad_ratio > 0 ? " (gradients past tolerance)" : "");
    failures += !ok;
  }
  return failures ? 1 : 0;
}
