// The kernel table and the per-thread row loops (see dispatch.h), in plain C++: the one place
// that reads cpuid. The K-quant kernels (kquants_*.cpp, another file set) are declared weak here,
// so this library links and serves the other types while those files are absent, and a type is
// offered only when its scalar kernels are present.
#include "dispatch.h"

#include <algorithm>

#include <cmath>
#include <cstring>
#include <vector>

namespace agentd_cpu {

#define AGENTD_WEAK __attribute__((weak))
AGENTD_WEAK float vec_dot_q4_K_scalar(int K, const void* w, const void* a);
AGENTD_WEAK float vec_dot_q5_K_scalar(int K, const void* w, const void* a);
AGENTD_WEAK float vec_dot_q6_K_scalar(int K, const void* w, const void* a);
AGENTD_WEAK float vec_dot_q4_K_avx2(int K, const void* w, const void* a);
AGENTD_WEAK float vec_dot_q5_K_avx2(int K, const void* w, const void* a);
AGENTD_WEAK float vec_dot_q6_K_avx2(int K, const void* w, const void* a);
AGENTD_WEAK float vec_dot_q4_K_avx512(int K, const void* w, const void* a);
AGENTD_WEAK float vec_dot_q5_K_avx512(int K, const void* w, const void* a);
AGENTD_WEAK float vec_dot_q6_K_avx512(int K, const void* w, const void* a);
AGENTD_WEAK void dequant_row_q4_K(int K, const void* w, float* out);
AGENTD_WEAK void dequant_row_q5_K(int K, const void* w, float* out);
AGENTD_WEAK void dequant_row_q6_K(int K, const void* w, float* out);
AGENTD_WEAK void dequant_row_q4_K_avx2(int K, const void* w, float* out);
AGENTD_WEAK void dequant_row_q5_K_avx2(int K, const void* w, float* out);
AGENTD_WEAK void dequant_row_q6_K_avx2(int K, const void* w, float* out);
AGENTD_WEAK void vec_dot_cols_q4_K_avx2(int K, const void* w, const void* act, size_t act_stride,
                                        int n, float* out, size_t out_stride);
AGENTD_WEAK void vec_dot_cols_q5_K_avx2(int K, const void* w, const void* act, size_t act_stride,
                                        int n, float* out, size_t out_stride);
AGENTD_WEAK void vec_dot_cols_q6_K_avx2(int K, const void* w, const void* act, size_t act_stride,
                                        int n, float* out, size_t out_stride);
AGENTD_WEAK void vec_dot_cols_q4_K_avx512(int K, const void* w, const void* act,
                                          size_t act_stride, int n, float* out, size_t out_stride);
AGENTD_WEAK void vec_dot_cols_q5_K_avx512(int K, const void* w, const void* act,
                                          size_t act_stride, int n, float* out, size_t out_stride);
AGENTD_WEAK void vec_dot_cols_q6_K_avx512(int K, const void* w, const void* act,
                                          size_t act_stride, int n, float* out, size_t out_stride);
#undef AGENTD_WEAK

namespace {

// One row per ggml type: its activation format and block, then per ISA (scalar, AVX2, AVX-512)
// its product and dequantizer; nullptr where an ISA has none of its own.
struct TypeEntry {
  int type_id;
  ActKind act;
  int block_weights, block_bytes;
  VecDotFn dot[3];
  DequantRowFn dequant[3];
  VecDotColsFn cols[3] = {nullptr, nullptr, nullptr};
};

const TypeEntry kTypes[] = {
    {F32, kActF32, 1, 4, {nullptr, nullptr, nullptr}, {dequant_row_f32, nullptr, nullptr}},
    {F16, kActF32, 1, 2, {vec_dot_f16_scalar, vec_dot_f16_avx2, vec_dot_f16_avx512},
     {dequant_row_f16, dequant_row_f16_avx2, nullptr}},
    {BF16, kActF32, 1, 2, {vec_dot_bf16_scalar, vec_dot_bf16_avx2, vec_dot_bf16_avx512},
     {dequant_row_bf16, dequant_row_bf16_avx2, nullptr}},
    {Q4_0, kActQ8_32, QK32, sizeof(BlockQ4_0),
     {vec_dot_q4_0_scalar, vec_dot_q4_0_avx2, vec_dot_q4_0_avx512},
     {dequant_row_q4_0, dequant_row_q4_0_avx2, nullptr},
     {nullptr, vec_dot_cols_q4_0_avx2, vec_dot_cols_q4_0_avx512}},
    {Q4_1, kActQ8_32, QK32, sizeof(BlockQ4_1),
     {vec_dot_q4_1_scalar, vec_dot_q4_1_avx2, vec_dot_q4_1_avx512},
     {dequant_row_q4_1, dequant_row_q4_1_avx2, nullptr},
     {nullptr, vec_dot_cols_q4_1_avx2, vec_dot_cols_q4_1_avx512}},
    {Q8_0, kActQ8_32, QK32, sizeof(BlockQ8_0),
     {vec_dot_q8_0_scalar, vec_dot_q8_0_avx2, vec_dot_q8_0_avx512},
     {dequant_row_q8_0, dequant_row_q8_0_avx2, nullptr},
     {nullptr, vec_dot_cols_q8_0_avx2, vec_dot_cols_q8_0_avx512}},
    {Q4_K, kActQ8_256, QK_K, sizeof(BlockQ4_K),
     {vec_dot_q4_K_scalar, vec_dot_q4_K_avx2, vec_dot_q4_K_avx512},
     {dequant_row_q4_K, dequant_row_q4_K_avx2, nullptr},
     {nullptr, vec_dot_cols_q4_K_avx2, vec_dot_cols_q4_K_avx512}},
    {Q5_K, kActQ8_256, QK_K, sizeof(BlockQ5_K),
     {vec_dot_q5_K_scalar, vec_dot_q5_K_avx2, vec_dot_q5_K_avx512},
     {dequant_row_q5_K, dequant_row_q5_K_avx2, nullptr},
     {nullptr, vec_dot_cols_q5_K_avx2, vec_dot_cols_q5_K_avx512}},
    {Q6_K, kActQ8_256, QK_K, sizeof(BlockQ6_K),
     {vec_dot_q6_K_scalar, vec_dot_q6_K_avx2, vec_dot_q6_K_avx512},
     {dequant_row_q6_K, dequant_row_q6_K_avx2, nullptr},
     {nullptr, vec_dot_cols_q6_K_avx2, vec_dot_cols_q6_K_avx512}},
};

const QuantizeActFn kQuantizers[3][3] = {
    {nullptr, nullptr, nullptr},  // kActF32: the rows are used as they are
    {quantize_act_q8_32_scalar, quantize_act_q8_32_avx2, quantize_act_q8_32_avx512},
    {quantize_act_q8_256_scalar, quantize_act_q8_256_avx2, quantize_act_q8_256_avx512},
};

const TypeEntry* find_type(int type_id) {
  for (const TypeEntry& e : kTypes) {
    if (e.type_id == type_id) return &e;
  }
  return nullptr;
}

template <typename Fn>
int level_at_or_below(const Fn (&fns)[3], int isa) {
  for (int i = isa; i >= 0; --i) {
    if (fns[i] != nullptr) return i;
  }
  return -1;
}

template <typename Fn>
Fn best_at_or_below(const Fn (&fns)[3], int isa) {
  const int level = level_at_or_below(fns, isa);
  return level < 0 ? nullptr : fns[level];
}

}  // namespace

int best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx2") &&
      __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
      __builtin_cpu_supports("bmi2")) {
    return kIsaAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2")) {
    return kIsaAvx2;
  }
  return kIsaScalar;
}

bool cpu_has_avx512_bf16() {
  __builtin_cpu_init();
  return best_isa() == kIsaAvx512 && __builtin_cpu_supports("avx512bf16");
}

bool type_kernels(int type_id, int isa, TypeKernels* out) {
  const TypeEntry* e = find_type(type_id);
  if (e == nullptr || e->dequant[kIsaScalar] == nullptr) return false;
  if (e->act != kActF32 && e->dot[kIsaScalar] == nullptr) return false;
  // Only the dot's own ISA's column kernel: its results equal that dot's bit for bit.
  const int dot_level = level_at_or_below(e->dot, isa);
  *out = {e->act, e->block_weights, e->block_bytes, best_at_or_below(e->dot, isa),
          dot_level < 0 ? nullptr : e->cols[dot_level], best_at_or_below(e->dequant, isa)};
  return true;
}

QuantizeActFn act_quantizer(ActKind kind, int isa) {
  return best_at_or_below(kQuantizers[kind], isa);
}

size_t act_row_bytes(ActKind kind, int K) {
  switch (kind) {
    case kActQ8_32: return sizeof(ActQ8_32) * (K / QK32);
    case kActQ8_256: return sizeof(ActQ8_256) * (K / QK_K);
    default: return sizeof(float) * K;
  }
}

void dot_rows(const TypeKernels& k, int K, const uint8_t* w, int64_t w_stride, int64_t r0,
              int64_t r1, const uint8_t* act, int64_t act_stride, int64_t n, float* out,
              int64_t out_stride) {
  // One weight row at a time against a block of activation rows: the weight row (a few KB)
  // stays in L1 while the block's rows stream from L2. Up to kActBlock rows (decode) the
  // weights are read from memory once; a prefill's thousands of rows (MBs of activations)
  // go block by block over the same weight rows, which then come from L2.
  constexpr int64_t kActBlock = 64;
  for (int64_t j0 = 0; j0 < n; j0 += kActBlock) {
    const int64_t nj = std::min(kActBlock, n - j0);
    const uint8_t* block = act + j0 * act_stride;
    float* block_out = out + j0 * out_stride;
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = w + r * w_stride;
      if (nj > 1 && k.dot_cols != nullptr) {
        k.dot_cols(K, row, block, act_stride, static_cast<int>(nj), block_out + r, out_stride);
        continue;
      }
      for (int64_t j = 0; j < nj; ++j) {
        block_out[j * out_stride + r] = k.dot(K, row, block + j * act_stride);
      }
    }
  }
}

void dequant_rows(const TypeKernels& k, int K, const uint8_t* w, int64_t w_stride, int64_t r0,
                  int64_t r1, float* out, int64_t out_stride) {
  for (int64_t r = r0; r < r1; ++r) k.dequant(K, w + r * w_stride, out + (r - r0) * out_stride);
}

namespace {

struct Rng {
  uint64_t state = 0x9E3779B97F4A7C15ull;
  uint32_t next() {  // xorshift64*
    state ^= state >> 12;
    state ^= state << 25;
    state ^= state >> 27;
    return static_cast<uint32_t>((state * 0x2545F4914F6CDD1Dull) >> 32);
  }
  float uniform() { return static_cast<float>(next() >> 8) / 8388608.0f * 2.0f - 1.0f; }
  // A finite fp16 of magnitude 2^(lo - 15) .. 2^(hi - 14).
  uint16_t fp16(int lo, int hi) {
    const uint32_t e = lo + next() % (hi - lo + 1);
    return static_cast<uint16_t>(((next() & 1) << 15) | (e << 10) | (next() & 0x3ff));
  }
};

// Byte offsets of the fp16 fields inside one block of each quantized type.
std::vector<int> fp16_fields(int type_id) {
  switch (type_id) {
    case Q4_0: case Q8_0: return {0};
    case Q4_1: case Q4_K: case Q5_K: return {0, 2};
    case Q6_K: return {offsetof(BlockQ6_K, d)};
    default: return {};
  }
}

// Random weight rows with finite scales (and finite values, for F16/BF16).
std::vector<uint8_t> random_rows(Rng& rng, int type_id, const TypeKernels& k, int K, int rows) {
  const size_t row_bytes = static_cast<size_t>(K / k.block_weights) * k.block_bytes;
  std::vector<uint8_t> w(row_bytes * rows);
  for (uint8_t& b : w) b = static_cast<uint8_t>(rng.next());
  if (type_id == F32) {
    for (size_t off = 0; off < w.size(); off += 4) {
      const float v = rng.uniform();
      std::memcpy(&w[off], &v, 4);
    }
    return w;
  }
  for (size_t off = 0; off < w.size(); off += k.block_bytes) {
    uint16_t h = 0;
    for (int field : fp16_fields(type_id)) {
      h = rng.fp16(8, 16);
      std::memcpy(&w[off + field], &h, 2);
    }
    if (type_id == F16) h = rng.fp16(5, 20);
    if (type_id == BF16) {  // exponents 120..135: magnitudes 2^-7 .. 2^9
      h = static_cast<uint16_t>((rng.next() & 0x8000) | (120 + rng.next() % 16) << 7 |
                                (rng.next() & 0x7f));
    }
    if (type_id == F16 || type_id == BF16) std::memcpy(&w[off], &h, 2);
  }
  return w;
}

// The activation row a product sees, as floats (the dequantized int8 blocks).
std::vector<float> act_values(ActKind kind, int K, const uint8_t* act) {
  std::vector<float> x(K);
  for (int i = 0; i < K; ++i) {
    if (kind == kActQ8_32) {
      const auto* b = reinterpret_cast<const ActQ8_32*>(act) + i / QK32;
      x[i] = b->d * b->qs[i % QK32];
    } else if (kind == kActQ8_256) {
      const auto* b = reinterpret_cast<const ActQ8_256*>(act) + i / QK_K;
      x[i] = b->d * b->qs[i % QK_K];
    } else {
      std::memcpy(&x[i], act + 4 * i, 4);
    }
  }
  return x;
}

}  // namespace

std::string self_check(int isa) {
  std::string failures;
  Rng rng;
  constexpr int K = 1024, kRows = 8;
  std::vector<float> x(K);
  for (float& v : x) v = rng.uniform() * 3.0f;
  std::vector<uint8_t> act[3];
  act[kActF32].resize(sizeof(float) * K);
  std::memcpy(act[kActF32].data(), x.data(), act[kActF32].size());
  for (ActKind kind : {kActQ8_32, kActQ8_256}) {
    act[kind].resize(act_row_bytes(kind, K));
    std::vector<uint8_t> other(act[kind].size());
    act_quantizer(kind, kIsaScalar)(K, x.data(), act[kind].data());
    act_quantizer(kind, isa)(K, x.data(), other.data());
    if (other != act[kind]) {
      failures += kind == kActQ8_32 ? "quantize q8_32; " : "quantize q8_256; ";
    }
  }
  for (const TypeEntry& e : kTypes) {
    TypeKernels ref, test;
    if (!type_kernels(e.type_id, kIsaScalar, &ref)) continue;
    type_kernels(e.type_id, isa, &test);
    const std::vector<uint8_t> w = random_rows(rng, e.type_id, ref, K, kRows);
    const size_t row_bytes = w.size() / kRows;
    const std::vector<float> xs = act_values(e.act, K, act[e.act].data());
    std::vector<float> wr(K), wt(K);
    for (int r = 0; r < kRows; ++r) {
      const uint8_t* row = w.data() + r * row_bytes;
      ref.dequant(K, row, wr.data());
      test.dequant(K, row, wt.data());
      if (wr != wt) {  // value equality: a zero's sign may differ
        failures += "dequant type " + std::to_string(e.type_id) + "; ";
        break;
      }
      if (ref.dot == nullptr) continue;
      double mag = 0.0;  // the products' rounding is relative to sum |w x|
      for (int i = 0; i < K; ++i) mag += std::fabs(static_cast<double>(wr[i]) * xs[i]);
      const float a = ref.dot(K, row, act[e.act].data()), b = test.dot(K, row, act[e.act].data());
      if (test.dot_cols != nullptr) {  // five copies of the row: equal to dot bit for bit
        const size_t stride = act_row_bytes(e.act, K);
        std::vector<uint8_t> acts(5 * stride);
        for (int j = 0; j < 5; ++j) std::memcpy(&acts[j * stride], act[e.act].data(), stride);
        float cols[5];
        test.dot_cols(K, row, acts.data(), stride, 5, cols, 1);
        bool same = true;
        for (float c : cols) same &= std::memcmp(&c, &b, 4) == 0;
        if (!same) failures += "dot_cols type " + std::to_string(e.type_id) + "; ";
      }
      if (!(std::fabs(static_cast<double>(a) - b) <= 1e-5 * mag + 1e-30)) {
        failures += "dot type " + std::to_string(e.type_id) + "; ";
        break;
      }
    }
  }
  return failures;
}

}  // namespace agentd_cpu
