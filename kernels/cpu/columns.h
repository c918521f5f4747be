// The one loop every column kernel (one weight row times n activation rows) runs: rows kMax at
// a time (4 by default; 8 where AVX-512's 32 registers hold their accumulators), then 4, then
// the 1-3 left in one call. kernel.operator()<N>(activation rows, out) handles N rows
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

template <int kMax = 4, typename Kernel>
inline void by_columns(int n, const void* act, size_t act_stride, float* out, size_t out_stride,
                       Kernel kernel) {
  const auto* a = static_cast<const uint8_t*>(act);
  int c = 0;
  for (; c + kMax <= n; c += kMax) {
    kernel.template operator()<kMax>(a + c * act_stride, out + c * out_stride);
  }
  const int left = n - c;
  a += c * act_stride, out += c * out_stride;
  if constexpr (kMax > 4) {
    if (left >= 4) {
      kernel.template operator()<4>(a, out);
      by_columns<4>(left - 4, a + 4 * act_stride, act_stride, out + 4 * out_stride, out_stride,
                    kernel);
      return;
    }
  }
  switch (left) {
    case 3: kernel.template operator()<3>(a, out); break;
    case 2: kernel.template operator()<2>(a, out); break;
    case 1: kernel.template operator()<1>(a, out); break;
    default: break;
  }
}

}  // namespace
}  // namespace agentd_cpu
