// Q4_0, Q4_1, Q8_0, F16, BF16 products, activation quantizers and dequantization in portable
// C++: the reference the AVX2 and AVX-512 files are checked against, and the path on CPUs with
// neither.
//
// Invariant: a block's integer dot product is exact in int32 (at most 32 * 15 * 127), and each
// block costs one multiply by the two fp16/fp32 scales; dequantized values are exact (an fp16
// times an integer of at most 8 bits, plus Q4_1's fp16 minimum, rounded once).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "ggml_blocks.h"
#include "simple_common.h"

namespace agentd_cpu {
namespace {

// Absmax-quantizes one block of qk floats into qs; returns d and writes the integer sum.
float quantize_block(int qk, const float* x, int8_t* qs, int32_t* sum_out) {
  float amax = 0.0f;
  bool non_finite = false;
  for (int i = 0; i < qk; ++i) {
    const float a = std::fabs(x[i]);
    non_finite |= !(a < INFINITY);
    amax = a > amax ? a : amax;
  }
  const BlockScale sc = block_scale(amax, non_finite);
  int32_t sum = 0;
  for (int i = 0; i < qk; ++i) {
    const int q = sc.inv_d == 0.0f ? 0 : static_cast<int>(std::nearbyint(x[i] * sc.inv_d));
    qs[i] = static_cast<int8_t>(q);
    sum += q;
  }
  *sum_out = sum;
  return sc.d;
}

// Sum of the 32 nibble values (low nibbles are weights 0..15, high ones 16..31) times acts.
inline int32_t nibble_dot(const uint8_t* qs, const int8_t* a, int offset) {
  int32_t sum = 0;
  for (int j = 0; j < QK32 / 2; ++j) {
    sum += ((qs[j] & 15) - offset) * a[j] + ((qs[j] >> 4) - offset) * a[j + QK32 / 2];
  }
  return sum;
}

template <typename Convert>
float dot_half(int K, const uint16_t* w, const float* x, Convert convert) {
  float acc[8] = {};
  int i = 0;
  for (; i + 8 <= K; i += 8) {
    for (int l = 0; l < 8; ++l) acc[l] += convert(w[i + l]) * x[i + l];
  }
  for (; i < K; ++i) acc[0] += convert(w[i]) * x[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

}  // namespace

void quantize_act_q8_32_scalar(int K, const float* x, void* out) {
  auto* blocks = static_cast<ActQ8_32*>(out);
  for (int b = 0; b < K / QK32; ++b) {
    int32_t sum;
    blocks[b].d = quantize_block(QK32, x + b * QK32, blocks[b].qs, &sum);
    blocks[b].s = blocks[b].d * static_cast<float>(sum);
  }
}

void quantize_act_q8_256_scalar(int K, const float* x, void* out) {
  auto* blocks = static_cast<ActQ8_256*>(out);
  for (int b = 0; b < K / QK_K; ++b) {
    int32_t sum;
    ActQ8_256& blk = blocks[b];
    blk.d = quantize_block(QK_K, x + b * QK_K, blk.qs, &sum);
    for (int g = 0; g < QK_K / 16; ++g) {
      int32_t group = 0;
      for (int i = 0; i < 16; ++i) group += blk.qs[16 * g + i];
      blk.bsums[g] = static_cast<int16_t>(group);
    }
  }
}

float vec_dot_q4_0_scalar(int K, const void* w, const void* a) {
  const auto* wb = static_cast<const BlockQ4_0*>(w);
  const auto* ab = static_cast<const ActQ8_32*>(a);
  float sum = 0.0f;
  for (int b = 0; b < K / QK32; ++b) {
    const int32_t dot = nibble_dot(wb[b].qs, ab[b].qs, 8);
    sum += fp16_to_fp32(wb[b].d) * ab[b].d * static_cast<float>(dot);
  }
  return sum;
}

float vec_dot_q4_1_scalar(int K, const void* w, const void* a) {
  const auto* wb = static_cast<const BlockQ4_1*>(w);
  const auto* ab = static_cast<const ActQ8_32*>(a);
  float sum = 0.0f;
  for (int b = 0; b < K / QK32; ++b) {
    const int32_t dot = nibble_dot(wb[b].qs, ab[b].qs, 0);
    sum += fp16_to_fp32(wb[b].d) * ab[b].d * static_cast<float>(dot) +
           fp16_to_fp32(wb[b].m) * ab[b].s;
  }
  return sum;
}

float vec_dot_q8_0_scalar(int K, const void* w, const void* a) {
  const auto* wb = static_cast<const BlockQ8_0*>(w);
  const auto* ab = static_cast<const ActQ8_32*>(a);
  float sum = 0.0f;
  for (int b = 0; b < K / QK32; ++b) {
    int32_t dot = 0;
    for (int j = 0; j < QK32; ++j) dot += wb[b].qs[j] * ab[b].qs[j];
    sum += fp16_to_fp32(wb[b].d) * ab[b].d * static_cast<float>(dot);
  }
  return sum;
}

float vec_dot_f16_scalar(int K, const void* w, const void* a) {
  return dot_half(K, static_cast<const uint16_t*>(w), static_cast<const float*>(a), fp16_to_fp32);
}

float vec_dot_bf16_scalar(int K, const void* w, const void* a) {
  return dot_half(K, static_cast<const uint16_t*>(w), static_cast<const float*>(a), bf16_to_fp32);
}

void dequant_row_q4_0(int K, const void* w, float* out) {
  const auto* wb = static_cast<const BlockQ4_0*>(w);
  for (int b = 0; b < K / QK32; ++b, out += QK32) {
    const float d = fp16_to_fp32(wb[b].d);
    for (int j = 0; j < QK32 / 2; ++j) {
      out[j] = d * static_cast<float>((wb[b].qs[j] & 15) - 8);
      out[j + QK32 / 2] = d * static_cast<float>((wb[b].qs[j] >> 4) - 8);
    }
  }
}

void dequant_row_q4_1(int K, const void* w, float* out) {
  const auto* wb = static_cast<const BlockQ4_1*>(w);
  for (int b = 0; b < K / QK32; ++b, out += QK32) {
    const float d = fp16_to_fp32(wb[b].d), m = fp16_to_fp32(wb[b].m);
    for (int j = 0; j < QK32 / 2; ++j) {
      out[j] = d * static_cast<float>(wb[b].qs[j] & 15) + m;
      out[j + QK32 / 2] = d * static_cast<float>(wb[b].qs[j] >> 4) + m;
    }
  }
}

void dequant_row_q8_0(int K, const void* w, float* out) {
  const auto* wb = static_cast<const BlockQ8_0*>(w);
  for (int b = 0; b < K / QK32; ++b, out += QK32) {
    const float d = fp16_to_fp32(wb[b].d);
    for (int j = 0; j < QK32; ++j) out[j] = d * static_cast<float>(wb[b].qs[j]);
  }
}

void dequant_row_f16(int K, const void* w, float* out) {
  const auto* h = static_cast<const uint16_t*>(w);
  for (int i = 0; i < K; ++i) out[i] = fp16_to_fp32(h[i]);
}

void dequant_row_bf16(int K, const void* w, float* out) {
  const auto* h = static_cast<const uint16_t*>(w);
  for (int i = 0; i < K; ++i) out[i] = bf16_to_fp32(h[i]);
}

void dequant_row_f32(int K, const void* w, float* out) { std::memcpy(out, w, sizeof(float) * K); }

}  // namespace agentd_cpu
