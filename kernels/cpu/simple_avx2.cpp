// Q4_0, Q4_1, Q8_0, F16, BF16 products, activation quantizers and dequantization with AVX2 +
// FMA + F16C.
//
// Int8 products, four 32-weight blocks at a time in 128-bit registers (as fast per byte where
// 256-bit ops split in two, Zen 1, and no slower elsewhere for a memory-bound loop): 4-bit
// weights stay unsigned (0..15) and multiply the signed activations in pairs
// (_mm_maddubs_epi16, never saturating), the four blocks' int16 partials reduce together by
// horizontal adds to four int32 sums, which one 4-lane FMA scales by fp16(d) * act.d; Q4_0's -8
// and Q4_1's minimum go through the activation blocks' s = d * sum(qs). Q8_0 uses the sign trick
// (|w| times x with w's sign) and widens each half to int32 before the reduction. Measured on
// Zen 1 (one core, 2048 x 2048 in cache): Q4_0 6.7 -> 4.0 cycles per block against one 256-bit
// block per step with broadcast scales; software prefetch 1 KB ahead: 5.3 -> 4.6 from DRAM.
//
// Invariant: every load is unaligned (GGUF rows in an mmap are aligned to nothing); quantized
// activations and dequantized rows equal the scalar file's bit for bit (same fp32 operations,
// round-half-even conversion under the default MXCSR); integer sums are exact, so products
// differ from the scalar ones only in the order of the per-block fp32 accumulation.
#pragma GCC target("avx2,fma,f16c,bmi2")
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

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float fp16(uint16_t h) { return _cvtsh_ss(h); }

// The 32 values of a 4-bit block in weight order: low nibbles (0..15) then high ones (16..31).
inline __m256i nibbles(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(15));
}

// Absmax of n floats (a multiple of 8); *non_finite is set if any is an infinity or a NaN.
inline float absmax(const float* x, int n, bool* non_finite) {
  const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
  __m256 m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) {
    const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i));
    m = _mm256_max_ps(m, a);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));
  }
  *non_finite = _mm256_movemask_ps(bad) != 0;
  return hmax(m);
}

// 32 floats times inv_d, rounded half-even, into 32 int8 in order; sums[0], sums[1] are the
// sums of values 0..15 and 16..31.
inline void quantize32(const float* x, __m256 inv_d, int8_t* qs, int32_t* sums) {
  const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), inv_d));
  const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), inv_d));
  const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), inv_d));
  const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), inv_d));
  sums[0] = hsum_epi32(_mm256_add_epi32(i0, i1));
  sums[1] = hsum_epi32(_mm256_add_epi32(i2, i3));
  // packs work within 128-bit lanes: dword k of the packed bytes holds (vector k % 4, half k / 4).
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs), _mm256_permutevar8x32_epi32(packed, order));
}

// Software prefetch of n cache lines 1 KB ahead: hardware prefetch alone leaves a core well
// short of its read bandwidth on a weight stream (measured: 5.3 -> 4.6 cycles per Q4_0 block
// from DRAM). The address may lie past the row; a prefetch never faults.
inline void prefetch_ahead(const void* p, int n) {
  const char* c = static_cast<const char*>(p) + 1024;
  for (int i = 0; i < n; ++i) _mm_prefetch(c + 64 * i, _MM_HINT_T0);
}

inline float hsum128(__m128 v) {
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

inline __m128 fp16x4(uint16_t a, uint16_t b, uint16_t c, uint16_t d) {
  const short h[4] = {static_cast<short>(a), static_cast<short>(b), static_cast<short>(c),
                      static_cast<short>(d)};
  return _mm_cvtph_ps(_mm_setr_epi16(h[0], h[1], h[2], h[3], 0, 0, 0, 0));
}

// The scales d and s of four consecutive activation blocks, one 8-byte load per block (an
// ActQ8_32 starts with d, s).
struct Scales4 {
  __m128 d, s;
};

inline Scales4 act_scales4(const ActQ8_32* a) {
  auto ds = [a](int i) { return _mm_load_sd(reinterpret_cast<const double*>(a + i)); };
  const __m128 ds01 = _mm_castpd_ps(_mm_unpacklo_pd(ds(0), ds(1)));
  const __m128 ds23 = _mm_castpd_ps(_mm_unpacklo_pd(ds(2), ds(3)));
  return {_mm_shuffle_ps(ds01, ds23, _MM_SHUFFLE(2, 0, 2, 0)),
          _mm_shuffle_ps(ds01, ds23, _MM_SHUFFLE(3, 1, 3, 1))};
}

// A 4-bit block's 32 values (low nibbles, high nibbles), unpacked once for every column.
struct Q4Values {
  __m128i lo, hi;
};

inline Q4Values q4_values(const uint8_t* qs) {
  const __m128i m4 = _mm_set1_epi8(15);
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return {_mm_and_si128(raw, m4), _mm_and_si128(_mm_srli_epi16(raw, 4), m4)};
}

// One 4-bit block times its activations: 8 int16 partial sums (each at most 4 * 15 * 127).
// 128-bit throughout: on CPUs that split 256-bit ops in two (Zen 1) this is as fast per byte
// and lets four blocks reduce together below.
inline __m128i q4_block_dot(const Q4Values& q, const int8_t* x) {
  const __m128i x0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  const __m128i x1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 16));
  return _mm_add_epi16(_mm_maddubs_epi16(q.lo, x0), _mm_maddubs_epi16(q.hi, x1));
}

// A Q8_0 block's |w| (as unsigned: |-128| = 128) and w (for its signs), in two halves.
struct Q8Values {
  __m128i w0, w1, abs0, abs1;
};

inline Q8Values q8_values(const int8_t* qs) {
  const __m128i w0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i w1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16));
  return {w0, w1, _mm_sign_epi8(w0, w0), _mm_sign_epi8(w1, w1)};
}

// One Q8_0 block times its activations (|w| times x with w's sign): 4 int32 sums.
inline __m128i q8_block_dot(const Q8Values& q, const int8_t* x) {
  const __m128i ones = _mm_set1_epi16(1);
  const __m128i x0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  const __m128i x1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 16));
  const __m128i p0 = _mm_maddubs_epi16(q.abs0, _mm_sign_epi8(x0, q.w0));
  const __m128i p1 = _mm_maddubs_epi16(q.abs1, _mm_sign_epi8(x1, q.w1));
  return _mm_add_epi32(_mm_madd_epi16(p0, ones), _mm_madd_epi16(p1, ones));
}

inline const ActQ8_32* act_col(const void* act, size_t act_stride, int c) {
  return reinterpret_cast<const ActQ8_32*>(static_cast<const uint8_t*>(act) + c * act_stride);
}

// Q4_0 (w = d (q - 8): the -8 through s) and Q4_1 (w = d q + m), one weight row times NC
// activation rows, the weights unpacked once for all of them. Four blocks at a time: their
// int16 partials reduce with two horizontal adds (at most 16 * 15 * 127 < 2^15, exact) and
// one widening, then one 4-lane multiply by the four blocks' scales. Each column's arithmetic
// is the same whatever NC, so a result does not depend on how many rows share the call.
template <typename Block, bool kMin, int NC>
void dot_q4(int K, const Block* wb, const void* act, size_t act_stride, float* out,
            size_t out_stride) {
  const __m128i ones = _mm_set1_epi16(1);
  const ActQ8_32* ab[NC];
  __m128 acc[NC], off[NC];
  float tail_off[NC];
  for (int c = 0; c < NC; ++c) {
    ab[c] = act_col(act, act_stride, c);
    acc[c] = off[c] = _mm_setzero_ps();
    tail_off[c] = 0.0f;
  }
  const int nb = K / QK32;
  int b = 0;
  for (; b + 4 <= nb; b += 4) {
    prefetch_ahead(wb + b, 2);  // 72 or 80 bytes per 4 blocks
    const Q4Values q[4] = {q4_values(wb[b].qs), q4_values(wb[b + 1].qs),
                           q4_values(wb[b + 2].qs), q4_values(wb[b + 3].qs)};
    const __m128 dw = fp16x4(wb[b].d, wb[b + 1].d, wb[b + 2].d, wb[b + 3].d);
    __m128 mw = dw;
    if constexpr (kMin) mw = fp16x4(wb[b].m, wb[b + 1].m, wb[b + 2].m, wb[b + 3].m);
    for (int c = 0; c < NC; ++c) {
      const ActQ8_32* a = ab[c] + b;
      const __m128i h01 =
          _mm_hadd_epi16(q4_block_dot(q[0], a[0].qs), q4_block_dot(q[1], a[1].qs));
      const __m128i h23 =
          _mm_hadd_epi16(q4_block_dot(q[2], a[2].qs), q4_block_dot(q[3], a[3].qs));
      const __m128i s = _mm_madd_epi16(_mm_hadd_epi16(h01, h23), ones);
      const Scales4 as = act_scales4(a);
      acc[c] = _mm_fmadd_ps(_mm_cvtepi32_ps(s), _mm_mul_ps(dw, as.d), acc[c]);
      off[c] = _mm_fmadd_ps(mw, as.s, off[c]);
    }
  }
  for (; b < nb; ++b) {  // K / 32 % 4 tail blocks: all lanes of acc are summed at the end
    const Q4Values q = q4_values(wb[b].qs);
    const float dw = fp16(wb[b].d);
    float mw = dw;
    if constexpr (kMin) mw = fp16(wb[b].m);
    for (int c = 0; c < NC; ++c) {
      const ActQ8_32& a = ab[c][b];
      const __m128i s = _mm_madd_epi16(q4_block_dot(q, a.qs), ones);
      acc[c] = _mm_fmadd_ps(_mm_cvtepi32_ps(s), _mm_set1_ps(dw * a.d), acc[c]);
      tail_off[c] = std::fma(mw, a.s, tail_off[c]);
    }
  }
  for (int c = 0; c < NC; ++c) {
    const float offset = hsum128(off[c]) + tail_off[c];
    out[c * out_stride] = hsum128(acc[c]) + (kMin ? offset : -8.0f * offset);
  }
}

template <int NC>
void dot_q8(int K, const BlockQ8_0* wb, const void* act, size_t act_stride, float* out,
            size_t out_stride) {
  const ActQ8_32* ab[NC];
  __m128 acc[NC];
  for (int c = 0; c < NC; ++c) ab[c] = act_col(act, act_stride, c), acc[c] = _mm_setzero_ps();
  const int nb = K / QK32;
  int b = 0;
  for (; b + 4 <= nb; b += 4) {
    prefetch_ahead(wb + b, 3);  // 136 bytes per 4 blocks
    const Q8Values q[4] = {q8_values(wb[b].qs), q8_values(wb[b + 1].qs),
                           q8_values(wb[b + 2].qs), q8_values(wb[b + 3].qs)};
    const __m128 dw = fp16x4(wb[b].d, wb[b + 1].d, wb[b + 2].d, wb[b + 3].d);
    for (int c = 0; c < NC; ++c) {
      // A block's products fill int16 pairs to 2 * 128 * 127, so each half widens first.
      const ActQ8_32* a = ab[c] + b;
      const __m128i s = _mm_hadd_epi32(
          _mm_hadd_epi32(q8_block_dot(q[0], a[0].qs), q8_block_dot(q[1], a[1].qs)),
          _mm_hadd_epi32(q8_block_dot(q[2], a[2].qs), q8_block_dot(q[3], a[3].qs)));
      acc[c] = _mm_fmadd_ps(_mm_cvtepi32_ps(s), _mm_mul_ps(dw, act_scales4(a).d), acc[c]);
    }
  }
  for (; b < nb; ++b) {  // K / 32 % 4 tail blocks: all lanes of acc are summed at the end
    const Q8Values q = q8_values(wb[b].qs);
    const float dw = fp16(wb[b].d);
    for (int c = 0; c < NC; ++c) {
      const ActQ8_32& a = ab[c][b];
      acc[c] = _mm_fmadd_ps(_mm_cvtepi32_ps(q8_block_dot(q, a.qs)), _mm_set1_ps(dw * a.d),
                            acc[c]);
    }
  }
  for (int c = 0; c < NC; ++c) out[c * out_stride] = hsum128(acc[c]);
}

template <typename Widen>
float dot_half(int K, const uint16_t* w, const float* x, Widen widen, float (*one)(uint16_t)) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  __m256 acc2 = _mm256_setzero_ps(), acc3 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 32 <= K; i += 32) {
    prefetch_ahead(w + i, 1);  // 64 bytes of weights per step
    acc0 = _mm256_fmadd_ps(widen(w + i), _mm256_loadu_ps(x + i), acc0);
    acc1 = _mm256_fmadd_ps(widen(w + i + 8), _mm256_loadu_ps(x + i + 8), acc1);
    acc2 = _mm256_fmadd_ps(widen(w + i + 16), _mm256_loadu_ps(x + i + 16), acc2);
    acc3 = _mm256_fmadd_ps(widen(w + i + 24), _mm256_loadu_ps(x + i + 24), acc3);
  }
  for (; i + 8 <= K; i += 8) acc0 = _mm256_fmadd_ps(widen(w + i), _mm256_loadu_ps(x + i), acc0);
  float sum = hsum(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
  for (; i < K; ++i) sum += one(w[i]) * x[i];
  return sum;
}

inline __m256 widen_f16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 widen_bf16(const uint16_t* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

// 32 uint8/int8 values (in a 256-bit register) to 4 x 8 floats, times d, plus m if kMin (a
// plain product otherwise, so a zero keeps the sign of d as in the scalar file).
template <bool kSigned, bool kMin>
inline void store_scaled(__m256i v, __m256 d, __m256 m, float* out) {
  const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
  const __m128i parts[4] = {lo, _mm_unpackhi_epi64(lo, lo), hi, _mm_unpackhi_epi64(hi, hi)};
  for (int k = 0; k < 4; ++k) {
    const __m256i i = kSigned ? _mm256_cvtepi8_epi32(parts[k]) : _mm256_cvtepu8_epi32(parts[k]);
    const __m256 f = _mm256_cvtepi32_ps(i);
    _mm256_storeu_ps(out + 8 * k, kMin ? _mm256_fmadd_ps(d, f, m) : _mm256_mul_ps(d, f));
  }
}

}  // namespace

void quantize_act_q8_32_avx2(int K, const float* x, void* out) {
  auto* blocks = static_cast<ActQ8_32*>(out);
  for (int b = 0; b < K / QK32; ++b, x += QK32) {
    bool non_finite = false;
    const float amax = absmax(x, QK32, &non_finite);
    const BlockScale sc = block_scale(amax, non_finite);
    int32_t sums[2] = {0, 0};
    if (sc.inv_d == 0.0f) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(blocks[b].qs), _mm256_setzero_si256());
    } else {
      quantize32(x, _mm256_set1_ps(sc.inv_d), blocks[b].qs, sums);
    }
    blocks[b].d = sc.d;
    blocks[b].s = sc.d * static_cast<float>(sums[0] + sums[1]);
  }
}

void quantize_act_q8_256_avx2(int K, const float* x, void* out) {
  auto* blocks = static_cast<ActQ8_256*>(out);
  for (int b = 0; b < K / QK_K; ++b, x += QK_K) {
    ActQ8_256& blk = blocks[b];
    bool non_finite = false;
    const float amax = absmax(x, QK_K, &non_finite);
    const BlockScale sc = block_scale(amax, non_finite);
    blk.d = sc.d;
    const __m256 inv_d = _mm256_set1_ps(sc.inv_d);
    for (int c = 0; c < QK_K / 32; ++c) {
      int32_t sums[2] = {0, 0};
      if (sc.inv_d == 0.0f) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(blk.qs + 32 * c), _mm256_setzero_si256());
      } else {
        quantize32(x + 32 * c, inv_d, blk.qs + 32 * c, sums);
      }
      blk.bsums[2 * c] = static_cast<int16_t>(sums[0]);
      blk.bsums[2 * c + 1] = static_cast<int16_t>(sums[1]);
    }
  }
}

float vec_dot_q4_0_avx2(int K, const void* w, const void* a) {
  float out;
  dot_q4<BlockQ4_0, false, 1>(K, static_cast<const BlockQ4_0*>(w), a, 0, &out, 0);
  return out;
}

float vec_dot_q4_1_avx2(int K, const void* w, const void* a) {
  float out;
  dot_q4<BlockQ4_1, true, 1>(K, static_cast<const BlockQ4_1*>(w), a, 0, &out, 0);
  return out;
}

float vec_dot_q8_0_avx2(int K, const void* w, const void* a) {
  float out;
  dot_q8<1>(K, static_cast<const BlockQ8_0*>(w), a, 0, &out, 0);
  return out;
}

void vec_dot_cols_q4_0_avx2(int K, const void* w, const void* act, size_t act_stride, int n,
                            float* out, size_t out_stride) {
  const auto* wb = static_cast<const BlockQ4_0*>(w);
  by_columns(n, act, act_stride, out, out_stride, [&]<int N>(const uint8_t* a, float* o) {
    dot_q4<BlockQ4_0, false, N>(K, wb, a, act_stride, o, out_stride);
  });
}

void vec_dot_cols_q4_1_avx2(int K, const void* w, const void* act, size_t act_stride, int n,
                            float* out, size_t out_stride) {
  const auto* wb = static_cast<const BlockQ4_1*>(w);
  by_columns(n, act, act_stride, out, out_stride, [&]<int N>(const uint8_t* a, float* o) {
    dot_q4<BlockQ4_1, true, N>(K, wb, a, act_stride, o, out_stride);
  });
}

void vec_dot_cols_q8_0_avx2(int K, const void* w, const void* act, size_t act_stride, int n,
                            float* out, size_t out_stride) {
  const auto* wb = static_cast<const BlockQ8_0*>(w);
  by_columns(n, act, act_stride, out, out_stride, [&]<int N>(const uint8_t* a, float* o) {
    dot_q8<N>(K, wb, a, act_stride, o, out_stride);
  });
}

float vec_dot_f16_avx2(int K, const void* w, const void* a) {
  return dot_half(K, static_cast<const uint16_t*>(w), static_cast<const float*>(a), widen_f16,
                  fp16_to_fp32);
}

float vec_dot_bf16_avx2(int K, const void* w, const void* a) {
  return dot_half(K, static_cast<const uint16_t*>(w), static_cast<const float*>(a), widen_bf16,
                  bf16_to_fp32);
}

void dequant_row_q4_0_avx2(int K, const void* w, float* out) {
  const auto* wb = static_cast<const BlockQ4_0*>(w);
  const __m256i eight = _mm256_set1_epi8(8);
  for (int b = 0; b < K / QK32; ++b, out += QK32) {
    const __m256i q = _mm256_sub_epi8(nibbles(wb[b].qs), eight);
    store_scaled<true, false>(q, _mm256_set1_ps(fp16(wb[b].d)), _mm256_setzero_ps(), out);
  }
}

void dequant_row_q4_1_avx2(int K, const void* w, float* out) {
  const auto* wb = static_cast<const BlockQ4_1*>(w);
  for (int b = 0; b < K / QK32; ++b, out += QK32) {
    store_scaled<false, true>(nibbles(wb[b].qs), _mm256_set1_ps(fp16(wb[b].d)),
                        _mm256_set1_ps(fp16(wb[b].m)), out);
  }
}

void dequant_row_q8_0_avx2(int K, const void* w, float* out) {
  const auto* wb = static_cast<const BlockQ8_0*>(w);
  for (int b = 0; b < K / QK32; ++b, out += QK32) {
    store_scaled<true, false>(load256(wb[b].qs), _mm256_set1_ps(fp16(wb[b].d)),
                              _mm256_setzero_ps(), out);
  }
}

void dequant_row_f16_avx2(int K, const void* w, float* out) {
  const auto* h = static_cast<const uint16_t*>(w);
  int i = 0;
  for (; i + 8 <= K; i += 8) _mm256_storeu_ps(out + i, widen_f16(h + i));
  for (; i < K; ++i) out[i] = fp16_to_fp32(h[i]);
}

void dequant_row_bf16_avx2(int K, const void* w, float* out) {
  const auto* h = static_cast<const uint16_t*>(w);
  int i = 0;
  for (; i + 8 <= K; i += 8) _mm256_storeu_ps(out + i, widen_bf16(h + i));
  for (; i < K; ++i) out[i] = bf16_to_fp32(h[i]);
}

}  // namespace agentd_cpu
