// Helpers shared by the K-quant kernel files (kquants_scalar/avx2/avx512.cpp): the fp16 field
// decode and the unpacking of Q4_K/Q5_K's 6-bit scales and minimums.
//
// Invariant: everything here has internal linkage (an anonymous namespace), so each ISA file
// compiles its own copy under its own target pragma and no instruction set leaks across files
// through the linker's choice of one inline definition.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "columns.h"
#include "fp16.h"
#include "ggml_blocks.h"

namespace agentd_cpu {
namespace {

// The eight 6-bit scales and eight 6-bit minimums of a Q4_K/Q5_K super-block, one byte each,
// as two little-endian 64-bit words (byte j = sub-block j). Four bytes at a time: bytes 0-3 hold
// the low six bits of scales 0-3 (their top two bits are bits 4-5 of scales 4-7), bytes 4-7 the
// same for minimums, bytes 8-11 the low nibbles of scales 4-7 and (high nibbles) minimums 4-7.
struct KqScaleMins {
  uint64_t scales, mins;
};

inline KqScaleMins kq_unpack_scale_mins(const uint8_t* packed) {
  uint32_t w[3];
  std::memcpy(w, packed, 12);
  const uint32_t lo6 = 0x3f3f3f3fu, lo4 = 0x0f0f0f0fu, lo2 = 0x03030303u;
  const uint32_t sc_lo = w[0] & lo6;
  const uint32_t mn_lo = w[1] & lo6;
  const uint32_t sc_hi = (w[2] & lo4) | (((w[0] >> 6) & lo2) << 4);
  const uint32_t mn_hi = ((w[2] >> 4) & lo4) | (((w[1] >> 6) & lo2) << 4);
  return {sc_lo | static_cast<uint64_t>(sc_hi) << 32, mn_lo | static_cast<uint64_t>(mn_hi) << 32};
}

inline uint8_t kq_byte(uint64_t word, int j) { return static_cast<uint8_t>(word >> (8 * j)); }


}  // namespace
}  // namespace agentd_cpu
