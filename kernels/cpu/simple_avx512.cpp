// Q4_0, Q4_1, Q8_0, F16, BF16 products and activation quantizers with AVX-512 (F, BW, VL, DQ)
// and VNNI: two 32-weight blocks per 512-bit register, u8 x s8 quadruples summed straight into
// int32 by _mm512_dpbusd_epi32 (no int16 stage, so nothing can saturate).
//
// Invariant: as simple_avx2.cpp: unaligned loads only; quantized activations bit-identical to
// the scalar file's (same fp32 operations, round-half-even); products differ from the scalar
// ones only in the order of the fp32 accumulation. This file cannot be run on a machine without
// these extensions, so dispatch.cpp checks it against the scalar file at first use.
#pragma GCC target("avx2,fma,f16c,bmi2,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
// GCC 12's AVX-512 headers build "undefined" registers as `__m512 __Y = __Y;`, which its own
// -Wuninitialized flags at every inlined use: a header false positive, silenced for this file.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "ggml_blocks.h"
#include "columns.h"
#include "simple_common.h"

namespace agentd_cpu {
namespace {

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

inline __m128i load128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }

inline float fp16(uint16_t h) { return _cvtsh_ss(h); }

inline __m512i join(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// Lanes 0..7 scaled by a, lanes 8..15 by b.
inline __m512 two_scales(float a, float b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(a)), _mm256_set1_ps(b), 1);
}

// The nibbles of two 4-bit blocks, each in weight order (low nibbles, then high ones).
inline __m512i nibbles2(const uint8_t* qa, const uint8_t* qb) {
  const __m256i raw = _mm256_set_m128i(load128(qb), load128(qa));
  const __m256i m4 = _mm256_set1_epi8(15);
  const __m256i lo = _mm256_and_si256(raw, m4);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
  const __m512i v = join(lo, hi);                        // lo A, lo B, hi A, hi B
  return _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0));  // lo A, hi A, lo B, hi B
}

inline __m256i nibbles(const uint8_t* qs) {
  const __m128i raw = load128(qs);
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(15));
}

inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Absmax over n floats (a multiple of 16); *non_finite if any is an infinity or a NaN.
inline float absmax(const float* x, int n, bool* non_finite) {
  const __m512 inf = _mm512_set1_ps(INFINITY);
  __m512 m = _mm512_setzero_ps();
  __mmask16 bad = 0;
  for (int i = 0; i < n; i += 16) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + i));
    m = _mm512_max_ps(m, a);
    bad |= _mm512_cmp_ps_mask(a, inf, _CMP_NLT_UQ);
  }
  *non_finite = bad != 0;
  return _mm512_reduce_max_ps(m);
}

// 16 floats times inv_d, rounded half-even, to 16 int8; returns their sum.
inline int32_t quantize16(const float* x, __m512 inv_d, int8_t* qs) {
  const __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), inv_d));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qs), _mm512_cvtsepi32_epi8(i));
  return _mm512_reduce_add_epi32(i);
}

template <typename Widen>
float dot_half(int K, const uint16_t* w, const float* x, Widen widen, float (*one)(uint16_t)) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int i = 0;
  for (; i + 32 <= K; i += 32) {
    acc0 = _mm512_fmadd_ps(widen(w + i), _mm512_loadu_ps(x + i), acc0);
    acc1 = _mm512_fmadd_ps(widen(w + i + 16), _mm512_loadu_ps(x + i + 16), acc1);
  }
  for (; i + 16 <= K; i += 16) acc0 = _mm512_fmadd_ps(widen(w + i), _mm512_loadu_ps(x + i), acc0);
  float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  for (; i < K; ++i) sum += one(w[i]) * x[i];
  return sum;
}

inline __m512 widen_f16(const uint16_t* p) { return _mm512_cvtph_ps(load256(p)); }

inline __m512 widen_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load256(p)), 16));
}

// Q4_0 (w = d (q - 8)) and Q4_1 (w = d q + m), which differ only in the minimum's term: one
// weight row times N activation rows act + j * act_stride into out[j * out_stride], each
// weight pair unpacked once for all N; every row's operations are the N = 1 kernel's in the
// same order, so its result equals that bit for bit.
template <typename Block, bool kQ4_0, int N>
void dot_q4(int K, const Block* wb, const uint8_t* act, size_t act_stride, float* out,
            size_t out_stride) {
  __m512 acc[N];
  __m256 tail[N];
  float off[N];
  const ActQ8_32* ab[N];
  for (int j = 0; j < N; ++j) {
    acc[j] = _mm512_setzero_ps(), tail[j] = _mm256_setzero_ps(), off[j] = 0.0f;
    ab[j] = reinterpret_cast<const ActQ8_32*>(act + j * act_stride);
  }
  auto min_of = [](const Block& blk) {
    if constexpr (kQ4_0) {
      return -8.0f * fp16(blk.d);
    } else {
      return fp16(blk.m);
    }
  };
  const int nb = K / QK32;
  int b = 0;
  for (; b + 2 <= nb; b += 2) {
    const __m512i q = nibbles2(wb[b].qs, wb[b + 1].qs);
    const float d0 = fp16(wb[b].d), d1 = fp16(wb[b + 1].d);
    const float m0 = min_of(wb[b]), m1 = min_of(wb[b + 1]);
    for (int j = 0; j < N; ++j) {
      const __m512i x = join(load256(ab[j][b].qs), load256(ab[j][b + 1].qs));
      const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, x);
      const __m512 s = two_scales(d0 * ab[j][b].d, d1 * ab[j][b + 1].d);
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), s, acc[j]);
      off[j] += m0 * ab[j][b].s + m1 * ab[j][b + 1].s;
    }
  }
  if (b < nb) {
    const __m256i q = nibbles(wb[b].qs);
    for (int j = 0; j < N; ++j) {
      const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, load256(ab[j][b].qs));
      tail[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(fp16(wb[b].d) * ab[j][b].d));
      off[j] += min_of(wb[b]) * ab[j][b].s;
    }
  }
  for (int j = 0; j < N; ++j) {
    out[j * out_stride] = _mm512_reduce_add_ps(acc[j]) + hsum256(tail[j]) + off[j];
  }
}

// Q8_0: one weight row times N activation rows, as dot_q4. |w| (as unsigned: |-128| = 128)
// times x with w's sign.
template <int N>
void dot_q8_0(int K, const BlockQ8_0* wb, const uint8_t* act, size_t act_stride, float* out,
              size_t out_stride) {
  __m512 acc[N];
  float tail[N];
  const ActQ8_32* ab[N];
  for (int j = 0; j < N; ++j) {
    acc[j] = _mm512_setzero_ps(), tail[j] = 0.0f;
    ab[j] = reinterpret_cast<const ActQ8_32*>(act + j * act_stride);
  }
  const int nb = K / QK32;
  int b = 0;
  for (; b + 2 <= nb; b += 2) {
    const __m512i q = join(load256(wb[b].qs), load256(wb[b + 1].qs));
    const __mmask64 negative = _mm512_movepi8_mask(q);
    const __m512i q_abs = _mm512_abs_epi8(q);
    const float d0 = fp16(wb[b].d), d1 = fp16(wb[b + 1].d);
    for (int j = 0; j < N; ++j) {
      const __m512i x = join(load256(ab[j][b].qs), load256(ab[j][b + 1].qs));
      const __m512i xs = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
      const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q_abs, xs);
      const __m512 s = two_scales(d0 * ab[j][b].d, d1 * ab[j][b + 1].d);
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), s, acc[j]);
    }
  }
  if (b < nb) {
    const __m256i q = load256(wb[b].qs);
    for (int j = 0; j < N; ++j) {
      const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(q, q),
                                            _mm256_sign_epi8(load256(ab[j][b].qs), q));
      tail[j] = hsum256(_mm256_cvtepi32_ps(p)) * (fp16(wb[b].d) * ab[j][b].d);
    }
  }
  for (int j = 0; j < N; ++j) out[j * out_stride] = _mm512_reduce_add_ps(acc[j]) + tail[j];
}

}  // namespace

void quantize_act_q8_32_avx512(int K, const float* x, void* out) {
  auto* blocks = static_cast<ActQ8_32*>(out);
  for (int b = 0; b < K / QK32; ++b, x += QK32) {
    bool non_finite = false;
    const float amax = absmax(x, QK32, &non_finite);
    const BlockScale sc = block_scale(amax, non_finite);
    int32_t sum = 0;
    if (sc.inv_d == 0.0f) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(blocks[b].qs), _mm256_setzero_si256());
    } else {
      const __m512 inv_d = _mm512_set1_ps(sc.inv_d);
      sum = quantize16(x, inv_d, blocks[b].qs) + quantize16(x + 16, inv_d, blocks[b].qs + 16);
    }
    blocks[b].d = sc.d;
    blocks[b].s = sc.d * static_cast<float>(sum);
  }
}

void quantize_act_q8_256_avx512(int K, const float* x, void* out) {
  auto* blocks = static_cast<ActQ8_256*>(out);
  for (int b = 0; b < K / QK_K; ++b, x += QK_K) {
    ActQ8_256& blk = blocks[b];
    bool non_finite = false;
    const float amax = absmax(x, QK_K, &non_finite);
    const BlockScale sc = block_scale(amax, non_finite);
    blk.d = sc.d;
    const __m512 inv_d = _mm512_set1_ps(sc.inv_d);
    for (int g = 0; g < QK_K / 16; ++g) {
      int32_t sum = 0;
      if (sc.inv_d == 0.0f) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(blk.qs + 16 * g), _mm_setzero_si128());
      } else {
        sum = quantize16(x + 16 * g, inv_d, blk.qs + 16 * g);
      }
      blk.bsums[g] = static_cast<int16_t>(sum);
    }
  }
}

float vec_dot_q4_0_avx512(int K, const void* w, const void* a) {
  float out;
  dot_q4<BlockQ4_0, true, 1>(K, static_cast<const BlockQ4_0*>(w),
                             static_cast<const uint8_t*>(a), 0, &out, 0);
  return out;
}

float vec_dot_q4_1_avx512(int K, const void* w, const void* a) {
  float out;
  dot_q4<BlockQ4_1, false, 1>(K, static_cast<const BlockQ4_1*>(w),
                              static_cast<const uint8_t*>(a), 0, &out, 0);
  return out;
}

float vec_dot_q8_0_avx512(int K, const void* w, const void* a) {
  float out;
  dot_q8_0<1>(K, static_cast<const BlockQ8_0*>(w), static_cast<const uint8_t*>(a), 0, &out, 0);
  return out;
}

void vec_dot_cols_q4_0_avx512(int K, const void* w, const void* act, size_t act_stride, int n,
                              float* out, size_t out_stride) {
  by_columns(n, act, act_stride, out, out_stride, [&]<int N>(const uint8_t* a, float* o) {
    dot_q4<BlockQ4_0, true, N>(K, static_cast<const BlockQ4_0*>(w), a, act_stride, o,
                               out_stride);
  });
}

void vec_dot_cols_q4_1_avx512(int K, const void* w, const void* act, size_t act_stride, int n,
                              float* out, size_t out_stride) {
  by_columns(n, act, act_stride, out, out_stride, [&]<int N>(const uint8_t* a, float* o) {
    dot_q4<BlockQ4_1, false, N>(K, static_cast<const BlockQ4_1*>(w), a, act_stride, o,
                                out_stride);
  });
}

void vec_dot_cols_q8_0_avx512(int K, const void* w, const void* act, size_t act_stride, int n,
                              float* out, size_t out_stride) {
  by_columns(n, act, act_stride, out, out_stride, [&]<int N>(const uint8_t* a, float* o) {
    dot_q8_0<N>(K, static_cast<const BlockQ8_0*>(w), a, act_stride, o, out_stride);
  });
}

float vec_dot_f16_avx512(int K, const void* w, const void* a) {
  return dot_half(K, static_cast<const uint16_t*>(w), static_cast<const float*>(a), widen_f16,
                  fp16_to_fp32);
}

float vec_dot_bf16_avx512(int K, const void* w, const void* a) {
  return dot_half(K, static_cast<const uint16_t*>(w), static_cast<const float*>(a), widen_bf16,
                  bf16_to_fp32);
}

}  // namespace agentd_cpu
