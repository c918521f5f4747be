// K-quant (Q4_K, Q5_K, Q6_K) products with AVX-512 VNNI: Q4_K/Q5_K in 256-bit vectors, one
// sub-block each, as in the AVX2 file; Q6_K in 512-bit vectors, two sub-blocks each.
//
// dpbusd sums four unsigned weight values times four signed int8 activations into each int32
// lane. Such a sum fits int16 (at most 4 * 63 * 128 = 32256), so dpwssd
// against scale lanes that hold the scale in their low 16 bits and 0 in their high 16 bits adds
// exactly value * scale to the super-block's int32 sum, which is converted to float once per
// super-block. Q4_K/Q5_K minimums and Q6_K's -32 offset go through the activation's group sums.
//
// Invariant: every load is unaligned (GGUF rows inside an mmap are aligned to nothing beyond a
// byte) and the integer sums equal the scalar kernels' exactly. This file runs only where cpuid
// reports AVX-512 F/BW/VL/DQ/VNNI (the dispatcher checks it against scalar at first use).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")
// GCC 12's AVX-512 headers build their "undefined" vectors as self-initialized variables, which
// -Wall reports at every inlined use (a false positive fixed in GCC 13).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "ggml_blocks.h"
#include "kquants_common.h"
#include "kquants_x86.h"

namespace agentd_cpu {
namespace {

inline __m512i load512(const void* p) { return _mm512_loadu_si512(p); }

inline float fp16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Q4_K (kHigh false) and Q5_K (kHigh true): one weight row times N activation rows act + j *
// act_stride into out[j * out_stride], the weights unpacked once per super-block; each row's
// operations are the N = 1 kernel's in the same order, so its result equals that bit for bit.
//
// 256-bit vectors (AVX-512 VL), one sub-block each: per 32 weights of a row, one dpbusd and one
// multiply-add by the sub-block's scale, where AVX2 needs maddubs, madd and an add. Each
// sub-block pair's sum joins isum by one add: accumulating with dpwssd into isum made a row's
// eight sub-blocks one chain of 5-cycle steps. One Zen 4 thread, 8192 x 2048 Q4_K, one row:
// 0.39 ms (0.40 for the AVX2 kernel); 0.46 ms in 512-bit vectors accumulating with dpwssd,
// 0.43 ms in 256-bit ones that way. Four rows: 0.99 ms (AVX2 1.17).
template <bool kHigh, int N>
inline void dot_q45_K(int K, const uint8_t* row, size_t block_bytes, size_t scales_off,
                      size_t qh_off, size_t qs_off, const uint8_t* act, size_t act_stride,
                      float* out, size_t out_stride) {
  const __m256i zero = _mm256_setzero_si256();
  __m256 acc[N];
  for (int j = 0; j < N; ++j) acc[j] = _mm256_setzero_ps();
  for (int b = 0; b < K / QK_K; ++b) {
    const uint8_t* blk = row + b * block_bytes;
    const ActQ8_256* a[N];
    for (int j = 0; j < N; ++j) a[j] = reinterpret_cast<const ActQ8_256*>(act + j * act_stride) + b;
    prefetch_ahead(blk, 3);  // 144 or 176 bytes a block
    const KqScaleMins sm = kq_unpack_scale_mins(blk + scales_off);
    // Scales as int32 lanes 0-7 (zero-extended bytes: high 16 bits are 0, as dpwssd needs).
    const __m256i scales =
        _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(sm.scales)));
    __m256i qh = kHigh ? load256(blk + qh_off) : zero;
    __m256i isum[N];
    for (int j = 0; j < N; ++j) isum[j] = zero;
    for (int c = 0; c < 4; ++c) {  // 32 bytes of nibbles: sub-blocks 2c (low) and 2c + 1 (high)
      __m256i lo, hi;
      q45_values<kHigh>(load256(blk + qs_off + 32 * c), qh, lo, hi);
      const __m256i s_lo = _mm256_permutexvar_epi32(_mm256_set1_epi32(2 * c), scales);
      const __m256i s_hi = _mm256_permutexvar_epi32(_mm256_set1_epi32(2 * c + 1), scales);
      for (int j = 0; j < N; ++j) {
        const __m256i d_lo = _mm256_dpbusd_epi32(zero, lo, load256(a[j]->qs + 64 * c));
        const __m256i d_hi = _mm256_dpbusd_epi32(zero, hi, load256(a[j]->qs + 64 * c + 32));
        // Off isum's chain (see above): only the add waits for the last c.
        isum[j] = _mm256_add_epi32(
            isum[j], _mm256_dpwssd_epi32(_mm256_madd_epi16(d_lo, s_lo), d_hi, s_hi));
      }
    }
    const float d = fp16_at(blk), dmin = fp16_at(blk + 2);
    for (int j = 0; j < N; ++j) {
      acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[j]->d), _mm256_cvtepi32_ps(isum[j]), acc[j]);
      acc[j] = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * a[j]->d),
                                _mm256_cvtepi32_ps(min_terms(sm.mins, *a[j])), acc[j]);
    }
  }
  for (int j = 0; j < N; ++j) out[j * out_stride] = hsum(acc[j]);
}

constexpr size_t kQ4Scales = offsetof(BlockQ4_K, scales), kQ4Qs = offsetof(BlockQ4_K, qs);
constexpr size_t kQ5Scales = offsetof(BlockQ5_K, scales), kQ5Qs = offsetof(BlockQ5_K, qs);
constexpr size_t kQ5Qh = offsetof(BlockQ5_K, qh);

// Q6_K: one weight row times N activation rows, as dot_q45_K.
template <int N>
inline void dot_q6_K(int K, const BlockQ6_K* blocks, const uint8_t* act, size_t act_stride,
                     float* out, size_t out_stride) {
  const __m512i low4 = _mm512_set1_epi8(0x0f), bits45 = _mm512_set1_epi8(0x30);
  const __m512i low16 = _mm512_set1_epi32(0xffff);
  // Per-half shifts that bring qh's bit pairs to bits 4-5: left (values 0-63: pairs 0-1 | 2-3)
  // and right (values 64-127: pairs 4-5 | 6-7).
  const __m512i up = _mm512_inserti64x4(_mm512_set1_epi64(4), _mm256_set1_epi64x(2), 1);
  const __m512i down = _mm512_inserti64x4(_mm512_set1_epi64(0), _mm256_set1_epi64x(2), 1);
  // int32 lane k of a half's products covers values 4k..4k+3: group 8h + k / 4 (+ 4 for the
  // second 64 values).
  const __m512i g = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[N];
  for (int j = 0; j < N; ++j) acc[j] = _mm512_setzero_ps();
  for (int b = 0; b < K / QK_K; ++b) {
    const BlockQ6_K& blk = blocks[b];
    const ActQ8_256* x[N];
    for (int j = 0; j < N; ++j) x[j] = reinterpret_cast<const ActQ8_256*>(act + j * act_stride) + b;
    prefetch_ahead(&blk, 4);  // 210 bytes a block
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.scales));
    // Scales of the 16 groups as int32 lanes holding the scale in their low 16 bits only.
    const __m512i scales = _mm512_and_si512(_mm512_cvtepi8_epi32(sc8), low16);
    const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
    // The -32 offset: 32 * sum_g scale_g * bsums_g, taken off the super-block's int32 sum.
    __m512i isum[N];
    for (int j = 0; j < N; ++j) {
      const __m256i offset =
          _mm256_slli_epi32(_mm256_madd_epi16(load256(bsums_of(*x[j])), sc16), 5);
      isum[j] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_zextsi256_si512(offset));
    }
    for (int h = 0; h < 2; ++h) {
      // Values 0-63 of the half: ql's low nibbles with qh bits 0-1 | 2-3, then 64-127: ql's
      // high nibbles with qh bits 4-5 | 6-7.
      const __m512i ql = load512(blk.ql + 64 * h);
      const __m512i qh = _mm512_broadcast_i64x4(load256(blk.qh + 32 * h));
      const __m512i q01 = _mm512_or_si512(_mm512_and_si512(ql, low4),
                                          _mm512_and_si512(_mm512_sllv_epi64(qh, up), bits45));
      const __m512i q23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                          _mm512_and_si512(_mm512_srlv_epi64(qh, down), bits45));
      const __m512i g01 = _mm512_add_epi32(g, _mm512_set1_epi32(8 * h));
      const __m512i g23 = _mm512_add_epi32(g01, _mm512_set1_epi32(4));
      const __m512i s01 = _mm512_permutexvar_epi32(g01, scales);
      const __m512i s23 = _mm512_permutexvar_epi32(g23, scales);
      const __m512i zero = _mm512_setzero_si512();
      for (int j = 0; j < N; ++j) {
        const __m512i d01 = _mm512_dpbusd_epi32(zero, q01, load512(x[j]->qs + 128 * h));
        const __m512i d23 = _mm512_dpbusd_epi32(zero, q23, load512(x[j]->qs + 128 * h + 64));
        isum[j] = _mm512_add_epi32(  // off isum's chain, as in dot_q45_K
            isum[j], _mm512_dpwssd_epi32(_mm512_madd_epi16(d01, s01), d23, s23));
      }
    }
    const float d = _cvtsh_ss(blk.d);
    for (int j = 0; j < N; ++j) {
      acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(d * x[j]->d), _mm512_cvtepi32_ps(isum[j]), acc[j]);
    }
  }
  for (int j = 0; j < N; ++j) out[j * out_stride] = _mm512_reduce_add_ps(acc[j]);
}

}  // namespace

float vec_dot_q4_K_avx512(int K, const void* w, const void* a) {
  float out;
  dot_q45_K<false, 1>(K, static_cast<const uint8_t*>(w), sizeof(BlockQ4_K), kQ4Scales, 0, kQ4Qs,
                      static_cast<const uint8_t*>(a), 0, &out, 0);
  return out;
}

float vec_dot_q5_K_avx512(int K, const void* w, const void* a) {
  float out;
  dot_q45_K<true, 1>(K, static_cast<const uint8_t*>(w), sizeof(BlockQ5_K), kQ5Scales, kQ5Qh,
                     kQ5Qs, static_cast<const uint8_t*>(a), 0, &out, 0);
  return out;
}

float vec_dot_q6_K_avx512(int K, const void* w, const void* a) {
  float out;
  dot_q6_K<1>(K, static_cast<const BlockQ6_K*>(w), static_cast<const uint8_t*>(a), 0, &out, 0);
  return out;
}

void vec_dot_cols_q4_K_avx512(int K, const void* w, const void* act, size_t act_stride, int n,
                              float* out, size_t out_stride) {
  by_columns<8>(n, act, act_stride, out, out_stride, [&]<int N>(const uint8_t* a, float* o) {
    dot_q45_K<false, N>(K, static_cast<const uint8_t*>(w), sizeof(BlockQ4_K), kQ4Scales, 0,
                        kQ4Qs, a, act_stride, o, out_stride);
  });
}

void vec_dot_cols_q5_K_avx512(int K, const void* w, const void* act, size_t act_stride, int n,
                              float* out, size_t out_stride) {
  by_columns<8>(n, act, act_stride, out, out_stride, [&]<int N>(const uint8_t* a, float* o) {
    dot_q45_K<true, N>(K, static_cast<const uint8_t*>(w), sizeof(BlockQ5_K), kQ5Scales, kQ5Qh,
                       kQ5Qs, a, act_stride, o, out_stride);
  });
}

void vec_dot_cols_q6_K_avx512(int K, const void* w, const void* act, size_t act_stride, int n,
                              float* out, size_t out_stride) {
  by_columns<8>(n, act, act_stride, out, out_stride, [&]<int N>(const uint8_t* a, float* o) {
    dot_q6_K<N>(K, static_cast<const BlockQ6_K*>(w), a, act_stride, o, out_stride);
  });
}

}  // namespace agentd_cpu
