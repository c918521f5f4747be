// fp16 and bf16 -> fp32, exact for every input (subnormals, infinities, NaNs): the one
// definition the kernel files share (kquants_common.h, simple_common.h, ops_impl.h).
//
// Invariant: internal linkage only (an anonymous namespace), so each ISA file compiles its own
// copy under its own target pragma and no instruction set leaks across files through the linker.
#pragma once

#include <cstdint>
#include <cstring>

namespace agentd_cpu {
namespace {

inline float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);  // rebias 15 -> 127
  } else {
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24, exact
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

}  // namespace
}  // namespace agentd_cpu
