// Helpers shared by the simple-format kernel files (simple_scalar/avx2/avx512.cpp): fp16/bf16
// decode and the activation quantizer's per-block scale.
//
// Invariant: internal linkage only (an anonymous namespace), so each ISA file compiles its own
// copy under its own target pragma; and block_scale is the one definition of an activation
// block's (d, 1/d) that every ISA's quantizer uses, so their blocks agree bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

#include "fp16.h"
#include "ggml_blocks.h"

namespace agentd_cpu {
namespace {

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
