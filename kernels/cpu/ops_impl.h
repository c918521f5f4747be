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
  const int D = kv.head_dim, B = kv.block_size, H = batch.num_heads;
  const int G = H / kv.num_kv_heads, Q = num_rows * H, n = p1 - p0;
  constexpr int64_t kElem = kT == kKvF32 ? 4 : 2;
  const int64_t row_bytes = int64_t{kv.num_kv_heads} * D * kElem;
  float* q = scratch;         // [Q, D], scaled
  float* scores = q + Q * D;  // [Q, n]
  for (int r = 0; r < num_rows; ++r) {
    const float* src = batch.query + rows[r] * batch.query_stride;
    for (int i = 0; i < H * D; ++i) q[r * H * D + i] = src[i] * batch.scale;
  }
  auto slot_row = [&](int pos, int which) -> const char* {
    const int64_t index = table[pos / B] * kv.block_stride + which * kv.kv_stride +
                          (pos % B) * kv.token_stride;
    return static_cast<const char*>(kv.data) + index * kElem;
  };
  constexpr int kAhead = 2;  // slots prefetched ahead
  auto prefetch = [&](int pos, int which) {
    if (pos >= p1) return;
    const char* p = slot_row(pos, which);
    for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
  };
  for (int pos = p0; pos < p1; ++pos) {
    prefetch(pos + kAhead, 0);
    const char* k = slot_row(pos, 0);
    for (int i = 0; i < Q; ++i) {
      scores[static_cast<int64_t>(i) * n + pos - p0] =
          dot_kv<kT>(q + i * D, k + (i % H) / G * D * kElem, D);
    }
  }
  for (int i = 0; i < Q; ++i) {  // probabilities, unnormalized
    float* s = scores + static_cast<int64_t>(i) * n;
    float* out = partial + static_cast<int64_t>(i) * (D + 2);
    out[0] = lane_max(s, n);
    for (int j = 0; j < n; ++j) s[j] = exp_fast(s[j] - out[0]);
    out[1] = lane_sum(s, n);
    std::fill(out + 2, out + 2 + D, 0.0f);
  }
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

void attend_span(const KvLayout& kv, const DecodeBatch& batch, const int32_t* rows,
                 int num_rows, const int32_t* table, int p0, int p1, float* partial,
                 float* scratch) {
  switch (kv.dtype) {
    case kKvF16:
      attend_span_as<kKvF16>(kv, batch, rows, num_rows, table, p0, p1, partial, scratch);
      break;
    case kKvBF16:
      attend_span_as<kKvBF16>(kv, batch, rows, num_rows, table, p0, p1, partial, scratch);
      break;
    default:
      attend_span_as<kKvF32>(kv, batch, rows, num_rows, table, p0, p1, partial, scratch);
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
