// Decode attention in spans (split-K, as flash-decoding does), on ops_vec.h's primitives: a
// span is some rows' queries (every head, pre-scaled) against a run of slots, so rows that share
// leading blocks read them once; it keeps per query its top score, the sum of exponentials under
// it and the weighted values, and merge_spans combines a row's spans exactly (rescaling each by
// exp(top_i - top)).
//
// Invariant: internal linkage only (an anonymous namespace); only slots below a sequence's
// length are read.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops.h"
#include "ops_grouped.h"
#include "ops_vec.h"

namespace agentd_cpu {
namespace {

// q (fp32) . k (n pool elements).
template <KvDtype kT>
inline float dot_kv(const float* q, const void* k, int n) {
  int i = 0;
  float s = 0.0f;
#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
  Vec acc = vzero();
  for (; i + kWidth <= n; i += kWidth) acc = vfma(vload(q + i), widen_vec<kT>(k, i), acc);
  s = vsum(acc);
#endif
  for (; i < n; ++i) s += q[i] * widen1<kT>(k, i);
  return s;
}

#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
// q . k over one q8_0 block (32 values at k, its scale not applied).
inline Vec dot_q8_block(const float* q, const uint8_t* k, Vec acc) {
  for (int c = 0; c < kQ8Group; c += kWidth) acc = vfma(vload(q + c), widen_i8(k + c), acc);
  return acc;
}
#endif

// q . k (k: D pool elements), as one lane of dot4_kv.
template <KvDtype kT>
inline float dot1_kv(const float* q, const void* k, int D) {
#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
  if constexpr (kT == kKvQ8) {  // each block's sum scaled once (D % 32 == 0 in a q8_0 pool)
    Vec a = vzero();
    for (int d = 0; d < D; d += kQ8Group) {
      const uint8_t* b = q8_block(k, d);
      a = vfma(vset1(q8_scale(b)), dot_q8_block(q + d, b + 2, vzero()), a);
    }
    return reduce1(a);
  }
  if (D % kWidth == 0) {
    Vec a = vzero();
    for (int d = 0; d < D; d += kWidth) a = vfma(vload(q + d), widen_vec<kT>(k, d), a);
    return reduce1(a);
  }
#endif
  return dot_kv<kT>(q, k, D);
}

#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
// q[i] . k[i] for i < 4 (k[i]: D pool elements) as the lanes of one vector; D % kWidth == 0
// (every q8_0 D is).
template <KvDtype kT>
inline __m128 dot4_vec(const float* const* q, const void* const* k, int D) {
  if constexpr (kT == kKvQ8) {
    Vec a[4] = {vzero(), vzero(), vzero(), vzero()};
    for (int d = 0; d < D; d += kQ8Group) {
      for (int j = 0; j < 4; ++j) {
        const uint8_t* b = q8_block(k[j], d);
        a[j] = vfma(vset1(q8_scale(b)), dot_q8_block(q[j] + d, b + 2, vzero()), a[j]);
      }
    }
    return reduce4(a[0], a[1], a[2], a[3]);
  }
  Vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
  for (int d = 0; d < D; d += kWidth) {
    a0 = vfma(vload(q[0] + d), widen_vec<kT>(k[0], d), a0);
    a1 = vfma(vload(q[1] + d), widen_vec<kT>(k[1], d), a1);
    a2 = vfma(vload(q[2] + d), widen_vec<kT>(k[2], d), a2);
    a3 = vfma(vload(q[3] + d), widen_vec<kT>(k[3], d), a3);
  }
  return reduce4(a0, a1, a2, a3);
}
#endif

// out[i] = q[i] . k[i] for i < 4 (k[i]: D pool elements).
template <KvDtype kT>
inline void dot4_kv(const float* const* q, const void* const* k, int D, float* out) {
#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
  if (kT == kKvQ8 || D % kWidth == 0) {
    _mm_storeu_ps(out, dot4_vec<kT>(q, k, D));
    return;
  }
#endif
  for (int i = 0; i < 4; ++i) out[i] = dot_kv<kT>(q[i], k[i], D);
}

// dot4_kv into floats `stride` apart: dst[i * stride] = q[i] . k[i].
template <KvDtype kT>
inline void dot4_kv_to(const float* const* q, const void* const* k, int D, float* dst,
                       int64_t stride) {
#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
  if (kT == kKvQ8 || D % kWidth == 0) {
    store_lanes(dot4_vec<kT>(q, k, D), dst, stride, 4);
    return;
  }
#endif
  for (int i = 0; i < 4; ++i) dst[i * stride] = dot_kv<kT>(q[i], k[i], D);
}

// y += a * v (n pool elements).
template <KvDtype kT>
inline void axpy_kv(float* y, float a, const void* v, int n) {
  int i = 0;
#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
  if constexpr (kT == kKvQ8) {  // a times each block's scale, once (n % 32 == 0)
    for (; i < n; i += kQ8Group) {
      const uint8_t* b = q8_block(v, i);
      const Vec w = vset1(a * q8_scale(b));
      for (int c = 0; c < kQ8Group; c += kWidth) {
        vstore(y + i + c, vfma(w, widen_i8(b + 2 + c), vload(y + i + c)));
      }
    }
    return;
  }
  const Vec va = vset1(a);
  for (; i + kWidth <= n; i += kWidth) vstore(y + i, vfma(va, widen_vec<kT>(v, i), vload(y + i)));
#endif
  for (; i < n; ++i) y[i] += a * widen1<kT>(v, i);
}

inline float dot(const float* a, const float* b, int n) { return dot_kv<kKvF32>(a, b, n); }

// acc[0..D) += sum over t < T of p[t] * rows[t * D ..]: the sums held in registers over the T
// rows (each element still adds its terms in t order, as T calls of axpy would).
inline void axpy_tile(float* acc, const float* p, const float* rows, int T, int D) {
  int d = 0;
#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
  for (; d + 4 * kWidth <= D; d += 4 * kWidth) {
    Vec a0 = vload(acc + d), a1 = vload(acc + d + kWidth);
    Vec a2 = vload(acc + d + 2 * kWidth), a3 = vload(acc + d + 3 * kWidth);
    for (int t = 0; t < T; ++t) {
      const Vec pt = vset1(p[t]);
      const float* r = rows + t * D + d;
      a0 = vfma(pt, vload(r), a0);
      a1 = vfma(pt, vload(r + kWidth), a1);
      a2 = vfma(pt, vload(r + 2 * kWidth), a2);
      a3 = vfma(pt, vload(r + 3 * kWidth), a3);
    }
    vstore(acc + d, a0);
    vstore(acc + d + kWidth, a1);
    vstore(acc + d + 2 * kWidth, a2);
    vstore(acc + d + 3 * kWidth, a3);
  }
  for (; d + kWidth <= D; d += kWidth) {
    Vec a = vload(acc + d);
    for (int t = 0; t < T; ++t) a = vfma(vset1(p[t]), vload(rows + t * D + d), a);
    vstore(acc + d, a);
  }
#endif
  for (; d < D; ++d) {
    for (int t = 0; t < T; ++t) acc[d] += p[t] * rows[t * D + d];
  }
}

// What attend_span_as and attend_rows_as share. The queries of rows[0..num_rows), every head,
// times the softmax scale, into q [num_rows * H, D] (query i = r * H + h).
inline void scaled_queries(const DecodeBatch& batch, const int32_t* rows, int num_rows,
                           int D, float* q) {
  const int H = batch.num_heads;
  for (int r = 0; r < num_rows; ++r) {
    const float* src = batch.query + rows[r] * batch.query_stride;
    for (int i = 0; i < H * D; ++i) q[r * H * D + i] = src[i] * batch.scale;
  }
}

// The start of slot `pos`'s keys (which = 0) or values (1), all KV heads in one row, in a
// sequence whose block table is `table`.
template <KvDtype kT>
struct SlotRows {
  static constexpr int64_t kElem = kv_elem_bytes(kT);
  static constexpr int64_t head_bytes(int D) { return kv_head_bytes(kT, D); }
  const KvLayout& kv;
  const int32_t* table;
  const char* operator()(int pos, int which) const {
    const int64_t index = table[pos / kv.block_size] * kv.block_stride + which * kv.kv_stride +
                          (pos % kv.block_size) * kv.token_stride;
    return static_cast<const char*>(kv.data) + index * kElem;
  }
};

// Scores [Q, n] into unnormalized probabilities; each query's partial [top, sum, acc...]
// gets its top score and sum, its acc zeroed for the values.
inline void span_probabilities(float* scores, int Q, int n, int64_t stride, int D,
                               float* partial) {
  for (int i = 0; i < Q; ++i) {
    float* s = scores + i * stride;
    float* out = partial + static_cast<int64_t>(i) * (D + 2);
    out[0] = lane_max(s, n);
    exp_shifted(s, n, out[0]);
    out[1] = lane_sum(s, n);
    std::fill(out + 2, out + 2 + D, 0.0f);
  }
}

// Widen slots [t0, t1) of KV head kh's keys (which = 0) or values (1) into dst [t1 - t0, D].
template <KvDtype kT>
inline void widen_slots(const SlotRows<kT>& slot_row, int t0, int t1, int which, int kh, int D,
                        float* dst) {
  const int64_t head = int64_t{kh} * SlotRows<kT>::head_bytes(D);
  for (int pos = t0; pos < t1; ++pos) {
    const char* src = slot_row(pos, which) + head;
    float* row = dst + (pos - t0) * D;
    int d = 0;
#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
    for (; d + kWidth <= D; d += kWidth) vstore(row + d, widen_vec<kT>(src, d));
#endif
    for (; d < D; ++d) row[d] = widen1<kT>(src, d);
  }
}

// The queries of rows[0..num_rows) (every head) against slots [p0, p1) of `table`: for each
// query (r, h) its top score, the sum of exp(score - top) and the sum of exp(score - top) * v,
// into partial + (r * H + h) * (D + 2) as [top, sum, acc...]. Each slot's keys (then values)
// of all KV heads are one contiguous row of the pool, read in pool order with the next rows
// prefetched (walking one head's rows alone touches a new page every token, which ran at a
// fifth of the read bandwidth), widened to fp32 in registers.
template <KvDtype kT>
void attend_span_as(const KvLayout& kv, const DecodeBatch& batch, const int32_t* rows,
                    int num_rows, const int32_t* table, int p0, int p1, float* partial,
                    float* scratch) {
  const int D = kv.head_dim, H = batch.num_heads;
  const int G = H / kv.num_kv_heads, Q = num_rows * H, n = p1 - p0;
  const int64_t ns = score_stride(n);
  const int64_t head_bytes = SlotRows<kT>::head_bytes(D);
  const int64_t row_bytes = int64_t{kv.num_kv_heads} * head_bytes;
  float* q = scratch;         // [Q, D], scaled
  float* scores = q + Q * D;  // [Q, n]
  scaled_queries(batch, rows, num_rows, D, q);
  const SlotRows<kT> slot_row{kv, table};
  // each query's KV head's offset in a slot's row, computed once: two integer divisions a
  // query per slot and pass cost a sixth of the 1.7B's step over cached slots
  std::vector<int64_t> head_of(Q);
  for (int i = 0; i < Q; ++i) head_of[i] = (i % H) / G * head_bytes;
  // query heads that share a KV head (G > 1) take its key and value widened once, up to four
  [[maybe_unused]] const bool shared = G > 1 && D % kQ8Group == 0 && kWidth > 0;
  constexpr int kAhead = 2;  // slots prefetched ahead
  auto prefetch = [&](int pos, int which) {
    if (pos >= p1) return;
    const char* p = slot_row(pos, which);
    for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
  };
  for (int pos = p0; pos < p1; ++pos) {
    prefetch(pos + kAhead, 0);
    const char* k = slot_row(pos, 0);
#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
    if (shared) {  // the query heads of one KV head (two KV heads at a time where G is 4)
      float* out = scores + pos - p0;
      int i0 = 0;
      for (; G == 4 && kWidth == 16 && i0 + 8 <= Q; i0 += 8) {
        const void* ks[2] = {k + head_of[i0], k + head_of[i0 + 4]};
        dotn_shared_kv<kT, 4, 2>(q + i0 * D, ks, D, out + i0 * ns, ns);
      }
      for (; i0 < Q; i0 += G) {
        const char* kh = k + head_of[i0];
        for (int g = 0; g < G; g += 4) {
          dot_shared<kT>(q + (i0 + g) * D, std::min(4, G - g), kh, D, out + (i0 + g) * ns, ns);
        }
      }
      continue;
    }
#endif
    int i0 = 0;
    for (; i0 + 4 <= Q; i0 += 4) {  // four queries at a time
      const float* qs[4];
      const void* ks[4];
      for (int j = 0; j < 4; ++j) {
        qs[j] = q + (i0 + j) * D;
        ks[j] = k + head_of[i0 + j];
      }
      dot4_kv_to<kT>(qs, ks, D, scores + i0 * ns + pos - p0, ns);
    }
    for (; i0 < Q; ++i0) {
      scores[i0 * ns + pos - p0] =
          dot1_kv<kT>(q + i0 * D, k + head_of[i0], D);
    }
  }
  span_probabilities(scores, Q, n, ns, D, partial);
#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
  if (shared && kWidth == 16 && D % 64 == 0) {  // AVX-512 (AVX2: f16 ~10% slower that way)
    values_grouped<kT>([&](int pos) { return slot_row(pos, 1); },
                        kv.token_stride * SlotRows<kT>::kElem, kv.block_size, row_bytes, p0, p1,
                       G, Q, D, scores, ns, head_of.data(), partial);
    return;
  }
#endif
  for (int pos = p0; pos < p1; ++pos) {
    prefetch(pos + kAhead, 1);
    const char* v = slot_row(pos, 1);
    int i = 0;
#if defined(AGENTD_OPS_AVX512) || defined(AGENTD_OPS_AVX2)
    for (; shared && i < Q; i += G) {  // the G query heads of one KV head of one row
      const char* vh = v + head_of[i];
      for (int g = 0; g < G; g += 4) {
        const int m = std::min(4, G - g);
        float* ys[4];
        float ws[4];
        for (int j = 0; j < m; ++j) {
          ys[j] = partial + static_cast<int64_t>(i + g + j) * (D + 2) + 2;
          ws[j] = scores[(i + g + j) * ns + pos - p0];
        }
        axpy_shared<kT>(ys, ws, m, vh, D);
      }
    }
#endif
    for (; i < Q; ++i) {
      axpy_kv<kT>(partial + static_cast<int64_t>(i) * (D + 2) + 2,
                  scores[i * ns + pos - p0], v + head_of[i], D);
    }
  }
}

// attend_span_as for several rows (a speculative step's draft rows behind one prefix, agents
// on one cached prompt): the same results, the work ordered for them. Slots go in tiles of
// kTileSlots; each KV head's keys (then values) of a tile are widened once into `tile` and used
// by every query of that head while they are in L1, each query's sums held in registers over
// the tile. Slot by slot over all queries (attend_span_as), every slot walked all Q queries
// and their sums through L2: one thread, 9 rows of 32 heads over 2,000 fp16 slots, ~15 ms
// that way, 7.4 ms this one before dot4_kv (a single row: 0.9 ms).
constexpr int kTileSlots = kSpanTileSlots;

template <KvDtype kT>
void attend_rows_as(const KvLayout& kv, const DecodeBatch& batch, const int32_t* rows,
                    int num_rows, const int32_t* table, int p0, int p1, float* partial,
                    float* scratch, float* tile) {
  const int D = kv.head_dim, H = batch.num_heads, Hkv = kv.num_kv_heads;
  const int G = H / Hkv, Q = num_rows * H, n = p1 - p0;
  const int64_t ns = score_stride(n);
  const int64_t row_bytes = int64_t{Hkv} * SlotRows<kT>::head_bytes(D);
  float* q = scratch;         // [Q, D], scaled; query i = r * H + h
  float* scores = q + Q * D;  // [Q, n]
  scaled_queries(batch, rows, num_rows, D, q);
  const SlotRows<kT> slot_row{kv, table};
  auto prefetch_tile = [&](int t0, int which) {
    for (int pos = t0; pos < std::min(p1, t0 + kTileSlots); ++pos) {
      const char* p = slot_row(pos, which);
      for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
    }
  };
  for (int t0 = p0; t0 < p1; t0 += kTileSlots) {
    const int t1 = std::min(p1, t0 + kTileSlots);
    prefetch_tile(t1, 0);
    for (int kh = 0; kh < Hkv; ++kh) {
      widen_slots<kT>(slot_row, t0, t1, 0, kh, D, tile);
      for (int r = 0; r < num_rows; ++r) {
        for (int g = 0; g < G; ++g) {
          const int i = r * H + kh * G + g;
          float* s = scores + i * ns - p0;
          const float* qs[4] = {q + i * D, q + i * D, q + i * D, q + i * D};
          int pos = t0;
          for (; pos + 4 <= t1; pos += 4) {  // four slots at a time
            const void* ks[4];
            for (int j = 0; j < 4; ++j) ks[j] = tile + (pos + j - t0) * D;
            dot4_kv<kKvF32>(qs, ks, D, s + pos);
          }
          for (; pos < t1; ++pos) s[pos] = dot1_kv<kKvF32>(q + i * D, tile + (pos - t0) * D, D);
        }
      }
    }
  }
  span_probabilities(scores, Q, n, ns, D, partial);
  for (int t0 = p0; t0 < p1; t0 += kTileSlots) {
    const int t1 = std::min(p1, t0 + kTileSlots);
    prefetch_tile(t1, 1);
    for (int kh = 0; kh < Hkv; ++kh) {
      widen_slots<kT>(slot_row, t0, t1, 1, kh, D, tile);
      for (int r = 0; r < num_rows; ++r) {
        for (int g = 0; g < G; ++g) {
          const int i = r * H + kh * G + g;
          const float* p = scores + i * ns - p0;
          axpy_tile(partial + static_cast<int64_t>(i) * (D + 2) + 2, p + t0, tile, t1 - t0, D);
        }
      }
    }
  }
}

template <KvDtype kT>
void attend_span_for(const KvLayout& kv, const DecodeBatch& batch, const int32_t* rows,
                     int num_rows, const int32_t* table, int p0, int p1, float* partial,
                     float* scratch) {
  if (num_rows > 1) {
    attend_rows_as<kT>(kv, batch, rows, num_rows, table, p0, p1, partial, scratch,
                       scratch + span_scratch_floats(kv, batch.num_heads, num_rows, p1 - p0) -
                           static_cast<size_t>(kTileSlots) * kv.head_dim);
  } else {
    attend_span_as<kT>(kv, batch, rows, num_rows, table, p0, p1, partial, scratch);
  }
}

void attend_span(const KvLayout& kv, const DecodeBatch& batch, const int32_t* rows,
                 int num_rows, const int32_t* table, int p0, int p1, float* partial,
                 float* scratch) {
  switch (kv.dtype) {
    case kKvF16:
      attend_span_for<kKvF16>(kv, batch, rows, num_rows, table, p0, p1, partial, scratch);
      break;
    case kKvBF16:
      attend_span_for<kKvBF16>(kv, batch, rows, num_rows, table, p0, p1, partial, scratch);
      break;
    case kKvQ8:
      attend_span_for<kKvQ8>(kv, batch, rows, num_rows, table, p0, p1, partial, scratch);
      break;
    default:
      attend_span_for<kKvF32>(kv, batch, rows, num_rows, table, p0, p1, partial, scratch);
  }
}

// out = the softmax-weighted values over the union of spans, from their partials (each
// [top, sum, acc...] of D + 2 floats).
void merge_spans(const float* const* partials, int num_spans, int D, float* out) {
  float top = partials[0][0];
  for (int i = 1; i < num_spans; ++i) top = std::max(top, partials[i][0]);
  float total = 0.0f;
  std::fill(out, out + D, 0.0f);
  for (int i = 0; i < num_spans; ++i) {
    const float w = exp_fast(partials[i][0] - top);
    total += partials[i][1] * w;
    axpy(out, w, partials[i] + 2, D);
  }
  const float inv = 1.0f / total;
  for (int j = 0; j < D; ++j) out[j] *= inv;
}

}  // namespace
}  // namespace agentd_cpu
