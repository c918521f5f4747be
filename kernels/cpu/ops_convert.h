// fp32 -> fp16 / bf16, rounded to nearest even as torch converts, and the KV-row store on them
// (ops.h's store_row), on ops_vec.h's primitives. fp16.h holds the widening conversions, which
// the C++17 kernel files share; these need C++20 (std::bit_cast) and serve ops_impl.h alone.
//
// Invariant: internal linkage only (an anonymous namespace), compiled per ISA file.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

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

// n values (n % 32 == 0) as q8_0 blocks: d = max|x| / 127 rounded to fp16, q = x * (1 / d)
// rounded half to even, clamped to [-127, 127] (kv_quant.quantize_q8_0's bytes).
inline void store_q8_0(const float* src, uint8_t* dst, int n) {
  for (int b = 0; b < n / kQ8Group; ++b, src += kQ8Group, dst += kQ8Bytes) {
    float amax = 0.0f;
    for (int i = 0; i < kQ8Group; ++i) amax = std::max(amax, std::fabs(src[i]));
    const uint16_t dh = fp32_to_fp16(amax / 127.0f);
    std::memcpy(dst, &dh, 2);
    const float d = fp16_to_fp32(dh), inv = d > 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < kQ8Group; ++i) {
      const float q = std::nearbyint(src[i] * inv);  // the default mode: half to even
      dst[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f)));
    }
  }
}

void store_row(const float* src, void* dst, KvDtype dtype, int n) {
  if (dtype == kKvQ8) {
    store_q8_0(src, static_cast<uint8_t*>(dst), n);
    return;
  }
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
