// What the AVX2 and AVX-512 K-quant files share: 256-bit helpers and the unpacking of a Q4_K/
// Q5_K super-block's 4- or 5-bit values, 32 bytes at a time.
//
// Invariant: include it after the file's `#pragma GCC target` (AVX2 or more) and kquants_common.h;
// everything here has internal linkage, so each file compiles its own copy under its own target.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "ggml_blocks.h"

namespace agentd_cpu {
namespace {

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

inline const uint8_t* bsums_of(const ActQ8_256& a) {
  return reinterpret_cast<const uint8_t*>(&a) + offsetof(ActQ8_256, bsums);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Software prefetch distance: hardware prefetch alone leaves a core well short of its read
// bandwidth once each line also takes ~15 cycles of arithmetic (measured on Zen 1, 2 KB best).
constexpr int kPrefetchBytes = 2048;

// Prefetches the lines of one block kPrefetchBytes ahead (n lines, 64 bytes each).
inline void prefetch_ahead(const void* blk, int n) {
  // Integer arithmetic: the address may lie past the row, which a prefetch may touch (it never
  // faults) but a pointer may not point to.
  const auto p = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(blk) + kPrefetchBytes);
  for (int i = 0; i < n; ++i) _mm_prefetch(p + 64 * i, _MM_HINT_T0);
}

// The minimums' term of a Q4_K/Q5_K super-block: int32 lanes summing to sum_j m_j * (bsums[2j]
// + bsums[2j + 1]) (each m_j paired with both of its sub-block's group sums).
inline __m256i min_terms(uint64_t mins, const ActQ8_256& a) {
  const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m128i m8 = _mm_shuffle_epi8(_mm_cvtsi64_si128(static_cast<long long>(mins)), dup);
  return _mm256_madd_epi16(load256(bsums_of(a)), _mm256_cvtepu8_epi16(m8));
}

// The values of sub-blocks 2c (lo) and 2c + 1 (hi) of a Q4_K (kHigh false) or Q5_K super-block,
// from the 32 bytes q of nibbles at qs + 32 c; for Q5_K, bit 4 from bits 0 and 1 of qh's bytes,
// then qh moves on to the next pair (call with c = 0, 1, 2, 3 in order).
template <bool kHigh>
inline void q45_values(__m256i q, __m256i& qh, __m256i& lo, __m256i& hi) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  lo = _mm256_and_si256(q, low4);
  hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
  if (kHigh) {
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(qh, 4), bit4));
    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(qh, 3), bit4));
    qh = _mm256_srli_epi16(qh, 2);
  }
}

}  // namespace
}  // namespace agentd_cpu
