// The fused attention on CUDA (FlashAttention-2's schedule, Dao 2023), bf16 or f16 operands on
// tensor cores, f32 accumulation: the forward here, the backward further down. f32 operands
// (POSENC_F32) are computed in f32 on the same tensor cores: each m16n8k16 product below as
// three TF32 m16n8k8 products per k8 half (see mma).
//
//   for each (b, h) and each tile of BM = 64 queries i (one thread block, 4 warps × 16 rows):
//       m_i = sink_h or −∞,  l_i = 1 or 0,  acc_i = 0
//       for each tile of FBN = 64 keys J the rows can see (32 with f32 operands):
//           S = q[b, h, i] · k[b, h / r, J]ᵀ                    (mma.m16n8k16, f32)
//           S ← cap · tanh(S / cap) + Σ terms, hidden keys → −FLT_MAX
//           m_i' = max(m_i, max_j S_ij);  α_i = e^(m_i − m_i')
//           P = e^(S − m_i');  l_i ← α_i l_i + Σ_j P_ij   (P rounded to the operand type for P v)
//           acc_i ← α_i acc_i + P v[b, h / r, J]                (mma.m16n8k16, f32)
//           acc_i += Σ_j P_ij a[c(i, j)] over a value term's interior columns; the weights of its
//           two end columns summed, rescaled by α_i as l_i is, and added once at the end
//       out[b, first_row + i, h, :] = acc_i / l_i;  stats[b, h, first_row + i] = (m_i, 1 / l_i)
//
// Few queries against many keys (decoding) split the keys instead (flash-decoding): with
// key_split > 0, block x takes keys [x·key_split, (x + 1)·key_split) of the one query tile and
// writes its unnormalised acc_i, m_i and l_i to `partial`; posenc_flash_combine then merges the
// splits (M = max(sink, max_s m_s), out = Σ_s e^(m_s − M) acc_s / (e^(sink − M) + Σ_s e^(m_s − M) l_s)).
//
// A term is an f32 tensor read through four strides (batch, head, query row, key or column):
// dense (a key's column is j) or relative (column clamp(j − i + shift, 0, W − 1)), the plug's
// two forms. A key hidden by the row's rule or the padding has the logit −FLT_MAX, not −∞,
// so a row whose every key is hidden comes out uniform over the keys visited, as on the
// crate's other paths (the host visits every key whenever a row can be hidden whole). Keys
// past the end, or outside the range a tile's rows can see, are −∞ and weigh 0; so does a
// key a user's mask sets to −∞ (a row −∞ everywhere comes out NaN, as on the other paths).
//
// Specialised by the host through -D options: POSENC_HEAD_DIM (a multiple of 16, at most 128),
// POSENC_BF16 (1: bf16, 0: f16), POSENC_F32 (1: f32 operands, at the head dimensions of
// F32_HEAD_DIMS in cuda/mod.rs) and POSENC_VALUES (1: a value term is read;
// the others leave its code out, and its registers). No header is included: everything is
// inline PTX (sm_80+), except under POSENC_EMULATE (tests/cuda_emulator), which names a header
// of CPU versions of the PTX helpers.

#ifndef POSENC_HEAD_DIM
#error "POSENC_HEAD_DIM must be defined"
#endif
#ifndef POSENC_BF16
#error "POSENC_BF16 must be defined"
#endif
#ifndef POSENC_VALUES
#define POSENC_VALUES 0  // 1: the program reads a value term (Shaw's a^V)
#endif
#ifndef POSENC_F32
#define POSENC_F32 0     // 1: f32 operands
#endif

#define HEAD_DIM POSENC_HEAD_DIM
#define BM 64
// Keys per block of the backward (4 warps × 16), and per tile of the forward (FBN): 32 with
// f32 operands, whose fragments take twice the registers (the host's key splits are multiples
// of 64, so of either).
#define BN 64
#if POSENC_F32
#define FBN 32
#else
#define FBN 64
#endif
#define THREADS 128
// Shared rows padded by 8 elements (16 bytes of bf16, 32 of f32; for bf16 the 8 rows one
// ldmatrix reads fall in different banks).
#define STRIDE (HEAD_DIM + 8)
#define MAX_TERMS 4
#define NEG_MAX (-3.402823466e38f)
#define LOG2E 1.4426950408889634f

#if POSENC_BF16
#define MMA_TYPE "bf16"
#define CVT_X2 "cvt.rn.bf16x2.f32"
#define CVT_1 "cvt.rn.bf16.f32"
#else
#define MMA_TYPE "f16"
#define CVT_X2 "cvt.rn.f16x2.f32"
#define CVT_1 "cvt.rn.f16.f32"
#endif

#if POSENC_F32
typedef float elem_t;
// Two f32 operands where a 16-bit fragment register holds two halves: the same positions of
// the same fragments (see mma below).
struct alignas(8) frag_t {
  float lo, hi;
};
#else
typedef unsigned short elem_t;  // a bf16 or f16, as bits: only the tensor cores read them
typedef unsigned frag_t;        // two of them, the lower index in the low half
#endif
typedef unsigned long long u64;
typedef long long i64;
// Elements per 16-byte chunk of a row.
#define CHUNK_ELEMS (16 / (int)sizeof(elem_t))

struct alignas(16) Chunk {
  unsigned int a, b, c, d;
};

// One additive term; must match `Term` in cuda/mod.rs field for field.
struct Term {
  u64 values;     // const float*
  i64 strides[4]; // batch, head, query row, key (dense) or column (relative)
  i64 shift;      // relative: the column of (i, j) is clamp(j − i + shift, 0, width − 1)
  i64 width;      // 0: dense
  // The backward's: float*, zeroed, the term's gradient through its own strides (0 along an
  // axis the term broadcasts, so that the atomic sums run over it); 0 for none.
  u64 grad;
  i64 grad_strides[4];
};

// Everything a launch reads; must match `Params` in cuda/mod.rs field for field.
struct Params {
  u64 q, k, v;       // const elem_t*: (B, H, Tq, D), (B, Hkv, Tk, D), (B, Hkv, Tk, D)
  u64 out;           // elem_t*: (B, out_rows, H, D), contiguous
  u64 stats;         // float*: (B, H, out_rows, 2) = each row's maximum and 1 / sum; 0: none
  u64 padding;       // const unsigned char*: (B|1, Tk) rows of padding_stride; 0 for none
  u64 sinks;         // const float*: (H); 0 for none
  u64 partial;       // float*: (B, H, splits, Tq, D + 2) = acc, m, l per split (key_split > 0)
  u64 value_table;   // const float*: (W, D), a value term's rows (Shaw's a^V); 0 for none
  i64 value_shift;   // its column of (i, j): clamp(j − i + value_shift, 0, value_width − 1)
  i64 value_width;
  i64 q_strides[3];  // batch, head, row (the last axis is contiguous)
  i64 k_strides[3];
  i64 v_strides[3];
  i64 out_rows;      // rows of the merged output
  i64 first_row;     // its row of query 0
  i64 padding_stride;// elements between the padding mask's rows (0: shared)
  i64 first;         // the causal position of query 0 (query i is key first + i)
  i64 window;        // < 0: none
  i64 chunk;         // > 0: keys of the query's own chunk, counted from the leading padding
  int batch, heads, kv_group, tq, tk;
  int causal;
  int skip;          // visit only the keys some row of the tile can see
  int n_terms;
  float softcap;     // 0: none
  int key_split;     // > 0: keys per block (a multiple of 64), one query tile, partial results
  Term terms[MAX_TERMS];
  // The backward's (posenc_flash_delta, posenc_flash_backward); the forward reads none.
  u64 d_out;         // const elem_t*: (B, Tq, H, D), the output's gradient
  u64 delta;         // float*: (B, H, Tq), dO_i · O_i
  u64 dq;            // float*: (B, H, Tq, D), zeroed, accumulated atomically
  u64 dk, dv;        // float*: (B, Hkv, Tk, D), written whole
  u64 dsinks;        // float*: (H), zeroed, accumulated atomically; 0: none
  u64 value_dp;      // const float*: (B, H, Tq, W), dO_i · a[c], with a value term
  // float*: (B, H, Tq, W), zeroed, the weights each column of a value term gathers
  // (Σ P_ij over the keys j that read it), for the table's gradient; 0: none. The training
  // forward writes the two end columns, the backward the interior ones (one key each).
  u64 value_weights;
  int term_grads;    // 1: some term takes a gradient (its `grad`)
};

#ifdef POSENC_EMULATE
// tests/cuda_emulator: the helpers below computed on the CPU.
#include POSENC_EMULATE
#else
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  unsigned r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}

#if !POSENC_F32
__device__ __forceinline__ void ldsm_x4(frag_t (&r)[4], const elem_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}

__device__ __forceinline__ void ldsm_x4_trans(frag_t (&r)[4], const elem_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}

// d += a · b for a 16 × 16 A (row-major fragment), a 16 × 8 B (column-major fragment).
__device__ __forceinline__ void mma(float (&d)[4], const frag_t (&a)[4], frag_t b0,
                                    frag_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE
               ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A float rounded to the operand type.
__device__ __forceinline__ elem_t to_elem(float x) {
  elem_t r;
  asm(CVT_1 " %0, %1;" : "=h"(r) : "f"(x));
  return r;
}

// An operand-type value as a float (exact).
__device__ __forceinline__ float from_elem(elem_t x) {
#if POSENC_BF16
  return __uint_as_float((unsigned)x << 16);
#else
  float r;
  asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(x));
  return r;
#endif
}

// Two floats rounded to the operand type, `lo` in the low half.
__device__ __forceinline__ frag_t pack(float lo, float hi) {
  unsigned r;
  asm(CVT_X2 " %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
#else
// x rounded to TF32 (10 bits of mantissa, to nearest, ties away from zero), as f32 bits.
__device__ __forceinline__ unsigned tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

// d += a · b for a 16 × 8 A and an 8 × 8 B of TF32 (PTX's m16n8k8 fragments: a0..a3 =
// (g, t), (g+8, t), (g, t+4), (g+8, t+4); b0, b1 = (t, g), (t+4, g)).
__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4],
                                         const unsigned (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

#endif
#endif

#if POSENC_F32
// ldmatrix's fragments from f32 rows: each lane still names one row of one of the four 8 × 8
// matrices (lane 8m + r: row r of matrix m), and receives the two elements ldmatrix would give
// it, (l / 4, 2(l % 4)..+1) of each matrix, or with .trans (2(l % 4)..+1, l / 4). The row
// addresses go to the lanes that read them by shuffles.
__device__ __forceinline__ const elem_t* row_of(const elem_t* p, int lane) {
  return reinterpret_cast<const elem_t*>(__shfl_sync(0xffffffffu, (u64)p, lane));
}

__device__ __forceinline__ void ldsm_x4(frag_t (&r)[4], const elem_t* p) {
  const int l = threadIdx.x % 32;
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const elem_t* row = row_of(p, 8 * m + l / 4);
    r[m] = *reinterpret_cast<const frag_t*>(row + 2 * (l % 4));
  }
}

__device__ __forceinline__ void ldsm_x4_trans(frag_t (&r)[4], const elem_t* p) {
  const int l = threadIdx.x % 32;
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const elem_t* r0 = row_of(p, 8 * m + 2 * (l % 4));
    const elem_t* r1 = row_of(p, 8 * m + 2 * (l % 4) + 1);
    r[m] = frag_t{r0[l / 4], r1[l / 4]};
  }
}

// d += a · b for the 16 × 16 A and 16 × 8 B of the 16-bit mma, in f32: each operand is split,
// x = big + small with big = tf32(x) and small = tf32(x − big), and a · b is summed as
// small·big + big·small + big·big (the dropped small·small is below 2^-21 of the product,
// Markidis et al. 2018's three-product scheme). The two k8 halves of k16 each take one m16n8k8
// with k reordered: its column t is the fragment's 2t, its column t + 4 the fragment's 2t + 1
// (the lower and upper element of each pair), in A and in B alike, so the sum over k is the
// same sum.
__device__ __forceinline__ void mma(float (&d)[4], const frag_t (&a)[4], frag_t b0,
                                    frag_t b1) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const frag_t r0 = a[2 * half], r1 = a[2 * half + 1], bk = half ? b1 : b0;
    const float av[4] = {r0.lo, r1.lo, r0.hi, r1.hi};
    const float bv[2] = {bk.lo, bk.hi};
    unsigned a_big[4], a_small[4], b_big[2], b_small[2];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      a_big[e] = tf32(av[e]);
      a_small[e] = tf32(av[e] - __uint_as_float(a_big[e]));
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      b_big[e] = tf32(bv[e]);
      b_small[e] = tf32(bv[e] - __uint_as_float(b_big[e]));
    }
    mma_tf32(d, a_small, b_big);
    mma_tf32(d, a_big, b_small);
    mma_tf32(d, a_big, b_big);
  }
}

__device__ __forceinline__ elem_t to_elem(float x) { return x; }
__device__ __forceinline__ float from_elem(elem_t x) { return x; }
__device__ __forceinline__ frag_t pack(float lo, float hi) { return frag_t{lo, hi}; }
#endif

// Rows row0..row0 + n of a (rows, HEAD_DIM) matrix with `row_stride` into an n-row shared
// tile, rows past `rows` zero.
__device__ __forceinline__ void load_tile(elem_t* s, const elem_t* g, i64 row_stride, int row0,
                                          int rows, int n = BM) {
  const int chunks = HEAD_DIM / CHUNK_ELEMS;
  for (int c = threadIdx.x; c < n * chunks; c += THREADS) {
    const int r = c / chunks, cc = c % chunks;
    Chunk val = {0u, 0u, 0u, 0u};
    if (row0 + r < rows) {
      val = *reinterpret_cast<const Chunk*>(g + (i64)(row0 + r) * row_stride + cc * CHUNK_ELEMS);
    }
    *reinterpret_cast<Chunk*>(s + r * STRIDE + cc * CHUNK_ELEMS) = val;
  }
}

// The keys lo..hi that rows i0..i1 − 1 can see through the causal limit, the window and the
// chunk (no padding: chunks count from key 0), or every key when none is left (as
// RowRule::keys_seen).
__device__ __forceinline__ void keys_seen(const Params& p, i64 i0, i64 i1, i64* lo, i64* hi) {
  const i64 tk = p.tk, last = i1 - 1;
  const i64 p0 = p.first + i0, pl = p.first + last;
  i64 start = 0, end = tk;
  if (p.window >= 0) {
    if (p.causal) {
      start = p0 + 1 - p.window;
    } else {
      start = p0 - p.window;
      end = pl + p.window + 1;
    }
    if (start < 0) start = 0;
  }
  if (p.chunk > 0) {
    // The first row's chunk starts the keys (chunks are causal: the last row's chunk ends
    // past its causal limit).
    const i64 c0 = (p0 / p.chunk) * p.chunk;
    if (start < c0) start = c0;
  }
  if (p.causal && pl + 1 < end) end = pl + 1;
  if (end > tk) end = tk;
  if (start > tk) start = tk;
  if (start < end) {
    *lo = start;
    *hi = end;
  } else {
    *lo = 0;
    *hi = tk;
  }
}

// A term's column for query i and key j: j (dense) or clamp(j − i + shift, 0, width − 1).
__device__ __forceinline__ i64 term_column(const Term& term, i64 i, i64 j) {
  if (term.width == 0) return j;
  const i64 c = j - i + term.shift;
  return c < 0 ? 0 : (c >= term.width ? term.width - 1 : c);
}

// The sequence's leading padded keys (its first kept key, Tk when it keeps none) when the
// rule counts chunks from them, else 0. Every thread of the block calls it (two barriers).
__device__ __forceinline__ i64 leading_padding(const Params& p, const unsigned char* pad) {
  if (p.chunk <= 0 || !pad) return 0;
  __shared__ int s_left;
  if (threadIdx.x == 0) s_left = p.tk;
  __syncthreads();
  for (int j = threadIdx.x; j < p.tk; j += THREADS) {
    if (pad[j] != 0) {
      atomicMin(&s_left, j);
      break;
    }
  }
  __syncthreads();
  return s_left;
}

// The first key of the chunk holding position `pos`, chunks counted from the sequence's leading
// padded keys `left` (floor division: keys before it form chunks too); 0 without chunks. Once
// per row, outside the loops over keys (a 64-bit division is long).
__device__ __forceinline__ i64 chunk_start(const Params& p, i64 left, i64 pos) {
  if (p.chunk <= 0) return 0;
  const i64 d = pos - left;
  return left + (d >= 0 ? d / p.chunk : -((p.chunk - 1 - d) / p.chunk)) * p.chunk;
}

// The logit of query i (of Tq) and key j from its product x, as both kernels see it: −∞ for a
// key past the end or outside the keys [lo, hi) its tile visits (weight 0); −FLT_MAX for a key
// the row's rule or the padding hides; otherwise the soft cap, then the terms. `c0`: the first
// key of the row's chunk (chunk_start).
__device__ __forceinline__ float logit(const Params& p, const unsigned char* pad, i64 c0, int b,
                                       int h, i64 i, i64 j, float x, i64 lo, i64 hi) {
  if (j >= p.tk || (p.skip && (j < lo || j >= hi))) return -__int_as_float(0x7f800000);
  const i64 pos = p.first + i;
  bool seen = true;
  if (p.causal && j > pos) seen = false;
  if (p.window >= 0) {
    if (p.causal) {
      if (j + p.window <= pos) seen = false;
    } else if (j + p.window < pos || j > pos + p.window) {
      seen = false;
    }
  }
  if (p.chunk > 0 && (j < c0 || j >= c0 + p.chunk)) seen = false;
  if (pad && pad[j] == 0) seen = false;
  if (!seen) return NEG_MAX;
  if (p.softcap > 0.0f) x = p.softcap * tanhf(x / p.softcap);
  if (i < p.tq) {
    for (int t = 0; t < p.n_terms; ++t) {
      const Term& term = p.terms[t];
      const float* vals = reinterpret_cast<const float*>(term.values);
      x += vals[b * term.strides[0] + h * term.strides[1] + i * term.strides[2] +
                term_column(term, i, j) * term.strides[3]];
    }
  }
  return x;
}

// With a value term at head dimension 64 and 96, and with f32 operands (twice the registers per
// fragment, and the split of each into two TF32 parts), ptxas's default (three blocks per
// multiprocessor) spills; one block at least lets it take the registers it needs.
#if POSENC_F32 || (POSENC_VALUES && (HEAD_DIM == 64 || HEAD_DIM == 96))
#define FORWARD_BOUNDS __launch_bounds__(THREADS, 1)
#else
#define FORWARD_BOUNDS __launch_bounds__(THREADS)
#endif
extern "C" __global__ void FORWARD_BOUNDS posenc_flash_forward(const Params p) {
  alignas(16) __shared__ elem_t s_qk[BM * STRIDE];  // the query tile, then each key tile
  alignas(16) __shared__ elem_t s_v[FBN * STRIDE];

  const bool split = p.key_split > 0;
  const int b = blockIdx.z, h = blockIdx.y, q0 = split ? 0 : blockIdx.x * BM;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t4 = lane % 4;
  const int hk = h / p.kv_group;
  const elem_t* qb = reinterpret_cast<const elem_t*>(p.q) + b * p.q_strides[0] + h * p.q_strides[1];
  const elem_t* kb = reinterpret_cast<const elem_t*>(p.k) + b * p.k_strides[0] + hk * p.k_strides[1];
  const elem_t* vb = reinterpret_cast<const elem_t*>(p.v) + b * p.v_strides[0] + hk * p.v_strides[1];

  load_tile(s_qk, qb, p.q_strides[2], q0, p.tq);
  __syncthreads();
  frag_t qf[HEAD_DIM / 16][4];
#pragma unroll
  for (int kc = 0; kc < HEAD_DIM / 16; ++kc) {
    ldsm_x4(qf[kc], s_qk + (warp * 16 + lane % 16) * STRIDE + kc * 16 + (lane / 16) * 8);
  }

  // This thread's two rows (block-local query indices).
  const int rows[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  const float sink = p.sinks ? reinterpret_cast<const float*>(p.sinks)[h] : 0.0f;
  // With split keys the combining kernel counts the sink, once.
  const bool sinks = p.sinks && !split;
  float m[2], l[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    m[r] = sinks ? sink : -__int_as_float(0x7f800000);
    l[r] = (sinks && t4 == 0) ? 1.0f : 0.0f;  // the sink's e^0, counted once per row
  }
  float o[HEAD_DIM / 8][4];
#pragma unroll
  for (int n = 0; n < HEAD_DIM / 8; ++n) {
    o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  }

  // The keys the tile's rows can see (every key unless `skip`), and the ones this block visits:
  // with split keys, its own split's (whole tiles: key_split is a multiple of FBN).
  i64 seen_lo = 0, seen_hi = p.tk;
  if (p.skip) {
    const i64 i1 = (q0 + BM < p.tq) ? q0 + BM : p.tq;
    keys_seen(p, q0, i1, &seen_lo, &seen_hi);
  }
  i64 lo = seen_lo, hi = seen_hi;
  if (split) {
    const i64 s0 = (i64)blockIdx.x * p.key_split;
    lo = lo > s0 ? lo : s0;
    hi = hi < s0 + p.key_split ? hi : s0 + p.key_split;
  }
#if POSENC_VALUES
  // A value term: the weights of its two end columns (every key past them reads them).
  const float* table = reinterpret_cast<const float*>(p.value_table);
  const i64 vw = p.value_width;
  float edge_lo[2] = {0.0f, 0.0f}, edge_hi[2] = {0.0f, 0.0f};
#endif
  const unsigned char* pad =
      p.padding ? reinterpret_cast<const unsigned char*>(p.padding) + b * p.padding_stride : 0;
  const i64 left = leading_padding(p, pad);
  const i64 c0s[2] = {chunk_start(p, left, p.first + rows[0]),
                      chunk_start(p, left, p.first + rows[1])};

  for (i64 k0 = (lo / FBN) * FBN; k0 < hi; k0 += FBN) {
    __syncthreads();  // every warp is done with the last tile (and with the query tile)
    load_tile(s_qk, kb, p.k_strides[2], (int)k0, p.tk, FBN);
    load_tile(s_v, vb, p.v_strides[2], (int)k0, p.tk, FBN);
    __syncthreads();

    float s[FBN / 8][4];
#pragma unroll
    for (int n = 0; n < FBN / 8; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
    }
#pragma unroll
    for (int kc = 0; kc < HEAD_DIM / 16; ++kc) {
#pragma unroll
      for (int np = 0; np < FBN / 16; ++np) {
        frag_t bk[4];
        ldsm_x4(bk, s_qk + (np * 16 + lane % 8 + (lane / 16) * 8) * STRIDE + kc * 16 +
                        ((lane / 8) % 2) * 8);
        mma(s[2 * np], qf[kc], bk[0], bk[1]);
        mma(s[2 * np + 1], qf[kc], bk[2], bk[3]);
      }
    }

    // Soft cap, terms and masks, then the running maximum of each row.
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int n = 0; n < FBN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float x = logit(p, pad, c0s[e / 2], b, h, rows[e / 2],
                              k0 + n * 8 + 2 * t4 + (e & 1), s[n][e], seen_lo, seen_hi);
        s[n][e] = x;
        mx[e / 2] = fmaxf(mx[e / 2], x);
      }
    }
    // The maximum the exponents subtract: 0 while a row has seen only −∞ (no NaN from −∞ − −∞;
    // its weights are then 0, and a later tile's finite maximum scales them away).
    float ms[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      ms[r] = mx[r] == -__int_as_float(0x7f800000) ? 0.0f : mx[r];
      const float alpha = exp2f((m[r] - ms[r]) * LOG2E);
      m[r] = mx[r];
      l[r] *= alpha;
#if POSENC_VALUES
      edge_lo[r] *= alpha;
      edge_hi[r] *= alpha;
#endif
#pragma unroll
      for (int n = 0; n < HEAD_DIM / 8; ++n) {
        o[n][2 * r] *= alpha;
        o[n][2 * r + 1] *= alpha;
      }
    }
#pragma unroll
    for (int n = 0; n < FBN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pe = exp2f((s[n][e] - ms[e / 2]) * LOG2E);
        l[e / 2] += pe;
        s[n][e] = pe;
      }
    }

    // A value term: acc_i += P_ij a[c] for the interior columns 0 < c < W − 1, one key at a
    // time (each broadcast from the thread of the quad that holds it to the quad, which holds
    // the row's features), on the tiles that reach them; the end columns' weights summed
    // (c ≤ 0 at the first, c ≥ W − 1 at the last; one column, W = 1, is the first).
#if POSENC_VALUES
    if (table) {
#pragma unroll
      for (int n = 0; n < FBN / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const i64 c = k0 + n * 8 + 2 * t4 + (e & 1) - rows[e / 2] + p.value_shift;
          if (c <= 0) {
            edge_lo[e / 2] += s[n][e];
          } else if (c >= vw - 1) {
            edge_hi[e / 2] += s[n][e];
          }
        }
      }
      // The keys j of some row's interior: q0 − shift < j < q0 + BM − 1 − shift + W − 1.
      const i64 first = q0 - p.value_shift, last = q0 + BM - 2 - p.value_shift + vw;
      if (vw > 2 && k0 + FBN > first + 1 && k0 < last) {  // W ≤ 2: no interior column
        // Unrolled: S stays in registers only when every index into it is a constant.
#pragma unroll
        for (int n = 0; n < FBN / 8; ++n) {
#pragma unroll
          for (int kk = 0; kk < 8; ++kk) {
            const i64 j = k0 + n * 8 + kk;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const float pv = __shfl_sync(0xffffffffu, s[n][2 * r + (kk & 1)],
                                           (lane & ~3) | (kk >> 1));
              const i64 c = j - rows[r] + p.value_shift;
              if (c > 0 && c < vw - 1 && pv != 0.0f) {
                const float* a = table + c * HEAD_DIM + 2 * t4;
#pragma unroll
                for (int dn = 0; dn < HEAD_DIM / 8; ++dn) {
                  o[dn][2 * r] += pv * a[dn * 8];
                  o[dn][2 * r + 1] += pv * a[dn * 8 + 1];
                }
              }
            }
          }
        }
      }
    }
#endif

    // acc += P v: two key tiles of S make one 16 × 16 operand.
#pragma unroll
    for (int kc = 0; kc < FBN / 16; ++kc) {
      const frag_t a[4] = {pack(s[2 * kc][0], s[2 * kc][1]), pack(s[2 * kc][2], s[2 * kc][3]),
                             pack(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                             pack(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
      for (int dp = 0; dp < HEAD_DIM / 16; ++dp) {
        frag_t bv[4];
        ldsm_x4_trans(bv, s_v + (kc * 16 + lane % 8 + ((lane / 8) % 2) * 8) * STRIDE + dp * 16 +
                              (lane / 16) * 8);
        mma(o[2 * dp], a, bv[0], bv[1]);
        mma(o[2 * dp + 1], a, bv[2], bv[3]);
      }
    }
  }

  elem_t* out = reinterpret_cast<elem_t*>(p.out);
  float* stats = reinterpret_cast<float*>(p.stats);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
#if POSENC_VALUES
    if (table) {
      // The end columns' weights, summed over the quad, times their rows.
      float w_lo = edge_lo[r], w_hi = edge_hi[r];
      w_lo += __shfl_xor_sync(0xffffffffu, w_lo, 1);
      w_lo += __shfl_xor_sync(0xffffffffu, w_lo, 2);
      w_hi += __shfl_xor_sync(0xffffffffu, w_hi, 1);
      w_hi += __shfl_xor_sync(0xffffffffu, w_hi, 2);
      edge_lo[r] = w_lo;
      edge_hi[r] = w_hi;
      const float* a0 = table + 2 * t4;
      const float* a1 = table + (vw - 1) * HEAD_DIM + 2 * t4;
#pragma unroll
      for (int dn = 0; dn < HEAD_DIM / 8; ++dn) {
        o[dn][2 * r] += w_lo * a0[dn * 8] + w_hi * a1[dn * 8];
        o[dn][2 * r + 1] += w_lo * a0[dn * 8 + 1] + w_hi * a1[dn * 8 + 1];
      }
    }
#endif
    const i64 i = rows[r];
    if (i >= p.tq) continue;
    if (split) {
      float* dst = reinterpret_cast<float*>(p.partial) +
                   ((((i64)b * p.heads + h) * gridDim.x + blockIdx.x) * p.tq + i) * (HEAD_DIM + 2);
#pragma unroll
      for (int n = 0; n < HEAD_DIM / 8; ++n) {
        dst[n * 8 + 2 * t4] = o[n][2 * r];
        dst[n * 8 + 2 * t4 + 1] = o[n][2 * r + 1];
      }
      if (t4 == 0) {
        dst[HEAD_DIM] = m[r];
        dst[HEAD_DIM + 1] = l[r];
      }
      continue;
    }
    const float inv = 1.0f / l[r];
    const i64 row = (i64)b * p.out_rows + p.first_row + i;
    elem_t* dst = out + (row * p.heads + h) * HEAD_DIM + 2 * t4;
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; ++n) {
      *reinterpret_cast<frag_t*>(dst + n * 8) = pack(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
    }
#if POSENC_VALUES
    if (table && p.value_weights && t4 == 0) {
      // The end columns' weights, for the backward (one column: both ends are it).
      float* wts = reinterpret_cast<float*>(p.value_weights) +
                   (((i64)b * p.heads + h) * p.tq + i) * vw;
      wts[0] = (vw == 1 ? edge_lo[r] + edge_hi[r] : edge_lo[r]) * inv;
      if (vw > 1) wts[vw - 1] = edge_hi[r] * inv;
    }
#endif
    if (stats && t4 == 0) {
      // The maximum the exponents subtracted (0 for a row of −∞ only).
      float* st = stats + 2 * (((i64)b * p.heads + h) * p.out_rows + p.first_row + i);
      st[0] = m[r] == -__int_as_float(0x7f800000) ? 0.0f : m[r];
      st[1] = inv;
    }
  }
}

// Merges the splits of posenc_flash_forward's split keys: one thread block per (query, head,
// sequence), one thread per feature.
extern "C" __global__ void __launch_bounds__(HEAD_DIM) posenc_flash_combine(const Params p,
                                                                          int splits) {
  const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z, d = threadIdx.x;
  const float neg_inf = -__int_as_float(0x7f800000);
  const i64 stride = (i64)p.tq * (HEAD_DIM + 2);
  const float* part = reinterpret_cast<const float*>(p.partial) +
                      (((i64)b * p.heads + h) * splits * p.tq + i) * (HEAD_DIM + 2);
  const float* sinks = reinterpret_cast<const float*>(p.sinks);
  float mx = sinks ? sinks[h] : neg_inf;
  for (int s = 0; s < splits; ++s) mx = fmaxf(mx, part[s * stride + HEAD_DIM]);
  const float ms = mx == neg_inf ? 0.0f : mx;  // every split −∞: weights 0, the output NaN
  float l = sinks ? exp2f((sinks[h] - ms) * LOG2E) : 0.0f;
  float acc = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const float* q = part + s * stride;
    const float w = exp2f((q[HEAD_DIM] - ms) * LOG2E);
    l += w * q[HEAD_DIM + 1];
    acc += w * q[d];
  }
  const i64 row = (i64)b * p.out_rows + p.first_row + i;
  reinterpret_cast<elem_t*>(p.out)[(row * p.heads + h) * HEAD_DIM + d] = to_elem(acc / l);
  if (p.stats && d == 0) {
    float* st = reinterpret_cast<float*>(p.stats) +
                2 * (((i64)b * p.heads + h) * p.out_rows + p.first_row + i);
    st[0] = ms;
    st[1] = 1.0f / l;
  }
}

// ---------------------------------------------------------------------------------------------
// The backward (FlashAttention-2's, Dao 2023): gradients to q, k and v, to the sinks, to each
// term that learns and to a value term's table; every term, mask, window and soft cap as the
// forward reads them.
//
//   δ_i = dO_i · O_i                                              (posenc_flash_delta)
//   for each (b, KV head, tile of BN = 64 keys J) (one thread block; warp w owns 16 keys):
//       for each head h of the group, each tile of BQ = 64 (32 above d64 and for f32) queries I that can
//       see J:
//           Sᵀ = k_J q_Iᵀ, then the logits as the forward's; Pᵀ = e^(S − m_i) / l_i (saved stats)
//           dPᵀ = v_J dO_Iᵀ, plus dO_i · a[c(i, j)] with a value term (read from value_dp,
//           one product on the host);  dSᵀ = Pᵀ ∘ (dPᵀ − δ_I) (0 for a row masked whole),
//           times the soft cap's derivative 1 − tanh²(s / cap)
//           dV_J += Pᵀ dO_I;  dK_J += dSᵀ q_I;  dQ_I += dS k_J (atomically, f32)
//           d term[b, h, i, c(i, j)] += dS_ij before the soft cap's derivative (atomically,
//           f32, summed over the axes the term broadcasts), for each term that takes one
//           value_weights[b, h, i, c(i, j)] = P_ij for a value term's interior columns (one key
//           each: a plain store); the forward wrote the end columns. The table's gradient,
//           da_c = Σ_{b, h, i} value_weights[b, h, i, c] dO_i, is one product on the host.
//
// The products of Pᵀ and dSᵀ read them rounded to the operand type, as the forward's P v does
// (f32 operands: unrounded, each product as three TF32 ones).
// ---------------------------------------------------------------------------------------------
// δ per (b, h, i), one thread each; with sinks, d sink_h = −Σ_{b, i} p_sink δ_i.
extern "C" __global__ void __launch_bounds__(THREADS) posenc_flash_delta(const Params p) {
  const i64 r = (i64)blockIdx.x * THREADS + threadIdx.x;  // over (B, H, Tq)
  if (r >= (i64)p.batch * p.heads * p.tq) return;
  const i64 i = r % p.tq, h = (r / p.tq) % p.heads, b = r / ((i64)p.tq * p.heads);
  const elem_t* d_out =
      reinterpret_cast<const elem_t*>(p.d_out) + ((b * p.tq + i) * p.heads + h) * HEAD_DIM;
  const elem_t* out = reinterpret_cast<const elem_t*>(p.out) +
                      ((b * p.out_rows + p.first_row + i) * p.heads + h) * HEAD_DIM;
  float acc = 0.0f;
  for (int d = 0; d < HEAD_DIM; ++d) acc += from_elem(d_out[d]) * from_elem(out[d]);
  reinterpret_cast<float*>(p.delta)[r] = acc;
  if (p.dsinks && p.sinks) {
    const float* st =
        reinterpret_cast<const float*>(p.stats) + 2 * ((b * p.heads + h) * p.out_rows + p.first_row + i);
    const float sink = reinterpret_cast<const float*>(p.sinks)[h];
    atomicAdd(reinterpret_cast<float*>(p.dsinks) + h, -exp2f((sink - st[0]) * LOG2E) * st[1] * acc);
  }
}

// A logit's gradient ds (the soft cap's derivative not yet applied: the terms are added after
// the cap) into the gradient of each term that takes one, at the entry the logit read.
// Entries are summed atomically in f32, in no fixed order. Called by every lane of a warp
// together, for 32 consecutive queries of one key: a dense term shared by every query (one
// entry per key, as ALiBi's per-key form) is summed over the warp first, one atomic per warp
// instead of 32 on one address; the other terms' lanes read distinct entries.
__device__ __forceinline__ void add_term_grads(const Params& p, int b, int h, i64 i, i64 j,
                                               float ds) {
#pragma unroll 1
  for (int t = 0; t < p.n_terms; ++t) {
    const Term& term = p.terms[t];
    if (!term.grad) continue;
    const i64* gs = term.grad_strides;
    float* g = reinterpret_cast<float*>(term.grad) + b * gs[0] + h * gs[1];
    if (term.width == 0 && gs[2] == 0) {
      float sum = ds;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      if (threadIdx.x % 32 == 0 && sum != 0.0f) atomicAdd(g + j * gs[3], sum);
    } else if (ds != 0.0f) {
      atomicAdd(g + i * gs[2] + term_column(term, i, j) * gs[3], ds);
    }
  }
}

// dS is kept transposed (keys × queries) in the dO tile's place once dO is read.
// Queries per tile of the backward: 64, or 32 above head dimension 64 and with f32 operands,
// where three tiles of 64 rows would pass the 48 KB of static shared memory (and f32 fragments
// the registers). The keys each query tile visits are those its forward tile of BM rows visited.
#if HEAD_DIM > 64 || POSENC_F32
#define BQ 32
#else
#define BQ 64
#endif
// dQ's products: QG groups of 16 queries, each warp one group and 1 / FS of the features.
#define QG (BQ / 16)
#define FS (4 / QG)
#define DS_STRIDE (BQ + 8)
#define DO_ELEMS (BQ * STRIDE > BN * DS_STRIDE ? BQ * STRIDE : BN * DS_STRIDE)

extern "C" __global__ void __launch_bounds__(THREADS) posenc_flash_backward(const Params p) {
  alignas(16) __shared__ elem_t s_k[BN * STRIDE];  // the key tile (and, first, the values')
  alignas(16) __shared__ elem_t s_q[BQ * STRIDE];
  alignas(16) __shared__ elem_t s_do[DO_ELEMS];    // dO, then dSᵀ
  __shared__ float s_m[BQ], s_inv[BQ], s_delta[BQ];
  __shared__ i64 s_c0[BQ];  // each query's chunk start (chunk_start)
  // The logits' gradients before the soft cap's derivative (keys × queries), for the terms'.
  __shared__ float s_dst[BN * BQ];

  const int b = blockIdx.z, hk = blockIdx.y;
  const i64 k0 = (i64)blockIdx.x * BN;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t4 = lane % 4;
  const elem_t* kb = reinterpret_cast<const elem_t*>(p.k) + b * p.k_strides[0] + hk * p.k_strides[1];
  const elem_t* vb = reinterpret_cast<const elem_t*>(p.v) + b * p.v_strides[0] + hk * p.v_strides[1];
  const unsigned char* pad =
      p.padding ? reinterpret_cast<const unsigned char*>(p.padding) + b * p.padding_stride : 0;
  const i64 left = leading_padding(p, pad);

  // This warp's 16 value rows, as A fragments for dPᵀ = v dOᵀ, kept in registers.
  load_tile(s_k, vb, p.v_strides[2], (int)k0, p.tk);
  __syncthreads();
  frag_t vf[HEAD_DIM / 16][4];
#pragma unroll
  for (int kc = 0; kc < HEAD_DIM / 16; ++kc) {
    ldsm_x4(vf[kc], s_k + (warp * 16 + lane % 16) * STRIDE + kc * 16 + (lane / 16) * 8);
  }
  __syncthreads();
  load_tile(s_k, kb, p.k_strides[2], (int)k0, p.tk);

  float dk[HEAD_DIM / 8][4], dv[HEAD_DIM / 8][4];
#pragma unroll
  for (int n = 0; n < HEAD_DIM / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.0f;
  }
  // This thread's two keys (block-local rows of the key tile).
  const int keys[2] = {warp * 16 + g, warp * 16 + g + 8};
  const float* stats = reinterpret_cast<const float*>(p.stats);
  const float* delta = reinterpret_cast<const float*>(p.delta);
  float* dq = reinterpret_cast<float*>(p.dq);

  for (int gi = 0; gi < p.kv_group; ++gi) {
    const int h = hk * p.kv_group + gi;
    const elem_t* qb = reinterpret_cast<const elem_t*>(p.q) + b * p.q_strides[0] + h * p.q_strides[1];
    const elem_t* dob = reinterpret_cast<const elem_t*>(p.d_out) + ((i64)b * p.tq * p.heads + h) * HEAD_DIM;
    for (int q0 = 0; q0 < p.tq; q0 += BQ) {
      // The keys the forward's tile of these queries visited.
      i64 seen_lo = 0, seen_hi = p.tk;
      if (p.skip) {
        const int f0 = (q0 / BM) * BM;
        keys_seen(p, f0, f0 + BM < p.tq ? f0 + BM : p.tq, &seen_lo, &seen_hi);
        if (seen_hi <= k0 || seen_lo >= k0 + BN) continue;
      }
      __syncthreads();  // every warp is done with the last query tile (and dSᵀ)
      load_tile(s_q, qb, p.q_strides[2], q0, p.tq, BQ);
      load_tile(s_do, dob, (i64)p.heads * HEAD_DIM, q0, p.tq, BQ);
      for (int r = threadIdx.x; r < BQ; r += THREADS) {
        const i64 i = q0 + r;
        const i64 row = ((i64)b * p.heads + h) * p.out_rows + p.first_row + i;
        s_m[r] = i < p.tq ? stats[2 * row] : 0.0f;
        s_inv[r] = i < p.tq ? stats[2 * row + 1] : 0.0f;
        s_delta[r] = i < p.tq ? delta[((i64)b * p.heads + h) * p.tq + i] : 0.0f;
        s_c0[r] = chunk_start(p, left, p.first + i);
      }
      __syncthreads();

      // Sᵀ = k q_Iᵀ: this warp's 16 keys × the tile's 64 queries.
      float st[BQ / 8][4], dpt[BQ / 8][4];
#pragma unroll
      for (int n = 0; n < BQ / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.0f;
      }
#pragma unroll
      for (int kc = 0; kc < HEAD_DIM / 16; ++kc) {
        frag_t ka[4];
        ldsm_x4(ka, s_k + (warp * 16 + lane % 16) * STRIDE + kc * 16 + (lane / 16) * 8);
#pragma unroll
        for (int np = 0; np < BQ / 16; ++np) {
          frag_t bq[4], bd[4];
          const int at = (np * 16 + lane % 8 + (lane / 16) * 8) * STRIDE + kc * 16 + ((lane / 8) % 2) * 8;
          ldsm_x4(bq, s_q + at);
          ldsm_x4(bd, s_do + at);
          mma(st[2 * np], ka, bq[0], bq[1]);
          mma(st[2 * np + 1], ka, bq[2], bq[3]);
          mma(dpt[2 * np], vf[kc], bd[0], bd[1]);
          mma(dpt[2 * np + 1], vf[kc], bd[2], bd[3]);
        }
      }
      // Pᵀ from the logits and the forward's statistics; dSᵀ = Pᵀ ∘ (dPᵀ − δ).
#pragma unroll
      for (int n = 0; n < BQ / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qc = n * 8 + 2 * t4 + (e & 1);
          const i64 i = q0 + qc, j = k0 + keys[e / 2];
          const float raw = st[n][e];
          const float x = logit(p, pad, s_c0[qc], b, h, i, j, raw, seen_lo, seen_hi);
          float pe = 0.0f, ds = 0.0f;
          if (i < p.tq) {
            pe = exp2f((x - s_m[qc]) * LOG2E) * s_inv[qc];
            float dp = dpt[n][e];
#if POSENC_VALUES
            if (p.value_dp) {
              // A value term: dO_i · a[c] joins dP_ij; P_ij is its column's weight when the
              // column is interior (read by this key alone).
              const i64 vw = p.value_width, c = j - i + p.value_shift;
              const i64 row = (((i64)b * p.heads + h) * p.tq + i) * vw;
              dp += reinterpret_cast<const float*>(p.value_dp)[row + (c < 0 ? 0 : c < vw ? c : vw - 1)];
              if (p.value_weights && c > 0 && c < vw - 1 && j < p.tk)
                reinterpret_cast<float*>(p.value_weights)[row + c] = pe;
            }
#endif
            // A row masked whole has constant weights: no gradient to its logits.
            if (s_m[qc] != NEG_MAX) ds = pe * (dp - s_delta[qc]);
          }
          // Every entry, 0 past the last query or key (where a row of −∞ or a non-finite dO
          // could make ds NaN): the terms' pass reads the whole tile.
          if (p.term_grads) s_dst[keys[e / 2] * BQ + qc] = j < p.tk ? ds : 0.0f;
          if (p.softcap > 0.0f && ds != 0.0f) {
            const float t = tanhf(raw / p.softcap);
            ds *= 1.0f - t * t;
          }
          st[n][e] = pe;
          dpt[n][e] = ds;
        }
      }
      // dV += Pᵀ dO and dK += dSᵀ q: two query blocks of 8 make one 16 × 16 A operand.
#pragma unroll
      for (int kc = 0; kc < BQ / 16; ++kc) {
        const frag_t pa[4] = {pack(st[2 * kc][0], st[2 * kc][1]), pack(st[2 * kc][2], st[2 * kc][3]),
                                pack(st[2 * kc + 1][0], st[2 * kc + 1][1]),
                                pack(st[2 * kc + 1][2], st[2 * kc + 1][3])};
        const frag_t sa[4] = {pack(dpt[2 * kc][0], dpt[2 * kc][1]),
                                pack(dpt[2 * kc][2], dpt[2 * kc][3]),
                                pack(dpt[2 * kc + 1][0], dpt[2 * kc + 1][1]),
                                pack(dpt[2 * kc + 1][2], dpt[2 * kc + 1][3])};
#pragma unroll
        for (int dp = 0; dp < HEAD_DIM / 16; ++dp) {
          frag_t bd[4], bq[4];
          const int at = (kc * 16 + lane % 8 + ((lane / 8) % 2) * 8) * STRIDE + dp * 16 + (lane / 16) * 8;
          ldsm_x4_trans(bd, s_do + at);
          ldsm_x4_trans(bq, s_q + at);
          mma(dv[2 * dp], pa, bd[0], bd[1]);
          mma(dv[2 * dp + 1], pa, bd[2], bd[3]);
          mma(dk[2 * dp], sa, bq[0], bq[1]);
          mma(dk[2 * dp + 1], sa, bq[2], bq[3]);
        }
      }
      __syncthreads();  // every warp is done with dO: its place takes dSᵀ
#pragma unroll
      for (int n = 0; n < BQ / 8; ++n) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          *reinterpret_cast<frag_t*>(s_do + keys[r] * DS_STRIDE + n * 8 + 2 * t4) =
              pack(dpt[n][2 * r], dpt[n][2 * r + 1]);
        }
      }
      __syncthreads();
      // dQ += dS k for this warp's 16 queries and share of the features: dS read transposed
      // from dSᵀ.
      const int qg = warp % QG, fs = warp / QG;
      frag_t da[BN / 16][4];
#pragma unroll
      for (int kc = 0; kc < BN / 16; ++kc) {
        ldsm_x4_trans(da[kc], s_do + (kc * 16 + lane % 8 + (lane / 16) * 8) * DS_STRIDE + qg * 16 +
                                  ((lane / 8) % 2) * 8);
      }
#pragma unroll
      for (int dp = fs * (HEAD_DIM / 16 / FS); dp < (fs + 1) * (HEAD_DIM / 16 / FS); ++dp) {
        float c0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, c1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int kc = 0; kc < BN / 16; ++kc) {
          frag_t bk[4];
          ldsm_x4_trans(bk, s_k + (kc * 16 + lane % 8 + ((lane / 8) % 2) * 8) * STRIDE + dp * 16 +
                                (lane / 16) * 8);
          mma(c0, da[kc], bk[0], bk[1]);
          mma(c1, da[kc], bk[2], bk[3]);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const i64 i = q0 + qg * 16 + g + 8 * (e / 2);
          if (i >= p.tq) continue;
          float* row = dq + (((i64)b * p.heads + h) * p.tq + i) * HEAD_DIM + dp * 16 + 2 * t4 + (e & 1);
          atomicAdd(row, c0[e]);
          atomicAdd(row + 8, c1[e]);
        }
      }
      // The terms' gradients, from the tile's dS (complete since the barriers above), one
      // entry per thread in turn: consecutive threads take consecutive queries of a key, and
      // a warp's 32 lanes one key (BQ is a multiple of 32), every lane through every step.
      if (p.term_grads) {
        for (int n = threadIdx.x; n < BN * BQ; n += THREADS) {
          add_term_grads(p, b, h, q0 + n % BQ, k0 + n / BQ, s_dst[n]);
        }
      }
    }
  }
  // This block's keys of dK and dV, written whole.
  float* dkb = reinterpret_cast<float*>(p.dk) + (((i64)b * (p.heads / p.kv_group) + hk) * p.tk) * HEAD_DIM;
  float* dvb = reinterpret_cast<float*>(p.dv) + (((i64)b * (p.heads / p.kv_group) + hk) * p.tk) * HEAD_DIM;
#pragma unroll
  for (int n = 0; n < HEAD_DIM / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const i64 j = k0 + keys[e / 2];
      if (j >= p.tk) continue;
      const i64 at = j * HEAD_DIM + n * 8 + 2 * t4 + (e & 1);
      dkb[at] = dk[n][e];
      dvb[at] = dv[n][e];
    }
  }
}
