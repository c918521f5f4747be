// The Python face of the kernels: tensor checks, the activation quantization (once per product
// and activation format), and the split of output rows over torch's intra-op threads
// (at::parallel_for, so torch.set_num_threads applies). With ops_bindings.cpp, the only files
// that include torch.
//
// Invariant: every function here reads its weights through the row stride it is given (rows may
// be views of an mmap, aligned to nothing) and writes only the output it is given; the GIL is
// released while kernels run.
// Only the torch headers these bindings use: <torch/extension.h> (the whole C++ frontend) took
// 38 s to parse on a 2-core EPYC, these 11 s, and a cold build went from 57 s to 37 s.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <string>
#include <vector>

#include "dispatch.h"
#include "ops.h"

namespace {

using agentd_cpu::ActKind;
using agentd_cpu::TypeKernels;

TypeKernels kernels_of(int64_t type_id, int64_t isa) {
  TypeKernels k;
  TORCH_CHECK(agentd_cpu::type_kernels(static_cast<int>(type_id), static_cast<int>(isa), &k),
              "ggml type ", type_id, " has no kernels in this build");
  return k;
}

void check_rows(const at::Tensor& t, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.scalar_type() == dtype, what,
              " must be a 2-D CPU tensor of ", c10::toString(dtype), ", got ", t.sizes(), " ",
              t.scalar_type());
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, what, " rows must be contiguous");
}

void check_weight(const at::Tensor& w, const TypeKernels& k, int64_t K) {
  check_rows(w, at::kByte, "weight");
  TORCH_CHECK(K % k.block_weights == 0, "K = ", K, " is not a multiple of the type's block (",
              k.block_weights, ")");
  TORCH_CHECK(w.size(1) == K / k.block_weights * k.block_bytes, "weight rows hold ", w.size(1),
              " bytes, K = ", K, " needs ", K / k.block_weights * k.block_bytes);
}

// Rows per parallel chunk: about 64 KB of weights times activation rows, so that small products
// do not pay for a thread hand-off they cannot use.
int64_t grain_rows(int64_t row_bytes, int64_t n) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, row_bytes * n));
}

// The n activation rows in a product's format; for fp32 products the rows themselves.
struct Activations {
  at::Tensor storage;  // quantized blocks [n, act_row_bytes], or x
  const uint8_t* data;
  int64_t stride;      // bytes between rows
};

Activations activations(const at::Tensor& x, ActKind kind, int64_t isa) {
  const int64_t n = x.size(0), K = x.size(1);
  if (kind == agentd_cpu::kActF32) {
    return {x, reinterpret_cast<const uint8_t*>(x.data_ptr<float>()), x.stride(0) * 4};
  }
  const int64_t row_bytes = agentd_cpu::act_row_bytes(kind, static_cast<int>(K));
  at::Tensor q = at::empty({n, row_bytes}, x.options().dtype(at::kByte));
  const auto quantize = agentd_cpu::act_quantizer(kind, static_cast<int>(isa));
  const float* src = x.data_ptr<float>();
  uint8_t* dst = q.data_ptr<uint8_t>();
  const int64_t x_stride = x.stride(0);
  at::parallel_for(0, n, std::max<int64_t>(1, 32768 / K), [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      quantize(static_cast<int>(K), src + j * x_stride, dst + j * row_bytes);
    }
  });
  return {q, dst, row_bytes};
}

// One part of a product: its weight rows land in output columns [col0, col0 + rows).
struct Part {
  TypeKernels k;
  const uint8_t* w;
  int64_t w_stride, rows, col0;
  const Activations* act;
};

void run_parts(const std::vector<Part>& parts, int K, int64_t n, float* out, int64_t out_stride) {
  int64_t total = 0, row_bytes = 0;
  for (const Part& p : parts) total += p.rows, row_bytes = std::max(row_bytes, p.w_stride);
  auto rows = [&](int64_t begin, int64_t end) {
    for (const Part& p : parts) {  // this chunk's rows of each part, in the part's own terms
      const int64_t r0 = std::max<int64_t>(begin - p.col0, 0);
      const int64_t r1 = std::min<int64_t>(end - p.col0, p.rows);
      if (r0 >= r1) continue;
      agentd_cpu::dot_rows(p.k, K, p.w, p.w_stride, r0, r1, p.act->data, p.act->stride, n,
                           out + p.col0, out_stride);
    }
  };
  // Threads take chunks of rows from a shared counter rather than one fixed share each: on a
  // machine shared with other work, a thread that is descheduled no longer holds up the call
  // while the others idle (about eight chunks per thread, each at least grain_rows).
  const int64_t threads = at::get_num_threads();
  const int64_t chunk =
      std::max(grain_rows(row_bytes, n), (total + 8 * threads - 1) / (8 * threads));
  const int64_t num_chunks = (total + chunk - 1) / chunk;
  if (threads <= 1 || num_chunks <= 1 || at::in_parallel_region()) {
    rows(0, total);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, num_chunks), 1, [&](int64_t, int64_t) {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < num_chunks;) {
      rows(c * chunk, std::min(total, (c + 1) * chunk));
    }
  });
}

at::Tensor linear_multi(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                        const std::vector<int64_t>& type_ids, int64_t isa,
                        std::optional<at::Tensor> out) {
  check_rows(x, at::kFloat, "x");
  TORCH_CHECK(weights.size() == type_ids.size() && !weights.empty(), "one type per weight");
  const int64_t n = x.size(0), K = x.size(1);
  std::vector<Part> parts;
  int64_t col = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const TypeKernels k = kernels_of(type_ids[i], isa);
    TORCH_CHECK(k.dot != nullptr, "ggml type ", type_ids[i], " has no native product");
    check_weight(weights[i], k, K);
    parts.push_back({k, weights[i].data_ptr<uint8_t>(), weights[i].stride(0), weights[i].size(0),
                     col, nullptr});
    col += weights[i].size(0);
  }
  at::Tensor result = out.has_value() ? *out : at::empty({n, col}, x.options());
  check_rows(result, at::kFloat, "out");
  TORCH_CHECK(result.size(0) == n && result.size(1) == col, "out must be [", n, ", ", col,
              "], got ", result.sizes());
  if (n == 0 || col == 0) return result;
  py::gil_scoped_release no_gil;
  Activations acts[3];
  bool made[3] = {false, false, false};
  for (Part& p : parts) {  // one quantization per activation format
    if (!made[p.k.act]) acts[p.k.act] = activations(x, p.k.act, isa), made[p.k.act] = true;
    p.act = &acts[p.k.act];
  }
  run_parts(parts, static_cast<int>(K), n, result.data_ptr<float>(), result.stride(0));
  return result;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t type_id, int64_t isa,
                  std::optional<at::Tensor> out) {
  return linear_multi(x, {w}, {type_id}, isa, std::move(out));
}

// out = dequant(w), as float32 or (rounded to nearest even) bfloat16: a prefill tile for a
// bfloat16 GEMM is written once, each row widened in a small float buffer first.
void dequantize(const at::Tensor& w, int64_t type_id, int64_t K, int64_t isa,
                const at::Tensor& out) {
  const TypeKernels k = kernels_of(type_id, isa);
  check_weight(w, k, K);
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  check_rows(out, bf16 ? at::kBFloat16 : at::kFloat, "out");
  TORCH_CHECK(out.size(0) == w.size(0) && out.size(1) == K, "out must be [", w.size(0), ", ", K,
              "], got ", out.sizes());
  const uint8_t* src = w.data_ptr<uint8_t>();
  const int64_t w_stride = w.stride(0), out_stride = out.stride(0);
  const agentd_cpu::OpsKernels& ops = agentd_cpu::ops_kernels(static_cast<int>(isa));
  py::gil_scoped_release no_gil;
  at::parallel_for(0, w.size(0), grain_rows(w.size(1), 1), [&](int64_t r0, int64_t r1) {
    if (!bf16) {
      agentd_cpu::dequant_rows(k, static_cast<int>(K), src, w_stride, r0, r1,
                               out.data_ptr<float>() + r0 * out_stride, out_stride);
      return;
    }
    std::vector<float> row(K);
    auto* dst = static_cast<uint8_t*>(out.data_ptr());
    for (int64_t r = r0; r < r1; ++r) {
      agentd_cpu::dequant_rows(k, static_cast<int>(K), src, w_stride, r, r + 1, row.data(), K);
      ops.store_row(row.data(), dst + 2 * r * out_stride, agentd_cpu::kKvBF16,
                    static_cast<int>(K));
    }
  });
}

at::Tensor quantize_act(const at::Tensor& x, int64_t kind, int64_t isa) {
  check_rows(x, at::kFloat, "x");
  TORCH_CHECK(kind == agentd_cpu::kActQ8_32 || kind == agentd_cpu::kActQ8_256, "bad kind");
  const int64_t block = kind == agentd_cpu::kActQ8_32 ? agentd_cpu::QK32 : agentd_cpu::QK_K;
  TORCH_CHECK(x.size(1) % block == 0, "K must be a multiple of ", block);
  return activations(x, static_cast<ActKind>(kind), isa).storage;
}

bool has_type(int64_t type_id) {
  TypeKernels k;
  return agentd_cpu::type_kernels(static_cast<int>(type_id), agentd_cpu::kIsaScalar, &k);
}

// How many threads one at::parallel_for over n items ran on: the library's calls are spread
// over torch's threads only where it was compiled with OpenMP (_build.py).
int64_t parallel_for_threads(int64_t n) {
  std::vector<std::atomic<bool>> seen(static_cast<size_t>(at::get_num_threads()));
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    seen[static_cast<size_t>(at::get_thread_num())].store(true);
  });
  int64_t threads = 0;
  for (const auto& s : seen) threads += s.load();
  return threads;
}

}  // namespace

void register_ops(py::module_& m);  // ops_bindings.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "agentd's CPU kernels for GGUF block formats";
  m.def("best_isa", &agentd_cpu::best_isa, "0 scalar, 1 AVX2, 2 AVX-512 VNNI (cpuid)");
  m.def("self_check", &agentd_cpu::self_check, "'' if the ISA's kernels agree with scalar");
  m.def("has_type", &has_type, "the ggml type's kernels are compiled in");
  m.def("linear", &linear, "out[n, rows] = x[n, K] @ dequant(w).T", py::arg("x"), py::arg("w"),
        py::arg("type_id"), py::arg("isa"), py::arg("out") = py::none());
  m.def("linear_multi", &linear_multi, "parts side by side in out, activations quantized once",
        py::arg("x"), py::arg("weights"), py::arg("type_ids"), py::arg("isa"),
        py::arg("out") = py::none());
  m.def("dequantize", &dequantize, "out[rows, K] = dequant(w)");
  m.def("quantize_act", &quantize_act, "x[n, K] -> activation blocks [n, bytes]");
  m.def("parallel_for_threads", &parallel_for_threads,
        "threads one at::parallel_for over n items ran on");
  register_ops(m);
}
