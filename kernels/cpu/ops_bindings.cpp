// The torch face of ops.h: tensor checks, grouping decode rows by shared leading blocks, and the
// split of work over torch's intra-op threads (at::parallel_for, so torch.set_num_threads
// applies). Registered into the extension module by bindings.cpp.
//
// Invariant: every function reads and writes only the tensors it is given, through their strides
// (q/k/v are views of one fused projection), and releases the GIL while kernels run.
// Only the torch headers these bindings use (see bindings.cpp).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <vector>

#include "dispatch.h"
#include "ops.h"

namespace agentd_cpu {

const OpsKernels& ops_kernels(int isa) {
  switch (isa) {
    case kIsaAvx512: return ops_kernels_avx512();
    case kIsaAvx2: return ops_kernels_avx2();
    default: return ops_kernels_scalar();
  }
}

}  // namespace agentd_cpu

namespace {

using agentd_cpu::KvLayout;
using agentd_cpu::OpsKernels;

void check_float_rows(const at::Tensor& t, const char* what, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == dim, what,
              " must be a ", dim, "-D float32 CPU tensor, got ", t.scalar_type(), " ",
              t.sizes());
  TORCH_CHECK(t.size(dim - 1) <= 1 || t.stride(dim - 1) == 1, what,
              "'s last dimension must be contiguous");
}

KvLayout kv_layout(const at::Tensor& kv) {
  TORCH_CHECK(kv.device().is_cpu() && kv.dim() == 5 && kv.size(1) == 2,
              "kv_cache must be a CPU [num_blocks, 2, block_size, num_kv_heads, head_dim] "
              "tensor, got ", kv.sizes());
  TORCH_CHECK(kv.stride(4) == 1, "kv_cache's head_dim must be contiguous");
  agentd_cpu::KvDtype dtype;
  switch (kv.scalar_type()) {
    case at::kFloat: dtype = agentd_cpu::kKvF32; break;
    case at::kHalf: dtype = agentd_cpu::kKvF16; break;
    case at::kBFloat16: dtype = agentd_cpu::kKvBF16; break;
    case at::kChar: dtype = agentd_cpu::kKvQ8; break;  // q8_0 bytes (kv_quant.py)
    default: TORCH_CHECK(false, "kv_cache must be float32, float16, bfloat16 or int8 (q8_0), "
                         "got ", kv.scalar_type());
  }
  int64_t head_dim = kv.size(4);
  if (dtype == agentd_cpu::kKvQ8) {
    TORCH_CHECK(head_dim % agentd_cpu::kQ8Bytes == 0, "a q8_0 kv_cache's rows must be whole ",
                agentd_cpu::kQ8Bytes, "-byte blocks, got ", head_dim, " bytes");
    head_dim = head_dim / agentd_cpu::kQ8Bytes * agentd_cpu::kQ8Group;
  }
  return {kv.data_ptr(), dtype, kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
          static_cast<int>(kv.size(2)), static_cast<int>(kv.size(3)),
          static_cast<int>(head_dim)};
}

// Decode rows grouped as the torch path groups them: by first block, each group sharing the
// leading blocks that are equal in all its rows and full in every one.
struct RowGroup {
  std::vector<int32_t> rows;
  int shared_blocks = 0;
};

std::vector<RowGroup> group_rows(const int32_t* tables, int64_t table_stride,
                                 const int32_t* lens, int64_t num_seqs, int block_size) {
  std::map<int32_t, size_t> by_first;
  std::vector<RowGroup> groups;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const auto [it, fresh] = by_first.try_emplace(tables[i * table_stride], groups.size());
    if (fresh) groups.emplace_back();
    groups[it->second].rows.push_back(static_cast<int32_t>(i));
  }
  for (RowGroup& g : groups) {
    int min_len = lens[g.rows[0]];
    for (int32_t r : g.rows) min_len = std::min(min_len, lens[r]);
    const int32_t* first = tables + g.rows[0] * table_stride;
    int shared = 0;
    for (; shared < min_len / block_size; ++shared) {
      bool same = true;
      for (int32_t r : g.rows) same &= tables[r * table_stride + shared] == first[shared];
      if (!same) break;
    }
    g.shared_blocks = shared;
  }
  return groups;
}

// A run of slots [p0, p1) of one block table, attended by some rows' queries.
struct Span {
  const int32_t* rows;
  int num_rows;
  const int32_t* table;
  int p0, p1;
};

// Each group's shared run in chunks (about two spans per thread over all the shared slots, at
// least kMinSpan and at most kMaxSpan slots each), then each row's own slots after it in spans
// of at most kMaxSpan. At most kMaxSpan, so that a span's scores ([queries, slots] floats that
// the key pass writes and the softmax and the value pass read back) stay in L2: one sequence at
// 16k tokens took 4,096-slot spans before (32 heads' scores, 526 KB a span), and its decode
// step went from 108 to 84 ms on the 1.7B (f16 KV; q8_0 95 -> 73-80) and from 200 to 157 ms on
// the 8B (q8_0 185 -> 169), 2 Zen 5 threads (benchmarks/results/2026-12-06-8b-16k.md).
std::vector<Span> plan_spans(const std::vector<RowGroup>& groups, const int32_t* tables,
                             int64_t table_stride, const int32_t* lens, int block_size,
                             int64_t threads) {
  constexpr int64_t kMinSpan = 128, kMaxSpan = 512;
  int64_t shared_total = 0;
  for (const RowGroup& g : groups) shared_total += int64_t{g.shared_blocks} * block_size;
  const int64_t even = (shared_total + 2 * threads - 1) / std::max<int64_t>(1, 2 * threads);
  const int64_t chunk = std::min(kMaxSpan, std::max(kMinSpan, even));
  std::vector<Span> spans;
  for (const RowGroup& g : groups) {
    const int n = static_cast<int>(g.rows.size());
    const int32_t* first = tables + g.rows[0] * table_stride;
    const int shared = g.shared_blocks * block_size;
    for (int p0 = 0; p0 < shared; p0 += static_cast<int>(chunk)) {
      spans.push_back({g.rows.data(), n, first, p0,
                       static_cast<int>(std::min<int64_t>(shared, p0 + chunk))});
    }
    for (int j = 0; j < n; ++j) {
      const int32_t r = g.rows[j];
      for (int p0 = shared; p0 < lens[r]; p0 += static_cast<int>(kMaxSpan)) {
        spans.push_back({&g.rows[j], 1, tables + r * table_stride, p0,
                         static_cast<int>(std::min<int64_t>(lens[r], p0 + kMaxSpan))});
      }
    }
  }
  return spans;
}

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale, int64_t isa) {
  check_float_rows(query, "query", 3);
  TORCH_CHECK(query.stride(1) == query.size(2), "query's heads must be contiguous");
  const KvLayout kv = kv_layout(kv_cache);
  const int64_t S = query.size(0), H = query.size(1);
  TORCH_CHECK(query.size(2) == kv.head_dim && H % kv.num_kv_heads == 0,
              "query [S, H, D] must have the pool's head_dim and a multiple of its KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.size(0) == S && block_tables.stride(1) == 1,
              "block_tables must be int32 [S, max_blocks] with contiguous rows");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 &&
                  seq_lens.size(0) == S && seq_lens.is_contiguous(),
              "seq_lens must be a contiguous int32 [S] tensor");
  at::Tensor out = at::empty({S, H, kv.head_dim}, query.options());
  if (S == 0) return out;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1);
  for (int64_t i = 0; i < S; ++i) {
    TORCH_CHECK(lens[i] >= 1 && (lens[i] + kv.block_size - 1) / kv.block_size <= max_blocks,
                "seq_lens[", i, "] = ", lens[i], " does not fit its block table");
    for (int64_t b = 0; b < (lens[i] + kv.block_size - 1) / kv.block_size; ++b) {
      const int32_t blk = tables[i * block_tables.stride(0) + b];
      TORCH_CHECK(blk >= 0 && blk < kv_cache.size(0), "block ", blk, " is outside the pool");
    }
  }
  const agentd_cpu::DecodeBatch batch{query.data_ptr<float>(), query.stride(0),
                                      static_cast<int>(H), static_cast<float>(scale)};
  const std::vector<RowGroup> groups =
      group_rows(tables, block_tables.stride(0), lens, S, kv.block_size);
  const std::vector<Span> spans = plan_spans(groups, tables, block_tables.stride(0), lens,
                                             kv.block_size, at::get_num_threads());
  const OpsKernels& ops = agentd_cpu::ops_kernels(static_cast<int>(isa));
  const int64_t D = kv.head_dim, per_query = D + 2;
  std::vector<int64_t> offsets(spans.size() + 1, 0);  // each span's partials
  for (size_t i = 0; i < spans.size(); ++i) {
    offsets[i + 1] = offsets[i] + static_cast<int64_t>(spans[i].num_rows) * H * per_query;
  }
  std::vector<float> partials(offsets.back());
  py::gil_scoped_release no_gil;
  at::parallel_for(0, static_cast<int64_t>(spans.size()), 1, [&](int64_t s0, int64_t s1) {
    std::vector<float> scratch;
    for (int64_t i = s0; i < s1; ++i) {
      const Span& sp = spans[i];
      scratch.resize(agentd_cpu::span_scratch_floats(kv, static_cast<int>(H), sp.num_rows,
                                                     sp.p1 - sp.p0));
      ops.attend_span(kv, batch, sp.rows, sp.num_rows, sp.table, sp.p0, sp.p1,
                      partials.data() + offsets[i], scratch.data());
    }
  });
  // Each row's spans: the chunks of its group's shared run (where it is row j of them) and its
  // own tail.
  std::vector<std::vector<const float*>> by_row(S);
  for (size_t i = 0; i < spans.size(); ++i) {
    for (int j = 0; j < spans[i].num_rows; ++j) {
      by_row[spans[i].rows[j]].push_back(partials.data() + offsets[i] + j * H * per_query);
    }
  }
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, S, 1, [&](int64_t r0, int64_t r1) {
    std::vector<const float*> heads;
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t h = 0; h < H; ++h) {
        heads.clear();
        for (const float* p : by_row[r]) heads.push_back(p + h * per_query);
        ops.merge_spans(heads.data(), static_cast<int>(heads.size()), static_cast<int>(D),
                        dst + r * out.stride(0) + h * D);
      }
    }
  });
  return out;
}

// One task of prefill_attention: some rows of one sequence, the query heads of some KV heads.
struct ChunkTask {
  int64_t seq, row0;  // its first row, within the batch's query
  int num_rows, first_pos, kh, num_kh;
  int64_t cost;  // slots times rows, to hand the longest out first
};

// KV heads a task takes: all of a slot's (its row is read whole), as far as their state stays
// within ~512 KiB (L2) and the tasks still number two a thread.
int heads_per_task(int num_kv_heads, int head_dim, int64_t row_tiles, int64_t threads) {
  const size_t per_head = agentd_cpu::chunk_head_floats(head_dim) * sizeof(float);
  int heads = std::max<int>(1, std::min<int64_t>(num_kv_heads, (512 << 10) / per_head));
  while (heads > 1 && row_tiles * ((num_kv_heads + heads - 1) / heads) < 2 * threads) {
    heads = (heads + 1) / 2;
  }
  return heads;
}

at::Tensor prefill_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                             const at::Tensor& seq_lens, double scale, bool bf16, int64_t isa) {
  check_float_rows(query, "query", 3);
  TORCH_CHECK(query.stride(1) == query.size(2), "query's heads must be contiguous");
  const KvLayout kv = kv_layout(kv_cache);
  const int64_t T = query.size(0), H = query.size(1), S = seq_lens.size(0);
  TORCH_CHECK(query.size(2) == kv.head_dim && H % kv.num_kv_heads == 0,
              "query [T, H, D] must have the pool's head_dim and a multiple of its KV heads");
  const int64_t G = H / kv.num_kv_heads;
  TORCH_CHECK(G <= agentd_cpu::kChunkQueries, "at most ", agentd_cpu::kChunkQueries,
              " query heads per KV head");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.size(0) == S && block_tables.stride(1) == 1,
              "block_tables must be int32 [S, max_blocks] with contiguous rows");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 &&
                  seq_lens.is_contiguous(), "seq_lens must be a contiguous int32 [S] tensor");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.dim() == 1 &&
                  query_start_loc.size(0) == S + 1 && query_start_loc.is_contiguous(),
              "query_start_loc must be a contiguous int32 [S + 1] tensor");
  at::Tensor out = at::empty({T, H, kv.head_dim}, query.options());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1);
  const int rows_per_task = static_cast<int>(std::max<int64_t>(1, agentd_cpu::kChunkQueries / G));
  int64_t row_tiles = 0;
  for (int64_t s = 0; s < S; ++s) {
    row_tiles += (starts[s + 1] - starts[s] + rows_per_task - 1) / rows_per_task;
  }
  const int heads = heads_per_task(kv.num_kv_heads, kv.head_dim, row_tiles,
                                   at::get_num_threads());
  std::vector<ChunkTask> tasks;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = starts[s + 1] - starts[s];
    TORCH_CHECK(n >= 0 && starts[s] >= 0 && starts[s + 1] <= T, "query_start_loc[", s,
                "] is outside the query");
    TORCH_CHECK(lens[s] >= n && (lens[s] + kv.block_size - 1) / kv.block_size <= max_blocks,
                "seq_lens[", s, "] = ", lens[s], " does not fit its chunk or block table");
    for (int64_t b = 0; b < (lens[s] + kv.block_size - 1) / kv.block_size; ++b) {
      const int32_t blk = tables[s * block_tables.stride(0) + b];
      TORCH_CHECK(blk >= 0 && blk < kv_cache.size(0), "block ", blk, " is outside the pool");
    }
    for (int64_t r = 0; r < n; r += rows_per_task) {
      const int rows = static_cast<int>(std::min<int64_t>(rows_per_task, n - r));
      const int first_pos = static_cast<int>(lens[s] - n + r);
      for (int kh = 0; kh < kv.num_kv_heads; kh += heads) {
        const int num_kh = std::min(heads, kv.num_kv_heads - kh);
        tasks.push_back({s, starts[s] + r, rows, first_pos, kh, num_kh,
                         int64_t{first_pos + rows} * rows * num_kh});
      }
    }
  }
  if (tasks.empty()) return out;
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const ChunkTask& a, const ChunkTask& b) { return a.cost > b.cost; });
  const OpsKernels& ops = agentd_cpu::ops_kernels(static_cast<int>(isa));
  agentd_cpu::AttendChunkFn attend = ops.attend_chunk;
  if (bf16 && isa == agentd_cpu::kIsaAvx512 && kv.head_dim % 16 == 0 &&
      agentd_cpu::attend_chunk_bf16_kernel() != nullptr) {
    attend = agentd_cpu::attend_chunk_bf16_kernel();
  }
  const float* q = query.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};  // handed out longest first, to whichever thread is free
  py::gil_scoped_release no_gil;
  at::parallel_for(0, std::min<int64_t>(num_tasks, at::get_num_threads()), 1,
                   [&](int64_t, int64_t) {
    std::vector<float> scratch(agentd_cpu::chunk_scratch_floats(kv.head_dim, heads));
    for (int64_t i = next++; i < num_tasks; i = next++) {
      const ChunkTask& t = tasks[i];
      attend(kv, q + t.row0 * query.stride(0), query.stride(0), static_cast<int>(H),
                       static_cast<float>(scale), tables + t.seq * block_tables.stride(0),
                       t.first_pos, t.num_rows, t.kh, t.num_kh, dst + t.row0 * out.stride(0),
                       out.stride(0), scratch.data());
    }
  });
  return out;
}

// Rows of [n, K] at a time over the threads, when there are enough to pay for a hand-off.
template <typename Fn>
void over_rows(int64_t n, int64_t K, Fn fn) {
  if (n * K < (int64_t{1} << 15) || at::in_parallel_region()) {
    fn(0, n);
    return;
  }
  at::parallel_for(0, n, std::max<int64_t>(1, (int64_t{1} << 14) / K), fn);
}

at::Tensor add_rms_norm(const std::optional<at::Tensor>& x, const at::Tensor& residual,
                        const at::Tensor& weight, double eps, int64_t isa) {
  check_float_rows(residual, "residual", 2);
  const int64_t n = residual.size(0), K = residual.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.size(0) == K &&
                  weight.is_contiguous(), "weight must be a contiguous float32 [K] tensor");
  if (x.has_value()) {
    check_float_rows(*x, "x", 2);
    TORCH_CHECK(x->sizes() == residual.sizes(), "x and residual differ in shape");
  }
  at::Tensor out = at::empty({n, K}, residual.options());
  const float* xs = x.has_value() ? x->data_ptr<float>() : nullptr;
  const int64_t x_stride = x.has_value() ? x->stride(0) : 0;
  float* res = residual.data_ptr<float>();
  const OpsKernels& ops = agentd_cpu::ops_kernels(static_cast<int>(isa));
  py::gil_scoped_release no_gil;
  over_rows(n, K, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      ops.add_rms_norm(static_cast<int>(K), xs == nullptr ? nullptr : xs + r * x_stride,
                       res + r * residual.stride(0), weight.data_ptr<float>(),
                       static_cast<float>(eps), out.data_ptr<float>() + r * K);
    }
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up, int64_t isa) {
  check_float_rows(gate_up, "gate_up", 2);
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even number of columns");
  const int64_t n = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor out = at::empty({n, I}, gate_up.options());
  const float* src = gate_up.data_ptr<float>();
  const OpsKernels& ops = agentd_cpu::ops_kernels(static_cast<int>(isa));
  py::gil_scoped_release no_gil;
  over_rows(n, I, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = src + r * gate_up.stride(0);
      ops.silu_mul(static_cast<int>(I), row, row + I, out.data_ptr<float>() + r * I);
    }
  });
  return out;
}

void check_heads(const at::Tensor& t, const char* what, int64_t T, int64_t D) {
  check_float_rows(t, what, 3);
  TORCH_CHECK(t.size(0) == T && t.size(2) == D, what, " must be [", T, ", heads, ", D,
              "], got ", t.sizes());
}

void rope_write_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
                   const at::Tensor& kv_cache, const at::Tensor& slot_mapping, int64_t isa) {
  const KvLayout kv = kv_layout(kv_cache);
  const int64_t T = q.size(0), D = kv.head_dim;
  check_heads(q, "q", T, D);
  check_heads(k, "k", T, D);
  check_heads(v, "v", T, D);
  TORCH_CHECK(k.size(1) == kv.num_kv_heads && v.size(1) == kv.num_kv_heads,
              "k and v must have the pool's KV heads");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == T &&
                    t->size(1) == D / 2 && t->is_contiguous(),
                "cos and sin must be contiguous float32 [T, head_dim / 2]");
  }
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == T && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous int64 [T] tensor");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = kv_cache.size(0) * kv.block_size;
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " is outside the pool");
  }
  const OpsKernels& ops = agentd_cpu::ops_kernels(static_cast<int>(isa));
  const int64_t elem = agentd_cpu::kv_elem_bytes(kv.dtype);
  auto* pool = static_cast<uint8_t*>(kv.data);
  py::gil_scoped_release no_gil;
  over_rows(T, (q.size(1) + 2 * k.size(1)) * D, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cos.data_ptr<float>() + t * (D / 2);
      const float* s = sin.data_ptr<float>() + t * (D / 2);
      float* qt = q.data_ptr<float>() + t * q.stride(0);
      float* kt = k.data_ptr<float>() + t * k.stride(0);
      ops.rope(qt, static_cast<int>(q.size(1)), q.stride(1), static_cast<int>(D), c, s,
               interleaved);
      ops.rope(kt, kv.num_kv_heads, k.stride(1), static_cast<int>(D), c, s, interleaved);
      const int64_t block = slots[t] / kv.block_size, slot = slots[t] % kv.block_size;
      for (int h = 0; h < kv.num_kv_heads; ++h) {
        const int64_t at = block * kv.block_stride + slot * kv.token_stride + h * kv.head_stride;
        ops.store_row(kt + h * k.stride(1), pool + at * elem, kv.dtype, static_cast<int>(D));
        ops.store_row(v.data_ptr<float>() + t * v.stride(0) + h * v.stride(1),
                      pool + (at + kv.kv_stride) * elem, kv.dtype, static_cast<int>(D));
      }
    }
  });
}

}  // namespace

void register_ops(py::module_& m) {
  m.def("decode_attention", &decode_attention,
        "out[S, H, D]: paged decode attention, shared leading blocks read once per group");
  m.def("prefill_attention", &prefill_attention,
        "out[T, H, D]: paged causal attention of prefill chunks, the context read in place "
        "(bf16: products in bfloat16 where the CPU has AVX512-BF16)");
  m.def("has_bf16_attention", [] { return agentd_cpu::attend_chunk_bf16_kernel() != nullptr; },
        "whether prefill_attention can take its products in bfloat16 here");
  m.def("add_rms_norm", &add_rms_norm, "residual += x; out = rms_norm(residual) * weight",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"), py::arg("isa"));
  m.def("silu_mul", &silu_mul, "out[n, I] = silu(gate_up[:, :I]) * gate_up[:, I:]");
  m.def("rope_write_kv", &rope_write_kv,
        "rotary on q and k in place, then k and v into their pool slots");
}
