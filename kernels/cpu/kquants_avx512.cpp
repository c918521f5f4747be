// K-quant (Q4_K, Q5_K, Q6_K) products with AVX-512 VNNI, shaped like the AVX2 file with two
// sub-blocks per 512-bit vector.
//
// _mm512_dpbusd_epi32 sums four unsigned weight values times four signed int8 activations into
// each int32 lane. Such a sum fits int16 (at most 4 * 63 * 128 = 32256), so _mm512_dpwssd_epi32
// against scale lanes that hold the scale in their low 16 bits and 0 in their high 16 bits adds
// exactly value * scale to the super-block's int32 sum, which is converted to float once per
// super-block. Q4_K/Q5_K minimums and Q6_K's -32 offset go through the activation's group sums.
//
// Invariant: every load is unaligned (GGUF rows inside an mmap are aligned to nothing beyond a
// byte) and the integer sums equal the scalar kernels' exactly. This file runs only where cpuid
// reports AVX-512 F/BW/VL/DQ/VNNI (the dispatcher checks it against scalar at first use).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
// GCC 12's AVX-512 headers build their "undefined" vectors as self-initialized variables, which
// -Wall reports at every inlined use (a false positive fixed in GCC 13).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "ggml_blocks.h"
#include "kquants_common.h"

namespace agentd_cpu {
namespace {

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline __m512i load512(const void* p) { return _mm512_loadu_si512(p); }

inline const uint8_t* bsums_of(const ActQ8_256& a) {
  return reinterpret_cast<const uint8_t*>(&a) + offsetof(ActQ8_256, bsums);
}

// Lanes 0-7 take element `lo` of v's low 16 int32 lanes, lanes 8-15 element `hi`.
inline __m512i pick32(__m512i v, int lo, int hi) {
  const __m512i idx = _mm512_inserti64x4(_mm512_set1_epi32(lo), _mm256_set1_epi32(hi), 1);
  return _mm512_permutexvar_epi32(idx, v);
}

// The same 32 bytes in both halves, shifted right per 64-bit lane by lo_shift (low half) and
// hi_shift (high half) bits: two views of one byte vector side by side.
inline __m512i both_halves(__m256i v, int lo_shift, int hi_shift) {
  const __m512i shifts = _mm512_inserti64x4(_mm512_set1_epi64(lo_shift),
                                            _mm256_set1_epi64x(hi_shift), 1);
  return _mm512_srlv_epi64(_mm512_broadcast_i64x4(v), shifts);
}

// The minimums' term of a Q4_K/Q5_K super-block: eight int32 lanes summing to
// sum_j m_j * (bsums[2j] + bsums[2j + 1]), zero-extended to 16 lanes.
inline __m512i min_terms(uint64_t mins, const ActQ8_256& a) {
  const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m128i m8 = _mm_shuffle_epi8(_mm_cvtsi64_si128(static_cast<long long>(mins)), dup);
  return _mm512_zextsi256_si512(
      _mm256_madd_epi16(load256(bsums_of(a)), _mm256_cvtepu8_epi16(m8)));
}

template <bool kHigh>
inline float dot_q45_K(int K, const uint8_t* row, size_t block_bytes, size_t scales_off,
                       size_t qh_off, size_t qs_off, const ActQ8_256* act) {
  const __m512i low4 = _mm512_set1_epi8(0x0f), one = _mm512_set1_epi8(1);
  __m512 acc = _mm512_setzero_ps();
  for (int b = 0; b < K / QK_K; ++b) {
    const uint8_t* blk = row + b * block_bytes;
    const ActQ8_256& a = act[b];
    const KqScaleMins sm = kq_unpack_scale_mins(blk + scales_off);
    // Scales as int32 lanes 0-7 (zero-extended bytes: high 16 bits are 0, as dpwssd needs).
    const __m512i scales = _mm512_zextsi256_si512(
        _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(sm.scales))));
    const __m256i qh = kHigh ? load256(blk + qh_off) : _mm256_setzero_si256();
    __m512i isum = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {  // nibbles of sub-blocks 2c (low half), 2c + 1 (high half)
      const __m256i qs = load256(blk + qs_off + 32 * c);
      __m512i q = _mm512_and_si512(both_halves(qs, 0, 4), low4);
      if (kHigh) {  // bits 2c and 2c + 1 of qh as bit 4
        const __m512i h = _mm512_and_si512(both_halves(qh, 2 * c, 2 * c + 1), one);
        q = _mm512_or_si512(q, _mm512_slli_epi16(h, 4));
      }
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, load512(a.qs + 64 * c));
      isum = _mm512_dpwssd_epi32(isum, dot, pick32(scales, 2 * c, 2 * c + 1));
    }
    uint16_t d16, dmin16;
    std::memcpy(&d16, blk, 2);
    std::memcpy(&dmin16, blk + 2, 2);
    const __m512 d = _mm512_set1_ps(kq_fp16_to_fp32(d16) * a.d);
    const __m512 dmin = _mm512_set1_ps(kq_fp16_to_fp32(dmin16) * a.d);
    acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(isum), acc);
    acc = _mm512_fnmadd_ps(dmin, _mm512_cvtepi32_ps(min_terms(sm.mins, a)), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

constexpr size_t kQ4Scales = offsetof(BlockQ4_K, scales), kQ4Qs = offsetof(BlockQ4_K, qs);
constexpr size_t kQ5Scales = offsetof(BlockQ5_K, scales), kQ5Qs = offsetof(BlockQ5_K, qs);
constexpr size_t kQ5Qh = offsetof(BlockQ5_K, qh);

}  // namespace

float vec_dot_q4_K_avx512(int K, const void* w, const void* a) {
  return dot_q45_K<false>(K, static_cast<const uint8_t*>(w), sizeof(BlockQ4_K), kQ4Scales, 0,
                          kQ4Qs, static_cast<const ActQ8_256*>(a));
}

float vec_dot_q5_K_avx512(int K, const void* w, const void* a) {
  return dot_q45_K<true>(K, static_cast<const uint8_t*>(w), sizeof(BlockQ5_K), kQ5Scales, kQ5Qh,
                         kQ5Qs, static_cast<const ActQ8_256*>(a));
}

float vec_dot_q6_K_avx512(int K, const void* w, const void* a) {
  const auto* blocks = static_cast<const BlockQ6_K*>(w);
  const auto* act = static_cast<const ActQ8_256*>(a);
  const __m512i low4 = _mm512_set1_epi8(0x0f), bits45 = _mm512_set1_epi8(0x30);
  const __m512i low16 = _mm512_set1_epi32(0xffff);
  // Per-half shifts that bring qh's bit pairs to bits 4-5: left (values 0-63: pairs 0-1 | 2-3)
  // and right (values 64-127: pairs 4-5 | 6-7).
  const __m512i up = _mm512_inserti64x4(_mm512_set1_epi64(4), _mm256_set1_epi64x(2), 1);
  const __m512i down = _mm512_inserti64x4(_mm512_set1_epi64(0), _mm256_set1_epi64x(2), 1);
  __m512 acc = _mm512_setzero_ps();
  for (int b = 0; b < K / QK_K; ++b) {
    const BlockQ6_K& blk = blocks[b];
    const ActQ8_256& x = act[b];
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.scales));
    // Scales of the 16 groups as int32 lanes holding the scale in their low 16 bits only.
    const __m512i scales = _mm512_and_si512(_mm512_cvtepi8_epi32(sc8), low16);
    // The -32 offset: 32 * sum_g scale_g * bsums_g, taken off the super-block's int32 sum.
    const __m256i offset = _mm256_slli_epi32(
        _mm256_madd_epi16(load256(bsums_of(x)), _mm256_cvtepi8_epi16(sc8)), 5);
    __m512i isum = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_zextsi256_si512(offset));
    for (int h = 0; h < 2; ++h) {
      // Values 0-63 of the half: ql's low nibbles with qh bits 0-1 | 2-3, then 64-127: ql's
      // high nibbles with qh bits 4-5 | 6-7.
      const __m512i ql = load512(blk.ql + 64 * h);
      const __m512i qh = _mm512_broadcast_i64x4(load256(blk.qh + 32 * h));
      const __m512i q01 = _mm512_or_si512(_mm512_and_si512(ql, low4),
                                          _mm512_and_si512(_mm512_sllv_epi64(qh, up), bits45));
      const __m512i q23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                          _mm512_and_si512(_mm512_srlv_epi64(qh, down), bits45));
      const __m512i zero = _mm512_setzero_si512();
      const __m512i d01 = _mm512_dpbusd_epi32(zero, q01, load512(x.qs + 128 * h));
      const __m512i d23 = _mm512_dpbusd_epi32(zero, q23, load512(x.qs + 128 * h + 64));
      // int32 lane k of d01 covers values 4k..4k+3 of the half: group 8h + k / 4 (d23: + 4).
      const __m512i g = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
      const __m512i g01 = _mm512_add_epi32(g, _mm512_set1_epi32(8 * h));
      const __m512i g23 = _mm512_add_epi32(g01, _mm512_set1_epi32(4));
      isum = _mm512_dpwssd_epi32(isum, d01, _mm512_permutexvar_epi32(g01, scales));
      isum = _mm512_dpwssd_epi32(isum, d23, _mm512_permutexvar_epi32(g23, scales));
    }
    const __m512 d = _mm512_set1_ps(kq_fp16_to_fp32(blk.d) * x.d);
    acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(isum), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

}  // namespace agentd_cpu
