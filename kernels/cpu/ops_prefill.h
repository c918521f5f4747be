// Prefill attention over the paged pool, flash style: a chunk's rows of one sequence, causal,
// against every slot of its context read in the pool's dtype in place (never gathered or widened
// into a copy of the context), in tiles of kChunkSlots slots with an online softmax.
//
// A task is some rows of one sequence and the query heads of one KV head: at most kChunkQueries
// query vectors, query i = row i / G, head kh * G + i % G, held transposed and pre-scaled in qt
// [D, kChunkQueries] for the whole task. Per tile of slots: each slot's keys of this KV head are
// widened once into kt (L1), the scores come out transposed, st [slot, query], as FMAs of a
// broadcast key element against kWidth queries at a time (no horizontal sums, each key element
// read once for all the task's queries); the softmax's top, rescale and sums run down the slots
// on whole vectors of queries; the values, widened into vt, go into the outputs o [query, D]
// held in registers for a few queries at a time. fp32 throughout (products, softmax, sums).
//
// Invariant: only slots below each query's own position + 1 carry weight: a later slot's score
// is -inf, which exp_fast's clamp turns into e^-87 (~1e-38) of the top's 1, below fp32's
// resolution of any sum that holds it; every query sees slot 0, so its top is finite after the
// first tile. Internal linkage only.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "ops.h"
#include "ops_attention.h"
#include "ops_vec.h"

namespace agentd_cpu {
namespace {

constexpr int kMQ = kChunkQueries;
constexpr int kTK = kChunkSlots;

#if defined(AGENTD_PREFILL_BF16)
// e^x for weights that are rounded to bfloat16 next (8 significant bits): x reduced by ln 2 to
// [-ln 2 / 2, ln 2 / 2], e^r's Taylor polynomial of degree 4 there (relative error under
// 5e-5, bf16's rounding is 2e-3), 2^n applied by vscalefps: 9 operations to vexp's ~20 (the
// 1.7B's shape, 512 rows behind 16k: ~5% of the attention). Below -87 it gives ~e^-87, as vexp.
inline __m512 vexp_bf16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147180559945f), x);
  __m512 p = _mm512_set1_ps(1.0f / 24);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
// st[t, c..c + 4 kWidth) for slots t, t + 1: kt's elements broadcast against qt's rows.
inline void scores_pair(const float* kt, const float* qt, int D, int t, int c, float* st) {
  Vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
  Vec b0 = vzero(), b1 = vzero(), b2 = vzero(), b3 = vzero();
  const float* k0 = kt + t * D;
  const float* k1 = k0 + D;
  for (int d = 0; d < D; ++d) {
    const float* q = qt + d * kMQ + c;
    const Vec q0 = vload(q), q1 = vload(q + kWidth), q2 = vload(q + 2 * kWidth),
              q3 = vload(q + 3 * kWidth);
    const Vec x = vset1(k0[d]), y = vset1(k1[d]);
    a0 = vfma(x, q0, a0), a1 = vfma(x, q1, a1), a2 = vfma(x, q2, a2), a3 = vfma(x, q3, a3);
    b0 = vfma(y, q0, b0), b1 = vfma(y, q1, b1), b2 = vfma(y, q2, b2), b3 = vfma(y, q3, b3);
  }
  float* s0 = st + t * kMQ + c;
  float* s1 = s0 + kMQ;
  vstore(s0, a0), vstore(s0 + kWidth, a1), vstore(s0 + 2 * kWidth, a2);
  vstore(s0 + 3 * kWidth, a3);
  vstore(s1, b0), vstore(s1 + kWidth, b1), vstore(s1 + 2 * kWidth, b2);
  vstore(s1 + 3 * kWidth, b3);
}

// o[i0 + r, dc..dc + NV kWidth) += sum over t < n of st[t, i0 + r] * vt[t, dc..], for r < R.
template <int R, int NV>
inline void values_block(const float* st, const float* vt, int n, int D, int i0, int dc,
                         float* o) {
  Vec acc[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) acc[r][v] = vload(o + (i0 + r) * D + dc + v * kWidth);
  }
  for (int t = 0; t < n; ++t) {
    Vec vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = vload(vt + t * D + dc + v * kWidth);
    for (int r = 0; r < R; ++r) {
      const Vec p = vset1(st[t * kMQ + i0 + r]);
      for (int v = 0; v < NV; ++v) acc[r][v] = vfma(p, vv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) vstore(o + (i0 + r) * D + dc + v * kWidth, acc[r][v]);
  }
}

template <int R, int NV = 4>
inline void values_rows(const float* st, const float* vt, int n, int D, int i0, float* o) {
  int dc = 0;
  for (; dc + NV * kWidth <= D; dc += NV * kWidth) values_block<R, NV>(st, vt, n, D, i0, dc, o);
  for (; dc + kWidth <= D; dc += kWidth) values_block<R, 1>(st, vt, n, D, i0, dc, o);
}
#endif

// The scores st [n, kMQ] of slots [t0, t1) masked (slot t is seen by the queries of rows at
// positions >= t) and turned into weights exp(score - top) under the running tops; the tops,
// the sums and the outputs o of the first M queries rescaled to them. Only the first Q >= M
// queries are scored (the task's queries rounded up to the score loops' width).
template <bool kBf16Weights = false>
inline void online_softmax(float* st, int t0, int t1, int first_pos, int G, int M, int D,
                           float* top, float* sum, float* o, int Q) {
  const int n = t1 - t0;
  for (int t = std::max(t0, first_pos + 1); t < t1; ++t) {
    const int first_query = std::min(M, (t - first_pos) * G);
    std::fill(st + (t - t0) * kMQ, st + (t - t0) * kMQ + first_query,
              -std::numeric_limits<float>::infinity());
  }
  float tile_top[kMQ];
  std::copy(top, top + Q, tile_top);
  for (int t = 0; t < n; ++t) {
    const float* s = st + t * kMQ;
    for (int i = 0; i < Q; ++i) tile_top[i] = tile_top[i] > s[i] ? tile_top[i] : s[i];
  }
  float rescale[kMQ];
  for (int i = 0; i < Q; ++i) rescale[i] = top[i] - tile_top[i];
  exp_shifted(rescale, Q, 0.0f);
  float tile_sum[kMQ] = {};
  for (int t = 0; t < n; ++t) {
    float* s = st + t * kMQ;
    int i = 0;
#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
    for (; i + kWidth <= Q; i += kWidth) {
      const Vec x = vsub(vload(s + i), vload(tile_top + i));
#if defined(AGENTD_PREFILL_BF16)
      const Vec p = kBf16Weights ? vexp_bf16(x) : vexp(x);
#else
      const Vec p = vexp(x);
#endif
      vstore(s + i, p);
      vstore(tile_sum + i, vadd(vload(tile_sum + i), p));
    }
#endif
    for (; i < Q; ++i) {
      s[i] = exp_fast(s[i] - tile_top[i]);
      tile_sum[i] += s[i];
    }
  }
  for (int i = 0; i < Q; ++i) {
    sum[i] = sum[i] * rescale[i] + tile_sum[i];
    top[i] = tile_top[i];
  }
  for (int i = 0; i < M; ++i) {
    if (rescale[i] != 1.0f) {
      for (int d = 0; d < D; ++d) o[i * D + d] *= rescale[i];
    }
  }
}

inline void write_outputs(const float* o, const float* sum, int M, int G, int kh, int D,
                          float* out, int64_t out_stride) {
  for (int i = 0; i < M; ++i) {
    float* dst = out + (i / G) * out_stride + (kh * G + i % G) * D;
    const float inv = 1.0f / sum[i];
    for (int d = 0; d < D; ++d) dst[d] = o[i * D + d] * inv;
  }
}

template <KvDtype kT>
void attend_chunk_as(const KvLayout& kv, const float* query, int64_t query_stride,
                     int num_heads, float scale, const int32_t* table, int first_pos,
                     int num_rows, int kh0, int num_kh, float* out, int64_t out_stride,
                     float* scratch) {
  const int D = kv.head_dim, G = num_heads / kv.num_kv_heads, M = num_rows * G;
  // per KV head: qt [D, kMQ] (scaled; padding queries zero), o [kMQ, D], top, sum [kMQ]
  const size_t per_head = chunk_head_floats(D);
  float* st = scratch + num_kh * per_head;  // [kTK + 1, kMQ]: scores, then weights
  float* kt = st + (kTK + 1) * kMQ;         // [kTK + 1, D] (a zero row after an odd tile)
  float* vt = kt + (kTK + 1) * D;           // [kTK, D]
  for (int j = 0; j < num_kh; ++j) {
    float* qt = scratch + j * per_head;
    std::fill(qt, qt + D * kMQ, 0.0f);
    for (int i = 0; i < M; ++i) {
      const float* src = query + (i / G) * query_stride + ((kh0 + j) * G + i % G) * D;
      for (int d = 0; d < D; ++d) qt[d * kMQ + i] = src[d] * scale;
    }
    float* o = qt + D * kMQ;
    std::fill(o, o + kMQ * D, 0.0f);
    std::fill(o + kMQ * D, o + kMQ * D + kMQ, -std::numeric_limits<float>::infinity());
    std::fill(o + kMQ * D + kMQ, o + kMQ * D + 2 * kMQ, 0.0f);
  }
  const SlotRows<kT> slot_row{kv, table};
  const int end = first_pos + num_rows;  // the last row sees slots [0, end)
  const bool vectors = kWidth > 0 && D % (kWidth > 0 ? kWidth : 1) == 0;
  // the queries scored and weighed: M rounded up to the vector score loop's 4 vectors
  constexpr int kStep = kWidth > 0 ? 4 * kWidth : 1;
  const int Q = vectors ? std::min(kMQ, (M + kStep - 1) / kStep * kStep) : kMQ;
  for (int t0 = 0; t0 < end; t0 += kTK) {
    const int t1 = std::min(end, t0 + kTK), n = t1 - t0;
    for (int j = 0; j < num_kh; ++j) {  // the heads of a slot are one row of the pool
      const int kh = kh0 + j;
      float* qt = scratch + j * per_head;
      float* o = qt + D * kMQ;
      float* top = o + kMQ * D;
      float* sum = top + kMQ;
      widen_slots<kT>(slot_row, t0, t1, 0, kh, D, kt);
      widen_slots<kT>(slot_row, t0, t1, 1, kh, D, vt);
      // scores st[t, i] = k_t . q_i
#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
      if (vectors) {
        if (n % 2) std::fill(kt + n * D, kt + (n + 1) * D, 0.0f);
        for (int c = 0; c < Q; c += 4 * kWidth) {
          for (int t = 0; t < n; t += 2) scores_pair(kt, qt, D, t, c, st);
        }
      }
#endif
      if (!vectors) {
        for (int t = 0; t < n; ++t) {
          float* s = st + t * kMQ;
          std::fill(s, s + kMQ, 0.0f);
          for (int d = 0; d < D; ++d) {
            const float k = kt[t * D + d];
            for (int i = 0; i < kMQ; ++i) s[i] += k * qt[d * kMQ + i];
          }
        }
      }
      online_softmax(st, t0, t1, first_pos, G, M, D, top, sum, o, Q);
      // o[i] += sum over t of st[t, i] * v_t
#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
      if (vectors) {
        constexpr int R = kWidth == 16 ? 4 : 6;
        constexpr int NV = kWidth == 16 ? 4 : 2;
        int i0 = 0;
        for (; i0 + R <= M; i0 += R) values_rows<R, NV>(st, vt, n, D, i0, o);
        for (; i0 < M; ++i0) values_rows<1>(st, vt, n, D, i0, o);
      }
#endif
      if (!vectors) {
        for (int t = 0; t < n; ++t) {
          for (int i = 0; i < M; ++i) axpy(o + i * D, st[t * kMQ + i], vt + t * D, D);
        }
      }
    }
  }
  for (int j = 0; j < num_kh; ++j) {
    const float* o = scratch + j * per_head + D * kMQ;
    write_outputs(o, o + kMQ * D + kMQ, M, G, kh0 + j, D, out, out_stride);
  }
}

#if defined(AGENTD_PREFILL_BF16)
// The same task with its products in bfloat16 (AVX512-BF16's vdpbf16ps: a pair of products per
// fp32 lane, twice the FMAs' rate): queries, keys, weights and values rounded to bfloat16 (to
// nearest even), each product pair summed into fp32; the softmax and every sum stay fp32.
// Pairs run along the reduced dimension: the queries' (d, d + 1) [D / 2, kMQ] against a key
// element pair broadcast; the weights' (t, t + 1) of a query broadcast against the values' [t /
// 2, D] pairs. D % 16 == 0.
inline uint32_t bf16_bits(float x) {  // round to nearest even, as vcvtneps2bf16 (finite x)
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  return (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
}

// 16 lanes of (bf16(lo), bf16(hi)) pairs, lo in the low half.
inline __m512i bf16_pairs(__m512 lo, __m512 hi) {
  const __m512i a = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(lo)));
  const __m512i b = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(hi)));
  return _mm512_or_si512(a, _mm512_slli_epi32(b, 16));
}

inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

// Scores of 64 queries (4 vectors) for S slots: st[s, 0..64) for the slots' key pairs kp
// [S, P], each pair broadcast against the queries' pairs qp [P, kMQ] from qp's first column;
// S * 4 accumulators (dot_pairs' latency hidden behind that many).
template <int S>
inline void scores_bf16(const uint32_t* kp, const uint32_t* qp, int P, float* st) {
  __m512 acc[S][4];
  for (int s = 0; s < S; ++s) {
    for (int c = 0; c < 4; ++c) acc[s][c] = _mm512_setzero_ps();
  }
  for (int p = 0; p < P; ++p) {
    const uint32_t* q = qp + p * kMQ;
    const __m512i q0 = _mm512_loadu_si512(q), q1 = _mm512_loadu_si512(q + 16),
                  q2 = _mm512_loadu_si512(q + 32), q3 = _mm512_loadu_si512(q + 48);
    for (int s = 0; s < S; ++s) {
      const __m512i x = _mm512_set1_epi32(static_cast<int>(kp[s * P + p]));
      acc[s][0] = dot_pairs(acc[s][0], q0, x), acc[s][1] = dot_pairs(acc[s][1], q1, x);
      acc[s][2] = dot_pairs(acc[s][2], q2, x), acc[s][3] = dot_pairs(acc[s][3], q3, x);
    }
  }
  for (int s = 0; s < S; ++s) {
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(st + s * kMQ + c * 16, acc[s][c]);
  }
}

template <int R, int NV>
inline void values_block_bf16(const uint32_t* pp, const uint32_t* vp, int nu, int D, int i0,
                              int dc, float* o) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_loadu_ps(o + (i0 + r) * D + dc + v * 16);
  }
  for (int u = 0; u < nu; ++u) {
    __m512i vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = _mm512_loadu_si512(vp + u * D + dc + v * 16);
    for (int r = 0; r < R; ++r) {
      const __m512i w = _mm512_set1_epi32(static_cast<int>(pp[u * kMQ + i0 + r]));
      for (int v = 0; v < NV; ++v) acc[r][v] = dot_pairs(acc[r][v], vv[v], w);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(o + (i0 + r) * D + dc + v * 16, acc[r][v]);
  }
}

template <int R>
inline void values_rows_bf16(const uint32_t* pp, const uint32_t* vp, int nu, int D, int i0,
                             float* o) {
  int dc = 0;
  for (; dc + 64 <= D; dc += 64) values_block_bf16<R, 4>(pp, vp, nu, D, i0, dc, o);
  for (; dc + 16 <= D; dc += 16) values_block_bf16<R, 1>(pp, vp, nu, D, i0, dc, o);
}

template <KvDtype kT>
void attend_chunk_bf16_as(const KvLayout& kv, const float* query, int64_t query_stride,
                          int num_heads, float scale, const int32_t* table, int first_pos,
                          int num_rows, int kh0, int num_kh, float* out, int64_t out_stride,
                          float* scratch) {
  const int D = kv.head_dim, G = num_heads / kv.num_kv_heads, M = num_rows * G, P = D / 2;
  const int64_t head_bytes = SlotRows<kT>::head_bytes(D);
  // per KV head: qp [P, kMQ] query pairs (scaled), o [kMQ, D], top, sum [kMQ]
  const size_t per_head = chunk_head_floats(D);
  float* st = scratch + num_kh * per_head;  // [kTK + 1, kMQ]
  uint32_t* kp = reinterpret_cast<uint32_t*>(st + (kTK + 1) * kMQ);  // [kTK + 1, P] key pairs
  uint32_t* vp = kp + (kTK + 1) * P;  // [kTK / 2, D] value pairs (t, t + 1)
  uint32_t* pp = vp + kTK / 2 * D;    // [kTK / 2, kMQ] weight pairs (t, t + 1)
  for (int j = 0; j < num_kh; ++j) {
    float* o = scratch + j * per_head;
    uint32_t* qp = reinterpret_cast<uint32_t*>(o + kMQ * D + 2 * kMQ);
    std::fill(qp, qp + P * kMQ, 0u);
    for (int i = 0; i < M; ++i) {
      const float* src = query + (i / G) * query_stride + ((kh0 + j) * G + i % G) * D;
      for (int p = 0; p < P; ++p) {
        qp[p * kMQ + i] = bf16_bits(src[2 * p] * scale) |
                          bf16_bits(src[2 * p + 1] * scale) << 16;
      }
    }
    std::fill(o, o + kMQ * D, 0.0f);
    std::fill(o + kMQ * D, o + kMQ * D + kMQ, -std::numeric_limits<float>::infinity());
    std::fill(o + kMQ * D + kMQ, o + kMQ * D + 2 * kMQ, 0.0f);
  }
  const SlotRows<kT> slot_row{kv, table};
  const int end = first_pos + num_rows;
  const __m512 zero = _mm512_setzero_ps();
  const int Q = std::min(kMQ, (M + 63) / 64 * 64);  // the queries scored: M rounded up to 64
  for (int t0 = 0; t0 < end; t0 += kTK) {
    const int t1 = std::min(end, t0 + kTK), n = t1 - t0, nu = (n + 1) / 2;
    for (int j = 0; j < num_kh; ++j) {  // the heads of a slot are one row of the pool
      const int64_t head = int64_t{kh0 + j} * head_bytes;
      float* o = scratch + j * per_head;
      float* top = o + kMQ * D;
      float* sum = top + kMQ;
      const uint32_t* qp = reinterpret_cast<const uint32_t*>(sum + kMQ);
      for (int pos = t0; pos < t1; ++pos) {  // keys, rounded to bf16: their element pairs
        const char* src = slot_row(pos, 0) + head;
        uint16_t* row = reinterpret_cast<uint16_t*>(kp + (pos - t0) * P);
        for (int d = 0; d < D; d += 16) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + d),
                              reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(
                                  widen_vec<kT>(src, d))));
        }
      }
      if (n % 2) std::fill(kp + n * P, kp + (n + 1) * P, 0u);
      for (int t = 0; t < n;) {  // scores st[t, i], four slots at a time (two at the end)
        const int step = t + 4 <= n ? 4 : 2;
        {  // Prefetch the next head's keys and values of these slots (after the task's last
          // head, the first head's of the next tile), spread over this head's score loop: a
          // head's part of a slot's row is a few lines a whole row apart, a stride the hardware
          // prefetchers do not follow, and at 16k tokens the bf16 products waited on it (1.7B
          // shape, 300 rows behind 16k: 126 ms a layer without, 95 ms with; the fp32 products,
          // twice the instructions, did not gain; as a helper function it gained nothing either)
          const bool last = j + 1 == num_kh;
          const int64_t next = last ? int64_t{kh0} * head_bytes : head + head_bytes;
          for (int u = 0; u < step; ++u) {
            const int pos = (last ? t1 : t0) + t + u;
            if (pos >= end) break;
            for (int which = 0; which < 2; ++which) {
              const char* src = slot_row(pos, which) + next;
              for (int64_t off = 0; off < head_bytes; off += 64) {
                _mm_prefetch(src + off, _MM_HINT_T0);
              }
            }
          }
        }
        for (int c = 0; c < Q; c += 64) {  // 64 queries (4 vectors) at a time
          if (step == 4) {
            scores_bf16<4>(kp + t * P, qp + c, P, st + t * kMQ + c);
          } else {
            scores_bf16<2>(kp + t * P, qp + c, P, st + t * kMQ + c);
          }
        }
        t += step;
      }
      online_softmax<true>(st, t0, t1, first_pos, G, M, D, top, sum, o, Q);
      for (int u = 0; u < nu; ++u) {  // value and weight pairs (t, t + 1); past the tile: 0
        const bool pair = 2 * u + 1 < n;
        const char* v0 = slot_row(t0 + 2 * u, 1) + head;
        const char* v1 = pair ? slot_row(t0 + 2 * u + 1, 1) + head : nullptr;
        for (int d = 0; d < D; d += 16) {
          _mm512_storeu_si512(vp + u * D + d, bf16_pairs(widen_vec<kT>(v0, d),
                                                         pair ? widen_vec<kT>(v1, d) : zero));
        }
        const float* w0 = st + 2 * u * kMQ;
        for (int i = 0; i < Q; i += 16) {
          _mm512_storeu_si512(pp + u * kMQ + i,
                              bf16_pairs(_mm512_loadu_ps(w0 + i),
                                         pair ? _mm512_loadu_ps(w0 + kMQ + i) : zero));
        }
      }
      int i0 = 0;
      for (; i0 + 4 <= M; i0 += 4) values_rows_bf16<4>(pp, vp, nu, D, i0, o);
      for (; i0 < M; ++i0) values_rows_bf16<1>(pp, vp, nu, D, i0, o);
    }
  }
  for (int j = 0; j < num_kh; ++j) {
    const float* o = scratch + j * per_head;
    write_outputs(o, o + kMQ * D + kMQ, M, G, kh0 + j, D, out, out_stride);
  }
}

// The kernels by pool dtype (KvDtype's order: f32, f16, bf16, q8_0).
constexpr AttendChunkFn kAttendChunkBf16[] = {
    attend_chunk_bf16_as<kKvF32>, attend_chunk_bf16_as<kKvF16>, attend_chunk_bf16_as<kKvBF16>,
    attend_chunk_bf16_as<kKvQ8>};

void attend_chunk_bf16(const KvLayout& kv, const float* query, int64_t query_stride,
                       int num_heads, float scale, const int32_t* table, int first_pos,
                       int num_rows, int kh, int num_kh, float* out, int64_t out_stride,
                       float* scratch) {
  kAttendChunkBf16[kv.dtype](kv, query, query_stride, num_heads, scale, table, first_pos,
                             num_rows, kh, num_kh, out, out_stride, scratch);
}
#endif

constexpr AttendChunkFn kAttendChunk[] = {attend_chunk_as<kKvF32>, attend_chunk_as<kKvF16>,
                                          attend_chunk_as<kKvBF16>, attend_chunk_as<kKvQ8>};

void attend_chunk(const KvLayout& kv, const float* query, int64_t query_stride, int num_heads,
                  float scale, const int32_t* table, int first_pos, int num_rows, int kh,
                  int num_kh, float* out, int64_t out_stride, float* scratch) {
  kAttendChunk[kv.dtype](kv, query, query_stride, num_heads, scale, table, first_pos, num_rows,
                         kh, num_kh, out, out_stride, scratch);
}

}  // namespace
}  // namespace agentd_cpu
