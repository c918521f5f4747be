// ops.h's fused decode-step operations for any x86-64 CPU (ops_impl.h with the base target).
#pragma GCC optimize("no-trapping-math")
#include "ops_impl.h"

namespace agentd_cpu {

const OpsKernels& ops_kernels_scalar() { return kOps; }

}  // namespace agentd_cpu
