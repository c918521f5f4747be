// The fused decode-step operations of ops.h, written once and compiled per ISA: the including
// file sets its target pragma and defines AGENTD_OPS_AVX512 or AGENTD_OPS_AVX2 (neither: the
// scalar build), which choose the vector shim (ops_vec.h); every other loop is plain C++ that
// GCC vectorizes under the file's target (no-trapping-math: selects on floats, as in the clamps
// of exp_fast, are only if-converted without traps; nothing here reads FP flags). Attention is
// ops_attention.h (decode) and ops_prefill.h (prefill), the KV-row store ops_convert.h; the
// norm, SiLU and rotary are here.
//
// Invariant: internal linkage only (an anonymous namespace), so no instruction set leaks across
// the ISA files through the linker.
#pragma once

#include <cmath>
#include <cstdint>

#include "ops.h"
#include "ops_attention.h"
#include "ops_convert.h"
#include "ops_prefill.h"
#include "ops_vec.h"

namespace agentd_cpu {
namespace {

void add_rms_norm(int n, const float* x, float* residual, const float* weight, float eps,
                  float* out) {
  if (x != nullptr) {
    for (int i = 0; i < n; ++i) residual[i] += x[i];
  }
  const float inv = 1.0f / std::sqrt(dot(residual, residual, n) / n + eps);
  for (int k = 0; k < n; ++k) out[k] = residual[k] * inv * weight[k];
}

void silu_mul(int n, const float* gate, const float* up, float* out) {
  for (int i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + exp_fast(-gate[i])) * up[i];
}

void rope(float* x, int num_heads, int64_t head_stride, int head_dim, const float* cos,
          const float* sin, bool interleaved) {
  const int half = head_dim / 2;
  for (int h = 0; h < num_heads; ++h) {
    float* v = x + h * head_stride;
    if (interleaved) {
      for (int i = 0; i < half; ++i) {
        const float a = v[2 * i], b = v[2 * i + 1];
        v[2 * i] = a * cos[i] - b * sin[i];
        v[2 * i + 1] = b * cos[i] + a * sin[i];
      }
    } else {
      for (int i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * cos[i] - b * sin[i];
        v[i + half] = b * cos[i] + a * sin[i];
      }
    }
  }
}

constexpr OpsKernels kOps = {attend_span, merge_spans, add_rms_norm, silu_mul,
                             rope,        store_row,   attend_chunk};

}  // namespace
}  // namespace agentd_cpu
