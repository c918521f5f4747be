// fp32 -> fp16 / bf16, rounded to nearest even as torch converts, and the KV-row store on them
// (ops.h's store_row), on ops_vec.h's primitives. fp16.h holds the widening conversions, which
// the C++17 kernel files share; these need C++20 (std::bit_cast) and serve ops_impl.h alone.
//
// Invariant: internal linkage only (an anonymous namespace), compiled per ISA file.
#pragma once

#include <bit>
#include <cstdint>

#include "ops.h"
#include "ops_vec.h"

namespace agentd_cpu {
namespace {

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

}  // namespace
}  // namespace agentd_cpu
