// The kernel table: which function multiplies or dequantizes each ggml type on each ISA, chosen
// once from cpuid, and the row loops the bindings run on each thread's share of output rows.
//
// Invariant: a lookup never returns a kernel the CPU cannot run (dispatch.cpp is the only place
// that reads cpuid), and a type whose kernels are not compiled in (the K-quant files, linked as
// weak symbols) is reported absent instead of failing to load.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "ggml_blocks.h"

namespace agentd_cpu {

enum Isa : int { kIsaScalar = 0, kIsaAvx2 = 1, kIsaAvx512 = 2 };
// How a type's products take their activations: fp32 rows as they are, or quantized blocks.
enum ActKind : int { kActF32 = 0, kActQ8_32 = 1, kActQ8_256 = 2 };

struct TypeKernels {
  ActKind act;
  int block_weights, block_bytes;
  VecDotFn dot;           // nullptr for F32 (torch multiplies those)
  VecDotColsFn dot_cols;  // nullptr where the ISA of dot has none (then dot per column)
  DequantRowFn dequant;
};

// The best ISA this CPU and OS support (cpuid and XCR0 via __builtin_cpu_supports).
int best_isa();
// Whether the CPU has AVX512-BF16 (vdpbf16ps), beside best_isa() == kIsaAvx512.
bool cpu_has_avx512_bf16();
// The kernels of a ggml type at an ISA (each function falling back to the nearest lower ISA that
// has one); false when the type has no kernels compiled in.
bool type_kernels(int type_id, int isa, TypeKernels* out);
QuantizeActFn act_quantizer(ActKind kind, int isa);
size_t act_row_bytes(ActKind kind, int K);

// out[j * out_stride + r] = dot(weight row r, activation row j) for r in [r0, r1), j < n.
void dot_rows(const TypeKernels& k, int K, const uint8_t* w, int64_t w_stride, int64_t r0,
              int64_t r1, const uint8_t* act, int64_t act_stride, int64_t n, float* out,
              int64_t out_stride);
// Weight rows [r0, r1) into fp32 rows out + (r - r0) * out_stride.
void dequant_rows(const TypeKernels& k, int K, const uint8_t* w, int64_t w_stride, int64_t r0,
                  int64_t r1, float* out, int64_t out_stride);

// Runs an ISA's quantizers and products on random blocks against the scalar ones; returns ""
// when they agree, else what disagreed (so an ISA that cannot be tested where it is built is
// never trusted blindly).
std::string self_check(int isa);

}  // namespace agentd_cpu
