// The one loop every column kernel (one weight row times n activation rows) runs: rows four at
// a time, the 1-3 left in one call. kernel.operator()<N>(activation rows, out) handles N rows
// whose results equal the N = 1 call's bit for bit, so a row's result never depends on its
// batch.
//
// Invariant: internal linkage only (an anonymous namespace): each ISA file instantiates it
// under its own target pragma.
#pragma once

#include <cstddef>
#include <cstdint>

namespace agentd_cpu {
namespace {

template <typename Kernel>
inline void by_columns(int n, const void* act, size_t act_stride, float* out, size_t out_stride,
                       Kernel kernel) {
  const auto* a = static_cast<const uint8_t*>(act);
  int c = 0;
  for (; c + 4 <= n; c += 4) kernel.template operator()<4>(a + c * act_stride, out + c * out_stride);
  switch (n - c) {
    case 3: kernel.template operator()<3>(a + c * act_stride, out + c * out_stride); break;
    case 2: kernel.template operator()<2>(a + c * act_stride, out + c * out_stride); break;
    case 1: kernel.template operator()<1>(a + c * act_stride, out + c * out_stride); break;
    default: break;
  }
}

}  // namespace
}  // namespace agentd_cpu
