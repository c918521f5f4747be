// The fused decode-step operations of ops.h, written once and compiled per ISA: the including
// file sets its target pragma and defines AGENTD_OPS_AVX512 or AGENTD_OPS_AVX2 (neither: the
// scalar build), which choose the dot product and the fp16 store; every other loop is plain C++
// that GCC vectorizes under the file's target (no-trapping-math: selects on floats, as in the
// clamps of exp_fast, are only if-converted without traps; nothing here reads FP flags).
//
// Decode attention in spans (split-K, as flash-decoding does): a span is some rows' queries
// (every head, pre-scaled) against a run of slots, so rows that share leading blocks read them
// once; it keeps per query its top score, the sum of exponentials under it and the weighted
// values, and merge_spans combines a row's spans exactly (rescaling each by exp(top_i - top)).
//
// Invariant: internal linkage only (an anonymous namespace), so no instruction set leaks across
// the ISA files through the linker; only slots below a sequence's length are read.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "fp16.h"
#include "ops.h"

namespace agentd_cpu {
namespace {

// Pool elements: fp32 as they are, fp16 and bf16 widened in registers.
template <KvDtype kT>
inline float widen1(const void* p, int i) {
  if constexpr (kT == kKvF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (kT == kKvF16) {
    return fp16_to_fp32(static_cast<const uint16_t*>(p)[i]);
  } else {
    return bf16_to_fp32(static_cast<const uint16_t*>(p)[i]);
  }
}

#if defined(AGENTD_OPS_AVX512)
constexpr int kWidth = 16;
using Vec = __m512;
template <KvDtype kT>
inline Vec widen_vec(const void* p, int i) {
  if constexpr (kT == kKvF32) {
    return _mm512_loadu_ps(static_cast<const float*>(p) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i));
    if constexpr (kT == kKvF16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vset1(float a) { return _mm512_set1_ps(a); }
inline Vec vzero() { return _mm512_setzero_ps(); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
using VecI = __m512i;
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vfnma(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline Vec vclamp(Vec x, float lo, float hi) {
  return _mm512_min_ps(_mm512_max_ps(x, vset1(lo)), vset1(hi));
}
inline VecI vtrunc(Vec x, int minus) {  // int32(x) - minus
  return _mm512_sub_epi32(_mm512_cvttps_epi32(x), _mm512_set1_epi32(minus));
}
inline Vec vfloat(VecI n) { return _mm512_cvtepi32_ps(n); }
inline Vec vpow2(VecI n) {  // 2^n for normal exponents
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23));
}
inline Vec vunpacklo(Vec a, Vec b) { return _mm512_unpacklo_ps(a, b); }
inline Vec vunpackhi(Vec a, Vec b) { return _mm512_unpackhi_ps(a, b); }
template <int kImm>
inline Vec vshuffle(Vec a, Vec b) { return _mm512_shuffle_ps(a, b, kImm); }
inline __m128 vsum_lanes(Vec v) {  // the 128-bit lanes summed: (0 + 2) + (1 + 3)
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#elif defined(AGENTD_OPS_AVX2)
constexpr int kWidth = 8;
using Vec = __m256;
template <KvDtype kT>
inline Vec widen_vec(const void* p, int i) {
  if constexpr (kT == kKvF32) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  } else {
    const __m128i h = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    if constexpr (kT == kKvF16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vset1(float a) { return _mm256_set1_ps(a); }
inline Vec vzero() { return _mm256_setzero_ps(); }
inline float vsum(Vec v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
using VecI = __m256i;
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vfnma(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a * b
inline Vec vclamp(Vec x, float lo, float hi) {
  return _mm256_min_ps(_mm256_max_ps(x, vset1(lo)), vset1(hi));
}
inline VecI vtrunc(Vec x, int minus) {  // int32(x) - minus
  return _mm256_sub_epi32(_mm256_cvttps_epi32(x), _mm256_set1_epi32(minus));
}
inline Vec vfloat(VecI n) { return _mm256_cvtepi32_ps(n); }
inline Vec vpow2(VecI n) {  // 2^n for normal exponents
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}
inline Vec vunpacklo(Vec a, Vec b) { return _mm256_unpacklo_ps(a, b); }
inline Vec vunpackhi(Vec a, Vec b) { return _mm256_unpackhi_ps(a, b); }
template <int kImm>
inline Vec vshuffle(Vec a, Vec b) { return _mm256_shuffle_ps(a, b, kImm); }
inline __m128 vsum_lanes(Vec v) {  // the two 128-bit lanes summed
  return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
}
#else
constexpr int kWidth = 0;  // the scalar build: element loops only
#endif

// q (fp32) . k (n pool elements).
template <KvDtype kT>
inline float dot_kv(const float* q, const void* k, int n) {
  int i = 0;
  float s = 0.0f;
#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
  Vec acc = vzero();
  for (; i + kWidth <= n; i += kWidth) acc = vfma(vload(q + i), widen_vec<kT>(k, i), acc);
  s = vsum(acc);
#endif
  for (; i < n; ++i) s += q[i] * widen1<kT>(k, i);
  return s;
}

// Four dot products at once: the four accumulators' lanes are summed together (a 4 x 4
// transpose by shuffles) instead of each by its own horizontal reduction, a third of a decode
// row's work when each query is one dot product of 64. Each result depends only on its own
// query and row, never on which others share the call, and dot1_kv sums a lone one in the same
// order.
#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
inline __m128 reduce4(Vec a0, Vec a1, Vec a2, Vec a3) {
  const Vec s01 = vadd(vunpacklo(a0, a1), vunpackhi(a0, a1));
  const Vec s23 = vadd(vunpacklo(a2, a3), vunpackhi(a2, a3));
  return vsum_lanes(vadd(vshuffle<_MM_SHUFFLE(1, 0, 1, 0)>(s01, s23),
                         vshuffle<_MM_SHUFFLE(3, 2, 3, 2)>(s01, s23)));
}
#endif

// One vector's lanes summed in reduce4's order (pairs two apart within each 128-bit lane, then
// the lanes' sums two apart): dot1_kv's score is the bits dot4_kv gives the same query.
#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
inline float reduce1(Vec a) {
  const Vec t = vadd(a, vshuffle<_MM_SHUFFLE(1, 0, 3, 2)>(a, a));
  return _mm_cvtss_f32(vsum_lanes(vadd(t, vshuffle<_MM_SHUFFLE(2, 3, 0, 1)>(t, t))));
}
#endif

// q . k (k: D pool elements), as one lane of dot4_kv.
template <KvDtype kT>
inline float dot1_kv(const float* q, const void* k, int D) {
#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
  if (D % kWidth == 0) {
    Vec a = vzero();
    for (int d = 0; d < D; d += kWidth) a = vfma(vload(q + d), widen_vec<kT>(k, d), a);
    return reduce1(a);
  }
#endif
  return dot_kv<kT>(q, k, D);
}

// out[i] = q[i] . k[i] for i < 4 (k[i]: D pool elements).
template <KvDtype kT>
inline void dot4_kv(const float* const* q, const void* const* k, int D, float* out) {
#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
  if (D % kWidth == 0) {
    Vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    for (int d = 0; d < D; d += kWidth) {
      a0 = vfma(vload(q[0] + d), widen_vec<kT>(k[0], d), a0);
      a1 = vfma(vload(q[1] + d), widen_vec<kT>(k[1], d), a1);
      a2 = vfma(vload(q[2] + d), widen_vec<kT>(k[2], d), a2);
      a3 = vfma(vload(q[3] + d), widen_vec<kT>(k[3], d), a3);
    }
    _mm_storeu_ps(out, reduce4(a0, a1, a2, a3));
    return;
  }
#endif
  for (int i = 0; i < 4; ++i) out[i] = dot_kv<kT>(q[i], k[i], D);
}

// y += a * v (n pool elements).
template <KvDtype kT>
inline void axpy_kv(float* y, float a, const void* v, int n) {
  int i = 0;
#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
  const Vec va = vset1(a);
  for (; i + kWidth <= n; i += kWidth) vstore(y + i, vfma(va, widen_vec<kT>(v, i), vload(y + i)));
#endif
  for (; i < n; ++i) y[i] += a * widen1<kT>(v, i);
}

inline float dot(const float* a, const float* b, int n) { return dot_kv<kKvF32>(a, b, n); }

// e^x to ~2 ulp for x <= 88 (Cephes' expf polynomial after reducing by ln 2), branch-free so
// loops over it vectorize (no libm call, no floorf: GCC vectorizes neither under a target
// pragma; the clamps are selects once traps are off); below -87 it returns ~e^-87 (~1e-38).
inline float exp_fast(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  // round(x / ln 2) by truncation of a positive number (x / ln 2 + 200.5 > 0 here)
  const int32_t ni = static_cast<int32_t>(x * 1.44269504088896341f + 200.5f) - 200;
  const float n = static_cast<float>(ni);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * std::bit_cast<float>((ni + 127) << 23);
}

// exp_fast's steps on a vector (the same reduction and polynomial, with FMAs): GCC does not
// if-convert exp_fast's clamps inside a loop, so a loop of exp_fast ran one element at a time
// (one thread, 9 rows of 32 heads over 2,000 slots: 4.4 ms of exps, 0.36 ms this way).
#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
inline Vec vexp(Vec x) {
  x = vclamp(x, -87.0f, 88.0f);
  const VecI ni = vtrunc(vfma(x, vset1(1.44269504088896341f), vset1(200.5f)), 200);
  const Vec n = vfloat(ni);
  const Vec r = vadd(vfnma(n, vset1(0.693359375f), x), vmul(n, vset1(2.12194440e-4f)));
  Vec p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vadd(vfma(vmul(p, r), r, r), vset1(1.0f));
  return vmul(p, vpow2(ni));
}
#endif

// s[j] = exp(s[j] - top) for j < n.
inline void exp_shifted(float* s, int n, float top) {
  int j = 0;
#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
  for (; j + kWidth <= n; j += kWidth) vstore(s + j, vexp(vsub(vload(s + j), vset1(top))));
#endif
  for (; j < n; ++j) s[j] = exp_fast(s[j] - top);
}

// fp32 -> fp16, round to nearest even (NaN stays NaN, overflow is infinity), as torch converts.
inline uint16_t fp32_to_fp16(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x >= 0x47800000u) return static_cast<uint16_t>(sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (x < 0x38800000u) {  // an fp16 subnormal or zero: let fp32 addition do the rounding
    const float magic = std::bit_cast<float>(0x3f000000u);  // 0.5: ulp 2^-24 at its exponent
    return static_cast<uint16_t>(sign |
                                 (std::bit_cast<uint32_t>(std::bit_cast<float>(x) + magic) -
                                  0x3f000000u));
  }
  const uint32_t odd = (x >> 13) & 1u;
  x += 0xc8000fffu + odd;  // rebias 127 -> 15 (mod 2^32) and round half to even
  return static_cast<uint16_t>(sign | (x >> 13));
}

// fp32 -> bf16, round to nearest even, NaN kept quiet (torch's rule).
inline uint16_t fp32_to_bf16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

void store_row(const float* src, void* dst, KvDtype dtype, int n) {
  if (dtype == kKvF32) {
    std::memcpy(dst, src, sizeof(float) * n);
    return;
  }
  auto* out = static_cast<uint16_t*>(dst);
  int i = 0;
  if (dtype == kKvBF16) {
    for (; i < n; ++i) out[i] = fp32_to_bf16(src[i]);
    return;
  }
#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  }
#endif
  for (; i < n; ++i) out[i] = fp32_to_fp16(src[i]);
}

// Sum and maximum of n floats in sixteen independent lanes (so the loops vectorize without
// reassociating anything the compiler may not).
inline float lane_sum(const float* x, int n) {
  float lanes[16] = {};
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) lanes[j] += x[i + j];
  }
  float total = 0.0f;
  for (; i < n; ++i) total += x[i];
  for (float v : lanes) total += v;
  return total;
}

inline float lane_max(const float* x, int n) {
  float lanes[16];
  std::fill(lanes, lanes + 16, x[0]);
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) lanes[j] = lanes[j] > x[i + j] ? lanes[j] : x[i + j];
  }
  float top = x[0];
  for (; i < n; ++i) top = std::max(top, x[i]);
  for (float v : lanes) top = std::max(top, v);
  return top;
}

inline void axpy(float* y, float a, const float* x, int n) {
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

// acc[0..D) += sum over t < T of p[t] * rows[t * D ..]: the sums held in registers over the T
// rows (each element still adds its terms in t order, as T calls of axpy would).
inline void axpy_tile(float* acc, const float* p, const float* rows, int T, int D) {
  int d = 0;
#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
  for (; d + 4 * kWidth <= D; d += 4 * kWidth) {
    Vec a0 = vload(acc + d), a1 = vload(acc + d + kWidth);
    Vec a2 = vload(acc + d + 2 * kWidth), a3 = vload(acc + d + 3 * kWidth);
    for (int t = 0; t < T; ++t) {
      const Vec pt = vset1(p[t]);
      const float* r = rows + t * D + d;
      a0 = vfma(pt, vload(r), a0);
      a1 = vfma(pt, vload(r + kWidth), a1);
      a2 = vfma(pt, vload(r + 2 * kWidth), a2);
      a3 = vfma(pt, vload(r + 3 * kWidth), a3);
    }
    vstore(acc + d, a0);
    vstore(acc + d + kWidth, a1);
    vstore(acc + d + 2 * kWidth, a2);
    vstore(acc + d + 3 * kWidth, a3);
  }
  for (; d + kWidth <= D; d += kWidth) {
    Vec a = vload(acc + d);
    for (int t = 0; t < T; ++t) a = vfma(vset1(p[t]), vload(rows + t * D + d), a);
    vstore(acc + d, a);
  }
#endif
  for (; d < D; ++d) {
    for (int t = 0; t < T; ++t) acc[d] += p[t] * rows[t * D + d];
  }
}

// What attend_span_as and attend_rows_as share. The queries of rows[0..num_rows), every head,
// times the softmax scale, into q [num_rows * H, D] (query i = r * H + h).
inline void scaled_queries(const DecodeBatch& batch, const int32_t* rows, int num_rows,
                           int D, float* q) {
  const int H = batch.num_heads;
  for (int r = 0; r < num_rows; ++r) {
    const float* src = batch.query + rows[r] * batch.query_stride;
    for (int i = 0; i < H * D; ++i) q[r * H * D + i] = src[i] * batch.scale;
  }
}

// The start of slot `pos`'s keys (which = 0) or values (1), all KV heads in one row, in a
// sequence whose block table is `table`.
template <KvDtype kT>
struct SlotRows {
  static constexpr int64_t kElem = kT == kKvF32 ? 4 : 2;
  const KvLayout& kv;
  const int32_t* table;
  const char* operator()(int pos, int which) const {
    const int64_t index = table[pos / kv.block_size] * kv.block_stride + which * kv.kv_stride +
                          (pos % kv.block_size) * kv.token_stride;
    return static_cast<const char*>(kv.data) + index * kElem;
  }
};

// Scores [Q, n] into unnormalized probabilities; each query's partial [top, sum, acc...]
// gets its top score and sum, its acc zeroed for the values.
inline void span_probabilities(float* scores, int Q, int n, int D, float* partial) {
  for (int i = 0; i < Q; ++i) {
    float* s = scores + static_cast<int64_t>(i) * n;
    float* out = partial + static_cast<int64_t>(i) * (D + 2);
    out[0] = lane_max(s, n);
    exp_shifted(s, n, out[0]);
    out[1] = lane_sum(s, n);
    std::fill(out + 2, out + 2 + D, 0.0f);
  }
}

// The queries of rows[0..num_rows) (every head) against slots [p0, p1) of `table`: for each
// query (r, h) its top score, the sum of exp(score - top) and the sum of exp(score - top) * v,
// into partial + (r * H + h) * (D + 2) as [top, sum, acc...]. Each slot's keys (then values)
// of all KV heads are one contiguous row of the pool, read in pool order with the next rows
// prefetched (walking one head's rows alone touches a new page every token, which ran at a
// fifth of the read bandwidth), widened to fp32 in registers.
template <KvDtype kT>
void attend_span_as(const KvLayout& kv, const DecodeBatch& batch, const int32_t* rows,
                    int num_rows, const int32_t* table, int p0, int p1, float* partial,
                    float* scratch) {
  const int D = kv.head_dim, H = batch.num_heads;
  const int G = H / kv.num_kv_heads, Q = num_rows * H, n = p1 - p0;
  constexpr int64_t kElem = SlotRows<kT>::kElem;
  const int64_t row_bytes = int64_t{kv.num_kv_heads} * D * kElem;
  float* q = scratch;         // [Q, D], scaled
  float* scores = q + Q * D;  // [Q, n]
  scaled_queries(batch, rows, num_rows, D, q);
  const SlotRows<kT> slot_row{kv, table};
  constexpr int kAhead = 2;  // slots prefetched ahead
  auto prefetch = [&](int pos, int which) {
    if (pos >= p1) return;
    const char* p = slot_row(pos, which);
    for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
  };
  for (int pos = p0; pos < p1; ++pos) {
    prefetch(pos + kAhead, 0);
    const char* k = slot_row(pos, 0);
    int i0 = 0;
    for (; i0 + 4 <= Q; i0 += 4) {  // four queries at a time
      const float* qs[4];
      const void* ks[4];
      for (int j = 0; j < 4; ++j) {
        qs[j] = q + (i0 + j) * D;
        ks[j] = k + ((i0 + j) % H) / G * D * kElem;
      }
      float four[4];
      dot4_kv<kT>(qs, ks, D, four);
      for (int j = 0; j < 4; ++j) scores[static_cast<int64_t>(i0 + j) * n + pos - p0] = four[j];
    }
    for (; i0 < Q; ++i0) {
      scores[static_cast<int64_t>(i0) * n + pos - p0] =
          dot1_kv<kT>(q + i0 * D, k + (i0 % H) / G * D * kElem, D);
    }
  }
  span_probabilities(scores, Q, n, D, partial);
  for (int pos = p0; pos < p1; ++pos) {
    prefetch(pos + kAhead, 1);
    const char* v = slot_row(pos, 1);
    for (int i = 0; i < Q; ++i) {
      axpy_kv<kT>(partial + static_cast<int64_t>(i) * (D + 2) + 2,
                  scores[static_cast<int64_t>(i) * n + pos - p0], v + (i % H) / G * D * kElem,
                  D);
    }
  }
}

// attend_span_as for several rows (a speculative step's draft rows behind one prefix, agents
// on one cached prompt): the same results, the work ordered for them. Slots go in tiles of
// kTileSlots; each KV head's keys (then values) of a tile are widened once into `tile` and used
// by every query of that head while they are in L1, each query's sums held in registers over
// the tile. Slot by slot over all queries (attend_span_as), every slot walked all Q queries
// and their sums through L2: one thread, 9 rows of 32 heads over 2,000 fp16 slots, ~15 ms
// that way, 7.4 ms this one before dot4_kv (a single row: 0.9 ms).
constexpr int kTileSlots = kSpanTileSlots;

template <KvDtype kT>
void attend_rows_as(const KvLayout& kv, const DecodeBatch& batch, const int32_t* rows,
                    int num_rows, const int32_t* table, int p0, int p1, float* partial,
                    float* scratch, float* tile) {
  const int D = kv.head_dim, H = batch.num_heads, Hkv = kv.num_kv_heads;
  const int G = H / Hkv, Q = num_rows * H, n = p1 - p0;
  constexpr int64_t kElem = SlotRows<kT>::kElem;
  const int64_t row_bytes = int64_t{Hkv} * D * kElem;
  float* q = scratch;         // [Q, D], scaled; query i = r * H + h
  float* scores = q + Q * D;  // [Q, n]
  scaled_queries(batch, rows, num_rows, D, q);
  const SlotRows<kT> slot_row{kv, table};
  auto prefetch_tile = [&](int t0, int which) {
    for (int pos = t0; pos < std::min(p1, t0 + kTileSlots); ++pos) {
      const char* p = slot_row(pos, which);
      for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
    }
  };
  // One KV head's rows of slots [t0, t1) into tile [t1 - t0, D] fp32.
  auto widen_tile = [&](int t0, int t1, int which, int kh) {
    for (int pos = t0; pos < t1; ++pos) {
      const char* src = slot_row(pos, which) + int64_t{kh} * D * kElem;
      float* dst = tile + (pos - t0) * D;
      int d = 0;
#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
      for (; d + kWidth <= D; d += kWidth) vstore(dst + d, widen_vec<kT>(src, d));
#endif
      for (; d < D; ++d) dst[d] = widen1<kT>(src, d);
    }
  };
  for (int t0 = p0; t0 < p1; t0 += kTileSlots) {
    const int t1 = std::min(p1, t0 + kTileSlots);
    prefetch_tile(t1, 0);
    for (int kh = 0; kh < Hkv; ++kh) {
      widen_tile(t0, t1, 0, kh);
      for (int r = 0; r < num_rows; ++r) {
        for (int g = 0; g < G; ++g) {
          const int i = r * H + kh * G + g;
          float* s = scores + static_cast<int64_t>(i) * n - p0;
          const float* qs[4] = {q + i * D, q + i * D, q + i * D, q + i * D};
          int pos = t0;
          for (; pos + 4 <= t1; pos += 4) {  // four slots at a time
            const void* ks[4];
            for (int j = 0; j < 4; ++j) ks[j] = tile + (pos + j - t0) * D;
            dot4_kv<kKvF32>(qs, ks, D, s + pos);
          }
          for (; pos < t1; ++pos) s[pos] = dot1_kv<kKvF32>(q + i * D, tile + (pos - t0) * D, D);
        }
      }
    }
  }
  span_probabilities(scores, Q, n, D, partial);
  for (int t0 = p0; t0 < p1; t0 += kTileSlots) {
    const int t1 = std::min(p1, t0 + kTileSlots);
    prefetch_tile(t1, 1);
    for (int kh = 0; kh < Hkv; ++kh) {
      widen_tile(t0, t1, 1, kh);
      for (int r = 0; r < num_rows; ++r) {
        for (int g = 0; g < G; ++g) {
          const int i = r * H + kh * G + g;
          const float* p = scores + static_cast<int64_t>(i) * n - p0;
          axpy_tile(partial + static_cast<int64_t>(i) * (D + 2) + 2, p + t0, tile, t1 - t0, D);
        }
      }
    }
  }
}

template <KvDtype kT>
void attend_span_for(const KvLayout& kv, const DecodeBatch& batch, const int32_t* rows,
                     int num_rows, const int32_t* table, int p0, int p1, float* partial,
                     float* scratch) {
  if (num_rows > 1) {
    attend_rows_as<kT>(kv, batch, rows, num_rows, table, p0, p1, partial, scratch,
                       scratch + span_scratch_floats(kv, batch.num_heads, num_rows, p1 - p0) -
                           static_cast<size_t>(kTileSlots) * kv.head_dim);
  } else {
    attend_span_as<kT>(kv, batch, rows, num_rows, table, p0, p1, partial, scratch);
  }
}

void attend_span(const KvLayout& kv, const DecodeBatch& batch, const int32_t* rows,
                 int num_rows, const int32_t* table, int p0, int p1, float* partial,
                 float* scratch) {
  switch (kv.dtype) {
    case kKvF16:
      attend_span_for<kKvF16>(kv, batch, rows, num_rows, table, p0, p1, partial, scratch);
      break;
    case kKvBF16:
      attend_span_for<kKvBF16>(kv, batch, rows, num_rows, table, p0, p1, partial, scratch);
      break;
    default:
      attend_span_for<kKvF32>(kv, batch, rows, num_rows, table, p0, p1, partial, scratch);
  }
}

// out = the softmax-weighted values over the union of spans, from their partials (each
// [top, sum, acc...] of D + 2 floats).
void merge_spans(const float* const* partials, int num_spans, int D, float* out) {
  float top = partials[0][0];
  for (int i = 1; i < num_spans; ++i) top = std::max(top, partials[i][0]);
  float total = 0.0f;
  std::fill(out, out + D, 0.0f);
  for (int i = 0; i < num_spans; ++i) {
    const float w = exp_fast(partials[i][0] - top);
    total += partials[i][1] * w;
    axpy(out, w, partials[i] + 2, D);
  }
  const float inv = 1.0f / total;
  for (int j = 0; j < D; ++j) out[j] *= inv;
}

void add_rms_norm(int n, const float* x, float* residual, const float* weight, float eps,
                  float* out) {
  if (x != nullptr) {
    for (int i = 0; i < n; ++i) residual[i] += x[i];
  }
  const float inv = 1.0f / std::sqrt(dot(residual, residual, n) / n + eps);
  for (int k = 0; k < n; ++k) out[k] = residual[k] * inv * weight[k];
}

void silu_mul(int n, const float* gate, const float* up, float* out) {
  for (int i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + exp_fast(-gate[i])) * up[i];
}

void rope(float* x, int num_heads, int64_t head_stride, int head_dim, const float* cos,
          const float* sin, bool interleaved) {
  const int half = head_dim / 2;
  for (int h = 0; h < num_heads; ++h) {
    float* v = x + h * head_stride;
    if (interleaved) {
      for (int i = 0; i < half; ++i) {
        const float a = v[2 * i], b = v[2 * i + 1];
        v[2 * i] = a * cos[i] - b * sin[i];
        v[2 * i + 1] = b * cos[i] + a * sin[i];
      }
    } else {
      for (int i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * cos[i] - b * sin[i];
        v[i + half] = b * cos[i] + a * sin[i];
      }
    }
  }
}

constexpr OpsKernels kOps = {attend_span, merge_spans, add_rms_norm, silu_mul, rope, store_row};

}  // namespace
}  // namespace agentd_cpu
