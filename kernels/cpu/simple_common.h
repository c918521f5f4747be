// Helpers shared by the simple-format kernel files (simple_scalar/avx2/avx512.cpp): fp16/bf16
// decode and the activation quantizer's per-block scale.
//
// Invariant: internal linkage only (an anonymous namespace), so each ISA file compiles its own
// copy under its own target pragma; and block_scale is the one definition of an activation
// block's (d, 1/d) that every ISA's quantizer uses, so their blocks agree bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

#include "ggml_blocks.h"

namespace agentd_cpu {
namespace {

// Exact fp16 -> fp32 for every input (subnormals, infinities, NaNs).
inline float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else {
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24
    uint32_t mag_bits;
    std::memcpy(&mag_bits, &mag, 4);
    bits = sign | mag_bits;
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

inline float bf16_to_fp32(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

inline uint16_t load_u16(const void* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

struct BlockScale {
  float d, inv_d;
};

// A block's scale from its absmax. A block holding an infinity or a NaN (non_finite) gets
// d = NaN and zeros, so the product comes out NaN instead of silently finite; below 1e-30 the
// block is zeros with d = 0 (1 / d would overflow fp32).
inline BlockScale block_scale(float amax, bool non_finite) {
  if (non_finite) return {__builtin_nanf(""), 0.0f};
  if (amax < 1e-30f) return {0.0f, 0.0f};
  const float d = amax / 127.0f;
  return {d, 1.0f / d};
}

}  // namespace
}  // namespace agentd_cpu
