// K-quant (Q4_K, Q5_K, Q6_K) products and dequantization with AVX2 + FMA + F16C.
//
// Products: unsigned weight values (4, 5 or 6 bits) times signed int8 activations in pairs
// (_mm256_maddubs_epi16, never saturating: at most 2 * 63 * 128), then times the sub-block's
// scale into int32 (_mm256_madd_epi16), summed in int32 over a super-block and converted to
// float once per super-block. Q4_K/Q5_K minimums go through the activation's group sums, as does
// Q6_K's -32 offset, so the weight values stay unsigned.
//
// Invariant: every load is unaligned (GGUF rows inside an mmap are aligned to nothing beyond a
// byte), results equal the scalar kernels' integer sums exactly, and only the per-super-block
// float accumulation may round differently.
#pragma GCC target("avx2,fma,f16c,bmi2")
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "ggml_blocks.h"
#include "kquants_common.h"
#include "kquants_x86.h"

namespace agentd_cpu {
namespace {

// fp16 (d, dmin) at the start of a Q4_K/Q5_K block, times the activation's scale.
inline __m128 d_dmin_times(const void* blk, float act_d) {
  uint32_t both;
  std::memcpy(&both, blk, 4);
  return _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(both))), _mm_set1_ps(act_d));
}

// pshufb controls that fill each 128-bit lane with one of its int16 elements: the low lane
// with element lo, the high lane with element hi. Loaded from a table rather than built with
// set1 in the loop: the compiler keeps at most a few of them in registers.
struct alignas(32) PickTable {
  uint8_t bytes[12][32];  // rows 0-7: (j, j); rows 8-11: (2i, 2i + 1)
};

constexpr PickTable make_pick_table() {
  PickTable t{};
  for (int row = 0; row < 12; ++row) {
    const int lo = row < 8 ? row : 2 * (row - 8), hi = row < 8 ? row : lo + 1;
    for (int k = 0; k < 32; ++k) {
      t.bytes[row][k] = static_cast<uint8_t>(2 * (k < 16 ? lo : hi) + (k & 1));
    }
  }
  return t;
}

constexpr PickTable kPick = make_pick_table();

inline __m256i pick16(int row) {
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(kPick.bytes[row]));
}

// Q4_K (kHigh false) and Q5_K (kHigh true), which differ only in bit 4 of each weight value:
// one weight row times N activation rows act + j * act_stride into out[j * out_stride]. The
// weight values and scales are unpacked once per super-block for all N rows, and each row's
// operations are the N = 1 kernel's in the same order, so every result equals it bit for bit.
template <bool kHigh, int N>
inline void dot_q45_K(int K, const uint8_t* row, size_t block_bytes, size_t scales_off,
                      size_t qh_off, size_t qs_off, const uint8_t* act, size_t act_stride,
                      float* out, size_t out_stride) {
  __m256 acc[N];
  for (int j = 0; j < N; ++j) acc[j] = _mm256_setzero_ps();
  for (int b = 0; b < K / QK_K; ++b) {
    const uint8_t* blk = row + b * block_bytes;
    const ActQ8_256* a[N];
    for (int j = 0; j < N; ++j) a[j] = reinterpret_cast<const ActQ8_256*>(act + j * act_stride) + b;
    prefetch_ahead(blk, 3);  // 144 or 176 bytes a block
    const KqScaleMins sm = kq_unpack_scale_mins(blk + scales_off);
    const __m256i scales = _mm256_broadcastsi128_si256(
        _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(sm.scales))));
    __m256i qh = kHigh ? load256(blk + qh_off) : _mm256_setzero_si256();
    __m256i isum[N];
    for (int j = 0; j < N; ++j) isum[j] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {  // 32 bytes of nibbles: sub-blocks 2c (low) and 2c + 1 (high)
      __m256i lo, hi;
      q45_values<kHigh>(load256(blk + qs_off + 32 * c), qh, lo, hi);
      const __m256i s_lo = _mm256_shuffle_epi8(scales, pick16(2 * c));
      const __m256i s_hi = _mm256_shuffle_epi8(scales, pick16(2 * c + 1));
      for (int j = 0; j < N; ++j) {
        const __m256i p_lo = _mm256_maddubs_epi16(lo, load256(a[j]->qs + 64 * c));
        const __m256i p_hi = _mm256_maddubs_epi16(hi, load256(a[j]->qs + 64 * c + 32));
        isum[j] = _mm256_add_epi32(isum[j], _mm256_add_epi32(_mm256_madd_epi16(p_lo, s_lo),
                                                             _mm256_madd_epi16(p_hi, s_hi)));
      }
    }
    for (int j = 0; j < N; ++j) {
      const __m128i dm = _mm_castps_si128(d_dmin_times(blk, a[j]->d));
      const __m256 d = _mm256_castsi256_ps(_mm256_broadcastd_epi32(dm));
      const __m256 dmin = _mm256_castsi256_ps(_mm256_broadcastd_epi32(_mm_srli_si128(dm, 4)));
      acc[j] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum[j]), acc[j]);
      acc[j] = _mm256_fnmadd_ps(dmin, _mm256_cvtepi32_ps(min_terms(sm.mins, *a[j])), acc[j]);
    }
  }
  for (int j = 0; j < N; ++j) out[j * out_stride] = hsum(acc[j]);
}

// Eight floats ds * q - dm from the low eight bytes of q8. ds * q is exact in fp32 (see
// kquants_scalar.cpp), so the fused form rounds once, exactly as a multiply and a subtract do.
inline void store8(float* out, __m128i q8, __m256 ds, __m256 dm) {
  const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q8));
  _mm256_storeu_ps(out, _mm256_fmsub_ps(ds, q, dm));
}

// 32 floats: 16 from each 128-bit lane of q, lane i with scale ds[i] and offset dm[i].
inline void store32(float* out, __m256i q, const __m256 ds[2], const __m256 dm[2]) {
  const __m128i q_lo = _mm256_castsi256_si128(q), q_hi = _mm256_extracti128_si256(q, 1);
  store8(out, q_lo, ds[0], dm[0]);
  store8(out + 8, _mm_srli_si128(q_lo, 8), ds[0], dm[0]);
  store8(out + 16, q_hi, ds[1], dm[1]);
  store8(out + 24, _mm_srli_si128(q_hi, 8), ds[1], dm[1]);
}

template <bool kHigh>
inline void dequant_q45_K(int K, const uint8_t* row, size_t block_bytes, size_t scales_off,
                          size_t qh_off, size_t qs_off, float* out) {
  for (int b = 0; b < K / QK_K; ++b, out += QK_K) {
    const uint8_t* blk = row + b * block_bytes;
    const KqScaleMins sm = kq_unpack_scale_mins(blk + scales_off);
    const __m128 dm = d_dmin_times(blk, 1.0f);
    const float d = _mm_cvtss_f32(dm), dmin = _mm_cvtss_f32(_mm_movehdup_ps(dm));
    __m256i qh = kHigh ? load256(blk + qh_off) : _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {  // sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles)
      __m256i lo, hi;
      q45_values<kHigh>(load256(blk + qs_off + 32 * c), qh, lo, hi);
      for (int s = 0; s < 2; ++s) {
        const int j = 2 * c + s;
        const __m256 ds = _mm256_set1_ps(d * kq_byte(sm.scales, j));
        const __m256 dmj = _mm256_set1_ps(dmin * kq_byte(sm.mins, j));
        const __m256 ds2[2] = {ds, ds}, dm2[2] = {dmj, dmj};
        store32(out + 32 * j, s == 0 ? lo : hi, ds2, dm2);
      }
    }
  }
}

constexpr size_t kQ4Scales = offsetof(BlockQ4_K, scales), kQ4Qs = offsetof(BlockQ4_K, qs);
constexpr size_t kQ5Scales = offsetof(BlockQ5_K, scales), kQ5Qs = offsetof(BlockQ5_K, qs);
constexpr size_t kQ5Qh = offsetof(BlockQ5_K, qh);

// The four 32-byte vectors of 6-bit values (0..63) of half h of a Q6_K super-block, in weight
// order: value bytes 32i..32i+31 of the half are q[i].
inline void q6_half(const BlockQ6_K& blk, int h, __m256i q[4]) {
  const __m256i low4 = _mm256_set1_epi8(0x0f), bits45 = _mm256_set1_epi8(0x30);
  const __m256i l0 = load256(blk.ql + 64 * h), l1 = load256(blk.ql + 64 * h + 32);
  const __m256i hb = load256(blk.qh + 32 * h);
  q[0] = _mm256_or_si256(_mm256_and_si256(l0, low4),
                         _mm256_and_si256(_mm256_slli_epi16(hb, 4), bits45));
  q[1] = _mm256_or_si256(_mm256_and_si256(l1, low4),
                         _mm256_and_si256(_mm256_slli_epi16(hb, 2), bits45));
  q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                         _mm256_and_si256(hb, bits45));
  q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                         _mm256_and_si256(_mm256_srli_epi16(hb, 2), bits45));
}

// Q6_K: one weight row times N activation rows, as dot_q45_K.
template <int N>
inline void dot_q6_K(int K, const BlockQ6_K* blocks, const uint8_t* act, size_t act_stride,
                     float* out, size_t out_stride) {
  __m256 acc[N];
  for (int j = 0; j < N; ++j) acc[j] = _mm256_setzero_ps();
  for (int b = 0; b < K / QK_K; ++b) {
    const BlockQ6_K& blk = blocks[b];
    const ActQ8_256* x[N];
    for (int j = 0; j < N; ++j) x[j] = reinterpret_cast<const ActQ8_256*>(act + j * act_stride) + b;
    prefetch_ahead(&blk, 4);  // 210 bytes a block
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.scales));
    const __m256i sc8_16 = _mm256_cvtepi8_epi16(sc8);
    // The -32 offset: 32 * sum_g scale_g * bsums_g, taken off the super-block's int32 sum.
    __m256i isum[N];
    for (int j = 0; j < N; ++j) {
      isum[j] = _mm256_sub_epi32(
          _mm256_setzero_si256(),
          _mm256_slli_epi32(_mm256_madd_epi16(load256(bsums_of(*x[j])), sc8_16), 5));
    }
    for (int h = 0; h < 2; ++h) {
      __m256i q[4];
      q6_half(blk, h, q);
      // Scales of the half as int16 in both lanes; vector i spans groups 2i (low lane), 2i + 1.
      const __m128i sc_half = h == 0 ? sc8 : _mm_unpackhi_epi64(sc8, sc8);
      const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(sc_half));
      for (int i = 0; i < 4; ++i) {
        const __m256i s = _mm256_shuffle_epi8(sc16, pick16(8 + i));
        for (int j = 0; j < N; ++j) {
          const __m256i p = _mm256_maddubs_epi16(q[i], load256(x[j]->qs + 128 * h + 32 * i));
          isum[j] = _mm256_add_epi32(isum[j], _mm256_madd_epi16(p, s));
        }
      }
    }
    const float d = _cvtsh_ss(blk.d);
    for (int j = 0; j < N; ++j) {
      acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[j]->d), _mm256_cvtepi32_ps(isum[j]), acc[j]);
    }
  }
  for (int j = 0; j < N; ++j) out[j * out_stride] = hsum(acc[j]);
}

}  // namespace

float vec_dot_q4_K_avx2(int K, const void* w, const void* a) {
  float out;
  dot_q45_K<false, 1>(K, static_cast<const uint8_t*>(w), sizeof(BlockQ4_K), kQ4Scales, 0, kQ4Qs,
                      static_cast<const uint8_t*>(a), 0, &out, 0);
  return out;
}

float vec_dot_q5_K_avx2(int K, const void* w, const void* a) {
  float out;
  dot_q45_K<true, 1>(K, static_cast<const uint8_t*>(w), sizeof(BlockQ5_K), kQ5Scales, kQ5Qh,
                     kQ5Qs, static_cast<const uint8_t*>(a), 0, &out, 0);
  return out;
}

float vec_dot_q6_K_avx2(int K, const void* w, const void* a) {
  float out;
  dot_q6_K<1>(K, static_cast<const BlockQ6_K*>(w), static_cast<const uint8_t*>(a), 0, &out, 0);
  return out;
}

void vec_dot_cols_q4_K_avx2(int K, const void* w, const void* act, size_t act_stride, int n,
                            float* out, size_t out_stride) {
  by_columns(n, act, act_stride, out, out_stride, [&]<int N>(const uint8_t* a, float* o) {
    dot_q45_K<false, N>(K, static_cast<const uint8_t*>(w), sizeof(BlockQ4_K), kQ4Scales, 0,
                        kQ4Qs, a, act_stride, o, out_stride);
  });
}

void vec_dot_cols_q5_K_avx2(int K, const void* w, const void* act, size_t act_stride, int n,
                            float* out, size_t out_stride) {
  by_columns(n, act, act_stride, out, out_stride, [&]<int N>(const uint8_t* a, float* o) {
    dot_q45_K<true, N>(K, static_cast<const uint8_t*>(w), sizeof(BlockQ5_K), kQ5Scales, kQ5Qh,
                       kQ5Qs, a, act_stride, o, out_stride);
  });
}

void vec_dot_cols_q6_K_avx2(int K, const void* w, const void* act, size_t act_stride, int n,
                            float* out, size_t out_stride) {
  by_columns(n, act, act_stride, out, out_stride, [&]<int N>(const uint8_t* a, float* o) {
    dot_q6_K<N>(K, static_cast<const BlockQ6_K*>(w), a, act_stride, o, out_stride);
  });
}

void dequant_row_q4_K_avx2(int K, const void* w, float* out) {
  dequant_q45_K<false>(K, static_cast<const uint8_t*>(w), sizeof(BlockQ4_K), kQ4Scales, 0, kQ4Qs,
                       out);
}

void dequant_row_q5_K_avx2(int K, const void* w, float* out) {
  dequant_q45_K<true>(K, static_cast<const uint8_t*>(w), sizeof(BlockQ5_K), kQ5Scales, kQ5Qh,
                      kQ5Qs, out);
}

void dequant_row_q6_K_avx2(int K, const void* w, float* out) {
  const auto* blocks = static_cast<const BlockQ6_K*>(w);
  for (int b = 0; b < K / QK_K; ++b, out += QK_K) {
    const BlockQ6_K& blk = blocks[b];
    const float d = _cvtsh_ss(blk.d);
    for (int h = 0; h < 2; ++h) {
      __m256i q[4];
      q6_half(blk, h, q);
      for (int i = 0; i < 4; ++i) {
        // Groups 8h + 2i (low lane) and + 1 (high lane). d * sc * (q - 32) as
        // d * sc * q - 32 * d * sc: both products are exact, so one rounding, the same.
        const int g = 8 * h + 2 * i;
        const float ds_lo = d * static_cast<float>(blk.scales[g]);
        const float ds_hi = d * static_cast<float>(blk.scales[g + 1]);
        const __m256 ds[2] = {_mm256_set1_ps(ds_lo), _mm256_set1_ps(ds_hi)};
        const __m256 dm[2] = {_mm256_set1_ps(32 * ds_lo), _mm256_set1_ps(32 * ds_hi)};
        store32(out + 128 * h + 32 * i, q[i], ds, dm);
      }
    }
  }
}

}  // namespace agentd_cpu
