// The small per-layer operations of a CPU decode step, fused: paged decode attention, rotary +
// KV write, RMSNorm with its residual add, SiLU(gate) * up. Each costs few bytes; run as torch
// ops they cost ~40 dispatches a layer (a third of a 1.7B model's decode step), here one call.
//
// Plain C++ (no torch): ops_scalar/avx2/avx512.cpp compile ops_impl.h under their own target
// pragma and return their table; ops_bindings.cpp checks tensors, splits work over threads and
// picks the table by the same ISA index as the products.
//
// Invariant: attention reads only the slots below each sequence's length (a partial block's
// other slots may hold anything) and accumulates in fp32 whatever the pool's dtype; a KV write
// touches only the slots it is given and rounds to the pool's dtype to nearest-even, as torch's
// conversions do.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ggml_blocks.h"

namespace agentd_cpu {

// kKvQ8: q8_0, each head row of D values as D / 32 blocks of 34 bytes, an fp16 scale d then 32
// int8 q (value = d * q, exact in fp32), llama.cpp's block_q8_0 (agentd/kernels/kv_quant.py).
enum KvDtype : int { kKvF32 = 0, kKvF16 = 1, kKvBF16 = 2, kKvQ8 = 3 };

constexpr int kQ8Group = 32, kQ8Bytes = 34;

// The bytes of one element of the pool's storage (q8_0's: a byte).
constexpr int64_t kv_elem_bytes(KvDtype dtype) {
  return dtype == kKvF32 ? 4 : dtype == kKvQ8 ? 1 : 2;
}

// The bytes of one head row of head_dim values in the pool.
constexpr int64_t kv_head_bytes(KvDtype dtype, int head_dim) {
  return dtype == kKvQ8 ? int64_t{head_dim} / kQ8Group * kQ8Bytes
                        : int64_t{head_dim} * kv_elem_bytes(dtype);
}

// One layer's pool, logically [num_blocks, 2, block_size, num_kv_heads, head_dim] (strides in
// elements of its storage, bytes for q8_0; keys at kv index 0, values at 1; head_dim counts
// values, not bytes).
struct KvLayout {
  void* data;
  KvDtype dtype;
  int64_t block_stride, kv_stride, token_stride, head_stride;
  int block_size, num_kv_heads, head_dim;
};

// A decode step's queries: [S, H, D], rows query_stride apart, heads D apart.
struct DecodeBatch {
  const float* query;
  int64_t query_stride;
  int num_heads;
  float scale;
};

// Slots a span of several rows widens at a time, one KV head's rows of them (ops_impl.h).
constexpr int kSpanTileSlots = 16;

// The floats between two queries' rows of scores over n slots: whole lines, and one line more,
// so that rows of a power-of-two span do not land in one L1 set (32 heads' rows 4,096 slots
// apart all map to one set of a 12-way L1, every score write and read a miss).
inline int64_t score_stride(int n) { return (int64_t{n} + 15) / 16 * 16 + 16; }

// Scratch floats attend_span needs for num_rows rows over n slots: scaled queries and scores,
// and for several rows a tile of widened head rows.
inline size_t span_scratch_floats(const KvLayout& kv, int num_heads, int num_rows, int n) {
  return static_cast<size_t>(num_rows) * num_heads * (kv.head_dim + score_stride(n)) +
         (num_rows > 1 ? size_t{kSpanTileSlots} * kv.head_dim : 0);
}

// A prefill task's query vectors per KV head (rows x that head's query heads) and slots a tile
// (ops_prefill.h); the floats of state it holds per KV head (the queries, the outputs, their
// tops and sums) and of scratch in all.
constexpr int kChunkQueries = 128;
constexpr int kChunkSlots = 128;

inline size_t chunk_head_floats(int head_dim) {
  return 2 * size_t{kChunkQueries} * head_dim + 2 * size_t{kChunkQueries};
}

inline size_t chunk_scratch_floats(int head_dim, int num_kv_heads) {
  const size_t D = head_dim, Q = kChunkQueries, T = kChunkSlots;
  const size_t fp32 = (2 * T + 1) * D;  // keys and values widened
  const size_t bf16 = (T + 1) * D / 2 + T / 2 * D + T / 2 * Q;  // their pairs, the weights'
  return num_kv_heads * chunk_head_floats(head_dim) + (T + 1) * Q + (fp32 > bf16 ? fp32 : bf16);
}

// Causal attention of num_rows rows of one sequence (row j at position first_pos + j sees
// slots [0, first_pos + j] of `table`) for the query heads of KV heads [kh, kh + num_kh): row
// j's head h at query + j * query_stride + h * D, its output at out + j * out_stride + h * D.
// num_rows * (num_heads / num_kv_heads) <= kChunkQueries; scratch: chunk_scratch_floats(D,
// num_kh). The heads go inside the loop over tiles: a slot's heads are one row of the pool,
// read whole (one head's part alone every slot, a page apart for 32 heads of 64, ran at a
// third of the speed once the context left the L3).
using AttendChunkFn = void (*)(const KvLayout& kv, const float* query, int64_t query_stride,
                               int num_heads, float scale, const int32_t* table, int first_pos,
                               int num_rows, int kh, int num_kh, float* out, int64_t out_stride,
                               float* scratch);

// attend_chunk with its products in bfloat16 (ops_prefill_bf16.cpp), where this build has it
// (GCC 10+) and the CPU has AVX512-BF16, else nullptr. Needs head_dim % 16 == 0.
AttendChunkFn attend_chunk_bf16_kernel();

struct OpsKernels {
  // The queries of rows[0..num_rows) (every head) against slots [p0, p1) of one block table:
  // per query [top score, sum of exp(score - top), sum of exp(score - top) * value] (D + 2
  // floats) at partial + (r * num_heads + h) * (D + 2).
  void (*attend_span)(const KvLayout& kv, const DecodeBatch& batch, const int32_t* rows,
                      int num_rows, const int32_t* table, int p0, int p1, float* partial,
                      float* scratch);
  // One query's output from the partials of the spans that cover its context.
  void (*merge_spans)(const float* const* partials, int num_spans, int head_dim, float* out);
  // residual += x (x may be null), out = residual * rsqrt(mean(residual^2) + eps) * weight.
  void (*add_rms_norm)(int n, const float* x, float* residual, const float* weight, float eps,
                       float* out);
  // out[i] = silu(gate[i]) * up[i].
  void (*silu_mul)(int n, const float* gate, const float* up, float* out);
  // Rotary on num_heads heads of one token (heads head_stride apart), in place: pairs (2i, 2i+1)
  // if interleaved, else (i, i + D/2), by cos[i], sin[i] for i < D/2.
  void (*rope)(float* x, int num_heads, int64_t head_stride, int head_dim, const float* cos,
               const float* sin, bool interleaved);
  // One head row of n floats into the pool's dtype.
  void (*store_row)(const float* src, void* dst, KvDtype dtype, int n);
  // Prefill attention of some rows and KV heads (AttendChunkFn), fp32 products.
  AttendChunkFn attend_chunk;
};

const OpsKernels& ops_kernels(int isa);
const OpsKernels& ops_kernels_scalar();
const OpsKernels& ops_kernels_avx2();
const OpsKernels& ops_kernels_avx512();

}  // namespace agentd_cpu
