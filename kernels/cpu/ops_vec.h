// The per-ISA vector shim of ops_impl.h: the including file's AGENTD_OPS_AVX512 or
// AGENTD_OPS_AVX2 (neither: the scalar build, element loops only) picks Vec and kWidth and the
// primitives over them (loads, stores, FMAs, lane reductions, e^x), so the loops of
// ops_attention.h and ops_impl.h are written once for every ISA.
//
// Invariant: internal linkage only (an anonymous namespace), compiled per ISA file under its
// own target pragma; a primitive gives the same bits wherever it is called.
#pragma once

#include <immintrin.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "fp16.h"
#include "ops.h"

namespace agentd_cpu {
namespace {

// The fp16 scale and the int8 values of the q8_0 block that holds value i of a head row.
inline const uint8_t* q8_block(const void* p, int i) {
  return static_cast<const uint8_t*>(p) + (i / kQ8Group) * kQ8Bytes;
}
inline float q8_scale(const uint8_t* block) {
  uint16_t d;
  std::memcpy(&d, block, 2);
#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
  return _cvtsh_ss(d);  // F16C: exact, as fp16_to_fp32
#else
  return fp16_to_fp32(d);
#endif
}

// Pool elements: fp32 as they are, fp16 and bf16 widened in registers, q8_0 scaled (exact).
template <KvDtype kT>
inline float widen1(const void* p, int i) {
  if constexpr (kT == kKvF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (kT == kKvQ8) {
    const uint8_t* b = q8_block(p, i);
    return q8_scale(b) * static_cast<float>(static_cast<int8_t>(b[2 + i % kQ8Group]));
  } else if constexpr (kT == kKvF16) {
    return fp16_to_fp32(static_cast<const uint16_t*>(p)[i]);
  } else {
    return bf16_to_fp32(static_cast<const uint16_t*>(p)[i]);
  }
}

#if defined(AGENTD_OPS_AVX512)
constexpr int kWidth = 16;
using Vec = __m512;
// kWidth int8 as floats.
inline Vec widen_i8(const uint8_t* p) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
}
template <KvDtype kT>
inline Vec widen_vec(const void* p, int i) {
  if constexpr (kT == kKvF32) {
    return _mm512_loadu_ps(static_cast<const float*>(p) + i);
  } else if constexpr (kT == kKvQ8) {  // i % 16 == 0: one block holds all 16
    const uint8_t* b = q8_block(p, i);
    return _mm512_mul_ps(widen_i8(b + 2 + i % kQ8Group), _mm512_set1_ps(q8_scale(b)));
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
inline Vec widen_i8(const uint8_t* p) {
  const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
}
template <KvDtype kT>
inline Vec widen_vec(const void* p, int i) {
  if constexpr (kT == kKvF32) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  } else if constexpr (kT == kKvQ8) {  // i % 8 == 0: one block holds all 8
    const uint8_t* b = q8_block(p, i);
    return _mm256_mul_ps(widen_i8(b + 2 + i % kQ8Group), _mm256_set1_ps(q8_scale(b)));
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

// Lane j of v into dst[j * stride] for j < m (m <= 4), each by a scalar store from the
// register. The four stored to a stack array and read back as floats (the compiler moved them in
// pairs through a general register) waited on store-to-load forwarding: the 8B's grouped key
// pass spent a fifth of its time on that reload.
inline void store_lanes(__m128 v, float* dst, int64_t stride, int m) {
  _mm_store_ss(dst, v);
  if (m > 1) _mm_store_ss(dst + stride, _mm_permute_ps(v, 0x55));
  if (m > 2) _mm_store_ss(dst + 2 * stride, _mm_permute_ps(v, 0xaa));
  if (m > 3) _mm_store_ss(dst + 3 * stride, _mm_permute_ps(v, 0xff));
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

}  // namespace
}  // namespace agentd_cpu
