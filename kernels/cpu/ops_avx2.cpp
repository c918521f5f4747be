// ops.h's fused decode-step operations for AVX2 + FMA + F16C (ops_impl.h under this target).
#pragma GCC target("avx2,fma,f16c,bmi2")
#pragma GCC optimize("no-trapping-math")
#define AGENTD_OPS_AVX2 1
#include "ops_impl.h"

namespace agentd_cpu {

const OpsKernels& ops_kernels_avx2() { return kOps; }

}  // namespace agentd_cpu
