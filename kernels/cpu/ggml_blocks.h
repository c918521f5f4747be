// GGUF (ggml) block layouts of the weight formats agentd serves as shipped, and the int8
// activation blocks its products quantize inputs into. The weight layouts are the file format's
// (little-endian, packed, no padding); the activation layouts are agentd's own.
//
// Invariant: sizeof of every weight block equals the GGUF type's bytes per block (static_assert).
#pragma once

#include <cstddef>
#include <cstdint>

namespace agentd_cpu {

constexpr int QK32 = 32;    // weights per block of Q4_0, Q4_1, Q8_0
constexpr int QK_K = 256;   // weights per super-block of the K-quants

// ggml type ids as written in a GGUF tensor table.
enum GgmlType : int {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30,
};

#pragma pack(push, 1)
struct BlockQ4_0 {  // w = d * (q - 8); q[j] = qs[j] & 15 (j < 16), qs[j - 16] >> 4 (j >= 16)
  uint16_t d;       // fp16
  uint8_t qs[QK32 / 2];
};
struct BlockQ4_1 {  // w = d * q + m, q as in Q4_0
  uint16_t d, m;    // fp16
  uint8_t qs[QK32 / 2];
};
struct BlockQ8_0 {  // w = d * q
  uint16_t d;       // fp16
  int8_t qs[QK32];
};
// Sub-block j (0..7) of 32 weights: w = d * sc[j] * q - dmin * m[j], 6-bit sc/m packed in
// scales[12]: j < 4: sc = scales[j] & 63, m = scales[j + 4] & 63; j >= 4:
// sc = (scales[j + 4] & 15) | ((scales[j - 4] >> 6) << 4), m = (scales[j + 4] >> 4) |
// ((scales[j] >> 6) << 4). Values: qs[32 * (j / 2) + l] low nibble (j even) or high (j odd).
struct BlockQ4_K {
  uint16_t d, dmin;  // fp16
  uint8_t scales[12];
  uint8_t qs[QK_K / 2];
};
// As Q4_K, and bit j of qh[l] is bit 4 of weight l of sub-block j.
struct BlockQ5_K {
  uint16_t d, dmin;  // fp16
  uint8_t scales[12];
  uint8_t qh[QK_K / 8];
  uint8_t qs[QK_K / 2];
};
// 16 groups of 16 weights, w = d * scales[g] * (q - 32), q 6-bit: for half h (0, 1; 128
// weights each) with ql += 64 h, qh += 32 h, sc = scales + 8 h, and l in 0..31:
//   y[l]      = (ql[l] & 15)      | ((qh[l] >> 0 & 3) << 4), scale sc[l / 16 + 0]
//   y[l + 32] = (ql[l + 32] & 15) | ((qh[l] >> 2 & 3) << 4), scale sc[l / 16 + 2]
//   y[l + 64] = (ql[l] >> 4)      | ((qh[l] >> 4 & 3) << 4), scale sc[l / 16 + 4]
//   y[l + 96] = (ql[l + 32] >> 4) | ((qh[l] >> 6 & 3) << 4), scale sc[l / 16 + 6]
struct BlockQ6_K {
  uint8_t ql[QK_K / 2];
  uint8_t qh[QK_K / 4];
  int8_t scales[QK_K / 16];
  uint16_t d;  // fp16
};

// Activations, quantized once per product (agentd's own layouts).
struct ActQ8_32 {  // x ~= d * qs, s = d * sum(qs) (the Q4_1 minimum's term)
  float d, s;
  int8_t qs[QK32];
};
struct ActQ8_256 {  // x ~= d * qs, bsums[g] = sum of qs[16 g .. 16 g + 15] (the K-quants' mins)
  float d;
  int8_t qs[QK_K];
  int16_t bsums[QK_K / 16];
};
#pragma pack(pop)

static_assert(sizeof(BlockQ4_0) == 18, "Q4_0 block");
static_assert(sizeof(BlockQ4_1) == 20, "Q4_1 block");
static_assert(sizeof(BlockQ8_0) == 34, "Q8_0 block");
static_assert(sizeof(BlockQ4_K) == 144, "Q4_K block");
static_assert(sizeof(BlockQ5_K) == 176, "Q5_K block");
static_assert(sizeof(BlockQ6_K) == 210, "Q6_K block");

// One weight row (K weights, K a multiple of the type's block) times one quantized activation
// row; returns the dot product in fp32. Every ISA file defines the set it accelerates.
using VecDotFn = float (*)(int K, const void* w_row, const void* act_row);
// Dequantize one weight row into K floats.
using DequantRowFn = void (*)(int K, const void* w_row, float* out);

// K-quant dot products (kquants_*.cpp), one set per ISA.
float vec_dot_q4_K_scalar(int K, const void* w, const void* a);
float vec_dot_q5_K_scalar(int K, const void* w, const void* a);
float vec_dot_q6_K_scalar(int K, const void* w, const void* a);
float vec_dot_q4_K_avx2(int K, const void* w, const void* a);
float vec_dot_q5_K_avx2(int K, const void* w, const void* a);
float vec_dot_q6_K_avx2(int K, const void* w, const void* a);
float vec_dot_q4_K_avx512(int K, const void* w, const void* a);
float vec_dot_q5_K_avx512(int K, const void* w, const void* a);
float vec_dot_q6_K_avx512(int K, const void* w, const void* a);
void dequant_row_q4_K(int K, const void* w, float* out);
void dequant_row_q5_K(int K, const void* w, float* out);
void dequant_row_q6_K(int K, const void* w, float* out);
// AVX2 dequantization of K-quant rows (kquants_avx2.cpp), same values as the scalar ones.
void dequant_row_q4_K_avx2(int K, const void* w, float* out);
void dequant_row_q5_K_avx2(int K, const void* w, float* out);
void dequant_row_q6_K_avx2(int K, const void* w, float* out);

// Activation quantizers (simple_*.cpp): one fp32 row of K values (K a multiple of the block)
// into K / 32 ActQ8_32 or K / 256 ActQ8_256 blocks. Per block: d = absmax / 127 (a block below
// 1e-30 in absmax is all zeros, d = 0), qs = round-half-even(x * (1 / d)); every ISA computes
// these same fp32 operations, so the blocks are bit-identical across ISAs.
using QuantizeActFn = void (*)(int K, const float* x, void* out);
void quantize_act_q8_32_scalar(int K, const float* x, void* out);
void quantize_act_q8_32_avx2(int K, const float* x, void* out);
void quantize_act_q8_32_avx512(int K, const float* x, void* out);
void quantize_act_q8_256_scalar(int K, const float* x, void* out);
void quantize_act_q8_256_avx2(int K, const float* x, void* out);
void quantize_act_q8_256_avx512(int K, const float* x, void* out);

// Q4_0, Q4_1, Q8_0 rows times ActQ8_32 rows; F16 and BF16 rows times fp32 rows (simple_*.cpp).
float vec_dot_q4_0_scalar(int K, const void* w, const void* a);
float vec_dot_q4_1_scalar(int K, const void* w, const void* a);
float vec_dot_q8_0_scalar(int K, const void* w, const void* a);
float vec_dot_f16_scalar(int K, const void* w, const void* a);
float vec_dot_bf16_scalar(int K, const void* w, const void* a);
float vec_dot_q4_0_avx2(int K, const void* w, const void* a);
float vec_dot_q4_1_avx2(int K, const void* w, const void* a);
float vec_dot_q8_0_avx2(int K, const void* w, const void* a);
float vec_dot_f16_avx2(int K, const void* w, const void* a);
float vec_dot_bf16_avx2(int K, const void* w, const void* a);
float vec_dot_q4_0_avx512(int K, const void* w, const void* a);
float vec_dot_q4_1_avx512(int K, const void* w, const void* a);
float vec_dot_q8_0_avx512(int K, const void* w, const void* a);
float vec_dot_f16_avx512(int K, const void* w, const void* a);
float vec_dot_bf16_avx512(int K, const void* w, const void* a);
// One weight row times n activation rows act + j * act_stride (bytes), into out[j * out_stride]:
// the weights unpacked once for several rows (decode batches). Optional per type and ISA (the
// dispatcher loops over VecDotFn where absent); each result equals the VecDotFn's bit for bit.
using VecDotColsFn = void (*)(int K, const void* w_row, const void* act, size_t act_stride,
                              int n, float* out, size_t out_stride);
void vec_dot_cols_q4_0_avx2(int K, const void* w, const void* act, size_t act_stride, int n,
                            float* out, size_t out_stride);
void vec_dot_cols_q4_1_avx2(int K, const void* w, const void* act, size_t act_stride, int n,
                            float* out, size_t out_stride);
void vec_dot_cols_q8_0_avx2(int K, const void* w, const void* act, size_t act_stride, int n,
                            float* out, size_t out_stride);
void vec_dot_cols_q4_0_avx512(int K, const void* w, const void* act, size_t act_stride, int n,
                              float* out, size_t out_stride);
void vec_dot_cols_q4_1_avx512(int K, const void* w, const void* act, size_t act_stride, int n,
                              float* out, size_t out_stride);
void vec_dot_cols_q8_0_avx512(int K, const void* w, const void* act, size_t act_stride, int n,
                              float* out, size_t out_stride);
// K-quant column kernels (kquants_avx2/avx512.cpp; dispatch.cpp links them weak, like every
// K-quant symbol, and self-checks them against the one-row kernels).
void vec_dot_cols_q4_K_avx2(int K, const void* w, const void* act, size_t act_stride, int n,
                            float* out, size_t out_stride);
void vec_dot_cols_q5_K_avx2(int K, const void* w, const void* act, size_t act_stride, int n,
                            float* out, size_t out_stride);
void vec_dot_cols_q6_K_avx2(int K, const void* w, const void* act, size_t act_stride, int n,
                            float* out, size_t out_stride);
void vec_dot_cols_q4_K_avx512(int K, const void* w, const void* act, size_t act_stride, int n,
                              float* out, size_t out_stride);
void vec_dot_cols_q5_K_avx512(int K, const void* w, const void* act, size_t act_stride, int n,
                              float* out, size_t out_stride);
void vec_dot_cols_q6_K_avx512(int K, const void* w, const void* act, size_t act_stride, int n,
                              float* out, size_t out_stride);
// Dequantization (exact: every value is one fp32 product of an fp16 and a small integer, plus
// Q4_1's minimum, rounded once), scalar and AVX2 with the same results.
void dequant_row_q4_0(int K, const void* w, float* out);
void dequant_row_q4_1(int K, const void* w, float* out);
void dequant_row_q8_0(int K, const void* w, float* out);
void dequant_row_f16(int K, const void* w, float* out);
void dequant_row_bf16(int K, const void* w, float* out);
void dequant_row_f32(int K, const void* w, float* out);
void dequant_row_q4_0_avx2(int K, const void* w, float* out);
void dequant_row_q4_1_avx2(int K, const void* w, float* out);
void dequant_row_q8_0_avx2(int K, const void* w, float* out);
void dequant_row_f16_avx2(int K, const void* w, float* out);
void dequant_row_bf16_avx2(int K, const void* w, float* out);

}  // namespace agentd_cpu
