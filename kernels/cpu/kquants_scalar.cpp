// K-quant (Q4_K, Q5_K, Q6_K) products and dequantization in portable C++: the reference the
// AVX2 and AVX-512 files are checked against, and the path on CPUs with neither.
//
// Invariant: a super-block's integer sums are exact in int32 (below 2^29 in magnitude), and each
// super-block costs one multiply by fp16(d) * act.d (and one by fp16(dmin) * act.d for the
// minimums). Dequantized values equal gguf's exactly: d * sc * q (an fp16 times integers of at
// most 8 and 6 bits) and dmin * m are exact in fp32, so the only rounding is the subtraction,
// whether or not the compiler contracts it into a fused multiply-add.
#include <cstddef>
#include <cstdint>

#include "ggml_blocks.h"
#include "kquants_common.h"

namespace agentd_cpu {
namespace {

// Sum of q[l] * x[l] over one 32-weight Q4_K/Q5_K sub-block, q = 4-bit nibble plus bit 4 from qh.
inline int32_t sub_block_dot(const uint8_t* qs, int shift, const uint8_t* qh, int hbit,
                             const int8_t* x) {
  int32_t sum = 0;
  for (int l = 0; l < 32; ++l) {
    int q = (qs[l] >> shift) & 15;
    if (qh != nullptr) q |= ((qh[l] >> hbit) & 1) << 4;
    sum += q * x[l];
  }
  return sum;
}

// Shared by Q4_K and Q5_K (qh == nullptr for Q4_K): they differ only in bit 4 of q.
float dot_q45_K(int K, const uint8_t* row, size_t block_bytes, size_t scales_off,
                ptrdiff_t qh_off, size_t qs_off, const ActQ8_256* act) {
  float sum = 0.0f;
  for (int b = 0; b < K / QK_K; ++b) {
    const uint8_t* blk = row + b * block_bytes;
    const ActQ8_256& a = act[b];
    const KqScaleMins sm = kq_unpack_scale_mins(blk + scales_off);
    const uint8_t* qh = qh_off < 0 ? nullptr : blk + qh_off;
    int32_t dot = 0, min_dot = 0;
    for (int j = 0; j < 8; ++j) {
      const int32_t s = sub_block_dot(blk + qs_off + 32 * (j / 2), 4 * (j & 1), qh, j,
                                      a.qs + 32 * j);
      dot += kq_byte(sm.scales, j) * s;
      min_dot += kq_byte(sm.mins, j) * (a.bsums[2 * j] + a.bsums[2 * j + 1]);
    }
    uint16_t d16, dmin16;
    std::memcpy(&d16, blk, 2);
    std::memcpy(&dmin16, blk + 2, 2);
    sum += fp16_to_fp32(d16) * a.d * static_cast<float>(dot) -
           fp16_to_fp32(dmin16) * a.d * static_cast<float>(min_dot);
  }
  return sum;
}

void dequant_q45_K(int K, const uint8_t* row, size_t block_bytes, size_t scales_off,
                   ptrdiff_t qh_off, size_t qs_off, float* out) {
  for (int b = 0; b < K / QK_K; ++b, out += QK_K) {
    const uint8_t* blk = row + b * block_bytes;
    const KqScaleMins sm = kq_unpack_scale_mins(blk + scales_off);
    uint16_t d16, dmin16;
    std::memcpy(&d16, blk, 2);
    std::memcpy(&dmin16, blk + 2, 2);
    const float d = fp16_to_fp32(d16), dmin = fp16_to_fp32(dmin16);
    for (int j = 0; j < 8; ++j) {
      const float ds = d * kq_byte(sm.scales, j), dm = dmin * kq_byte(sm.mins, j);
      const uint8_t* qs = blk + qs_off + 32 * (j / 2);
      const int shift = 4 * (j & 1);
      for (int l = 0; l < 32; ++l) {
        int q = (qs[l] >> shift) & 15;
        if (qh_off >= 0) q |= ((blk[qh_off + l] >> j) & 1) << 4;
        out[32 * j + l] = ds * static_cast<float>(q) - dm;
      }
    }
  }
}

constexpr size_t kQ4Scales = offsetof(BlockQ4_K, scales), kQ4Qs = offsetof(BlockQ4_K, qs);
constexpr size_t kQ5Scales = offsetof(BlockQ5_K, scales), kQ5Qs = offsetof(BlockQ5_K, qs);
constexpr ptrdiff_t kQ5Qh = offsetof(BlockQ5_K, qh);

// The 128 values (0..63, the -32 offset not applied) of half h of a Q6_K super-block, in weight
// order; plain loops over 32 bytes, which compilers vectorize.
inline void q6_half(const BlockQ6_K& blk, int h, uint8_t q[128]) {
  const uint8_t* ql = blk.ql + 64 * h;
  const uint8_t* qh = blk.qh + 32 * h;
  for (int l = 0; l < 32; ++l) {
    q[l] = static_cast<uint8_t>((ql[l] & 15) | ((qh[l] & 3) << 4));
    q[l + 32] = static_cast<uint8_t>((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4));
    q[l + 64] = static_cast<uint8_t>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
    q[l + 96] = static_cast<uint8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
  }
}

}  // namespace

float vec_dot_q4_K_scalar(int K, const void* w, const void* a) {
  return dot_q45_K(K, static_cast<const uint8_t*>(w), sizeof(BlockQ4_K), kQ4Scales, -1, kQ4Qs,
                   static_cast<const ActQ8_256*>(a));
}

float vec_dot_q5_K_scalar(int K, const void* w, const void* a) {
  return dot_q45_K(K, static_cast<const uint8_t*>(w), sizeof(BlockQ5_K), kQ5Scales, kQ5Qh, kQ5Qs,
                   static_cast<const ActQ8_256*>(a));
}

float vec_dot_q6_K_scalar(int K, const void* w, const void* a) {
  const auto* blocks = static_cast<const BlockQ6_K*>(w);
  const auto* act = static_cast<const ActQ8_256*>(a);
  float sum = 0.0f;
  for (int b = 0; b < K / QK_K; ++b) {
    const BlockQ6_K& blk = blocks[b];
    const ActQ8_256& x = act[b];
    int32_t dot = 0;
    for (int h = 0; h < 2; ++h) {
      uint8_t q[128];
      q6_half(blk, h, q);
      for (int g = 0; g < 8; ++g) {  // groups of 16 weights, one scale each
        const int8_t* xg = x.qs + 128 * h + 16 * g;
        int32_t s = 0;
        for (int l = 0; l < 16; ++l) s += q[16 * g + l] * xg[l];
        // The -32 offset through the group's activation sum, exact in int32.
        dot += blk.scales[8 * h + g] * (s - 32 * x.bsums[8 * h + g]);
      }
    }
    sum += fp16_to_fp32(blk.d) * x.d * static_cast<float>(dot);
  }
  return sum;
}

void dequant_row_q4_K(int K, const void* w, float* out) {
  dequant_q45_K(K, static_cast<const uint8_t*>(w), sizeof(BlockQ4_K), kQ4Scales, -1, kQ4Qs, out);
}

void dequant_row_q5_K(int K, const void* w, float* out) {
  dequant_q45_K(K, static_cast<const uint8_t*>(w), sizeof(BlockQ5_K), kQ5Scales, kQ5Qh, kQ5Qs,
                out);
}

void dequant_row_q6_K(int K, const void* w, float* out) {
  const auto* blocks = static_cast<const BlockQ6_K*>(w);
  for (int b = 0; b < K / QK_K; ++b, out += QK_K) {
    const float d = fp16_to_fp32(blocks[b].d);
    for (int h = 0; h < 2; ++h) {
      uint8_t q[128];
      q6_half(blocks[b], h, q);
      for (int g = 0; g < 8; ++g) {  // groups of 16 weights, one scale each
        const float ds = d * static_cast<float>(blocks[b].scales[8 * h + g]);
        float* o = out + 128 * h + 16 * g;
        for (int l = 0; l < 16; ++l) o[l] = ds * static_cast<float>(q[16 * g + l] - 32);
      }
    }
  }
}

}  // namespace agentd_cpu
