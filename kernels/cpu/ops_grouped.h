// Decode attention's grouped pieces (query heads sharing a KV head, G > 1, as the 8B's four a
// KV head): each key or value widened once for its query heads. ops_attention.h's
// attend_span_as runs them. Its key pass takes two KV heads a slot at a time and writes scores
// straight from registers; its value pass keeps outputs in registers over runs of 16 slots. One
// Zen 5 thread, the 8B's shape (32 query heads on 8 KV heads of 128) over 1,024 cached slots:
// 0.26 -> 0.16 ms a layer (f16 and q8_0 alike); at 16k tokens on 2 threads, pools past the
// caches: q8_0 2.9 -> 2.4 ms a layer, f16 ~3.2 either way (its reads, not its arithmetic, set
// it); the runner's 8B step at 16k with q8_0 KV 188-193 -> 167-169 ms. Both run on AVX-512
// only (attend_span_as checks kWidth); AVX2 keeps one KV head a slot and axpy_shared.
//
// Invariant: internal linkage only (an anonymous namespace); vector ISAs only (the scalar build
// takes every query head on its own); fp32 products and sums, as the ungrouped path's.
#pragma once

#include <algorithm>
#include <cstdint>

#include "ops.h"
#include "ops_vec.h"

namespace agentd_cpu {
namespace {

#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
// dot4_kv for N <= 4 queries that read one key (query heads sharing a KV head), for M = 1 or
// 2 such keys at once (two KV heads' chains interleaved: one head's eight-deep chains of
// multiply-adds left the core waiting on their latency): each key widened once for its N
// queries. Query i = m * N + j (at q + i * D) reads k[m]; its score goes to out[i * stride].
// Each query's sum takes the same operations in the same order as dot4_kv's.
template <KvDtype kT, int N, int M = 1>
inline void dotn_shared_kv(const float* q, const void* const* k, int D, float* out,
                           int64_t stride) {
  Vec a[M][4];
  for (int m = 0; m < M; ++m) a[m][0] = a[m][1] = a[m][2] = a[m][3] = vzero();
  if constexpr (kT == kKvQ8) {
    constexpr int kVecs = kQ8Group / kWidth;
    for (int d = 0; d < D; d += kQ8Group) {
      for (int m = 0; m < M; ++m) {
        const uint8_t* b = q8_block(k[m], d);
        const Vec scale = vset1(q8_scale(b));
        Vec w[kVecs];
        for (int c = 0; c < kVecs; ++c) w[c] = widen_i8(b + 2 + c * kWidth);
        for (int j = 0; j < N; ++j) {
          const float* qj = q + (m * N + j) * D + d;
          Vec t = vzero();
          for (int c = 0; c < kVecs; ++c) t = vfma(vload(qj + c * kWidth), w[c], t);
          a[m][j] = vfma(scale, t, a[m][j]);
        }
      }
    }
  } else {
    for (int d = 0; d < D; d += kWidth) {
      for (int m = 0; m < M; ++m) {
        const Vec w = widen_vec<kT>(k[m], d);
        for (int j = 0; j < N; ++j) a[m][j] = vfma(vload(q + (m * N + j) * D + d), w, a[m][j]);
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    store_lanes(reduce4(a[m][0], a[m][1], a[m][2], a[m][3]), out + m * N * stride, stride, N);
  }
}

// axpy_kv for N <= 4 queries that read one value row: y[j] += a[j] * v, v widened once; each
// y[j] takes axpy_kv's operations in its order.
template <KvDtype kT, int N>
inline void axpyn_shared_kv(float* const* y, const float* a, const void* v, int D) {
  if constexpr (kT == kKvQ8) {
    constexpr int kVecs = kQ8Group / kWidth;
    for (int i = 0; i < D; i += kQ8Group) {
      const uint8_t* b = q8_block(v, i);
      const float scale = q8_scale(b);
      Vec w[kVecs];
      for (int c = 0; c < kVecs; ++c) w[c] = widen_i8(b + 2 + c * kWidth);
      for (int j = 0; j < N; ++j) {
        const Vec wj = vset1(a[j] * scale);
        for (int c = 0; c < kVecs; ++c) {
          float* yc = y[j] + i + c * kWidth;
          vstore(yc, vfma(wj, w[c], vload(yc)));
        }
      }
    }
  } else {
    Vec va[N];
    for (int j = 0; j < N; ++j) va[j] = vset1(a[j]);
    for (int i = 0; i < D; i += kWidth) {
      const Vec w = widen_vec<kT>(v, i);
      for (int j = 0; j < N; ++j) vstore(y[j] + i, vfma(va[j], w, vload(y[j] + i)));
    }
  }
}

// The query heads [i0, i0 + n) of one KV head (n <= 4): their scores against key k, or their
// sums plus weights times value v.
template <KvDtype kT>
inline void dot_shared(const float* q, int n, const void* k, int D, float* out,
                       int64_t stride) {
  switch (n) {
    case 4: dotn_shared_kv<kT, 4>(q, &k, D, out, stride); break;
    case 3: dotn_shared_kv<kT, 3>(q, &k, D, out, stride); break;
    case 2: dotn_shared_kv<kT, 2>(q, &k, D, out, stride); break;
    default: dotn_shared_kv<kT, 1>(q, &k, D, out, stride);
  }
}

template <KvDtype kT>
inline void axpy_shared(float* const* y, const float* a, int n, const void* v, int D) {
  switch (n) {
    case 4: axpyn_shared_kv<kT, 4>(y, a, v, D); break;
    case 3: axpyn_shared_kv<kT, 3>(y, a, v, D); break;
    case 2: axpyn_shared_kv<kT, 2>(y, a, v, D); break;
    default: axpyn_shared_kv<kT, 1>(y, a, v, D);
  }
}
// The value pass of one row's span [p0, p1) with G query heads a KV head: slots in runs of up
// to 16 inside one block; each KV head's query heads four at a time (N of them), their output
// rows held in registers over a run (kChunk vectors of each at a time), where slot by slot
// (axpy_shared) every output vector was loaded and stored back every slot: 32 stores a KV head
// and slot at head dim 128. values(pos) is slot pos's value row (all KV heads); the slots of
// one block lie `stride` bytes apart; query i's weights are scores[i * ns + pos - p0], its sums
// partial[i * (D + 2) + 2 ..]. D is a multiple of kChunk * kWidth. Run on AVX-512 only: with
// AVX2's 16 registers the 8B's f16 pass ran ~10% slower this way than slot by slot.
constexpr int kChunk = 4;  // 16 accumulators: half of AVX-512's registers

template <KvDtype kT, int N>
inline void values_run(const char* v, int64_t stride, int n, int D, const float* w, int64_t ns,
                       float* y) {
  for (int d0 = 0; d0 < D; d0 += kChunk * kWidth) {
    Vec acc[N][kChunk];
    for (int j = 0; j < N; ++j) {
      for (int c = 0; c < kChunk; ++c) acc[j][c] = vload(y + j * (D + 2) + d0 + c * kWidth);
    }
    for (int t = 0; t < n; ++t) {
      const char* vt = v + t * stride;
      Vec x[kChunk];
      for (int c = 0; c < kChunk; ++c) x[c] = widen_vec<kT>(vt, d0 + c * kWidth);
      for (int j = 0; j < N; ++j) {
        const Vec wj = vset1(w[j * ns + t]);
        for (int c = 0; c < kChunk; ++c) acc[j][c] = vfma(wj, x[c], acc[j][c]);
      }
    }
    for (int j = 0; j < N; ++j) {
      for (int c = 0; c < kChunk; ++c) vstore(y + j * (D + 2) + d0 + c * kWidth, acc[j][c]);
    }
  }
}

template <KvDtype kT, typename Rows>
void values_grouped(const Rows& values, int64_t stride, int block_size, int64_t row_bytes,
                    int p0, int p1, int G, int Q, int D, const float* scores, int64_t ns,
                    const int64_t* head_of, float* partial) {
  auto run_end = [&](int pos) {
    return std::min({p1, pos + 16, (pos / block_size + 1) * block_size});
  };
  for (int pos = p0; pos < p1;) {
    const int end = run_end(pos);
    for (int t = end; t < (end < p1 ? run_end(end) : end); ++t) {  // the next run's rows
      const char* row = values(t);
      for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(row + off, _MM_HINT_T0);
    }
    const char* first = values(pos);
    for (int i0 = 0; i0 < Q; i0 += G) {  // one KV head's query heads
      const char* vh = first + head_of[i0];
      for (int g = 0; g < G; g += 4) {
        const float* w = scores + (i0 + g) * ns + pos - p0;
        float* y = partial + static_cast<int64_t>(i0 + g) * (D + 2) + 2;
        switch (std::min(4, G - g)) {
          case 4: values_run<kT, 4>(vh, stride, end - pos, D, w, ns, y); break;
          case 3: values_run<kT, 3>(vh, stride, end - pos, D, w, ns, y); break;
          case 2: values_run<kT, 2>(vh, stride, end - pos, D, w, ns, y); break;
          default: values_run<kT, 1>(vh, stride, end - pos, D, w, ns, y);
        }
      }
    }
    pos = end;
  }
}
#endif

}  // namespace
}  // namespace agentd_cpu
