// Prefill attention with its products in bfloat16 (ops_prefill.h's attend_chunk_bf16): AVX512-BF16
// under this file's own target, so the rest of the AVX-512 kernels never need it. Built by GCC 10
// and later (the first with these intrinsics); elsewhere, and on CPUs without AVX512-BF16,
// attend_chunk_bf16_kernel() is nullptr and prefill stays on the fp32 kernel.
#include "dispatch.h"
#include "ops.h"

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,bmi2")
#pragma GCC optimize("no-trapping-math")
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wunused-function"
#define AGENTD_OPS_AVX512 1
#define AGENTD_PREFILL_BF16 1
#include "ops_prefill.h"

namespace agentd_cpu {

AttendChunkFn attend_chunk_bf16_kernel() {
  return cpu_has_avx512_bf16() ? attend_chunk_bf16 : nullptr;
}

}  // namespace agentd_cpu
#else
namespace agentd_cpu {

AttendChunkFn attend_chunk_bf16_kernel() { return nullptr; }

}  // namespace agentd_cpu
#endif
