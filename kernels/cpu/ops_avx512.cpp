// ops.h's fused decode-step operations for AVX-512 (ops_impl.h under this target).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")
#pragma GCC optimize("no-trapping-math")
// GCC 12's AVX-512 headers build their "undefined" vectors as self-initialized variables, which
// -Wall reports at every inlined use (a false positive fixed in GCC 13).
#pragma GCC diagnostic ignored "-Wuninitialized"
#define AGENTD_OPS_AVX512 1
#include "ops_impl.h"

namespace agentd_cpu {

const OpsKernels& ops_kernels_avx512() { return kOps; }

}  // namespace agentd_cpu
