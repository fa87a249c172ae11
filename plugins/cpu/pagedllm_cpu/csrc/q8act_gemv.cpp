// y = x @ W.T for a few rows of x (batch-1..4 decode) from GGUF Q8_0 / Q4_0 / Q4_1 weights with int8 activations,
// as llama.cpp does: the fp32 kernels (q8_gemv, q4_gemv) convert every weight to fp32 and are compute-bound at
// batch 1; here x is quantized once per call and each 32-block is an integer dot product, so the weights stream.
//
// x is quantized exactly as ggml's quantize_row_q8_0_ref / q8_1_ref: per block of 32, d = amax / 127, q =
// roundf(x / d) (half away from zero), d stored as fp16; Q8_1 also s = fp16(d * sum q). Q8_0 and Q4_0 weights take
// Q8_0 activations, Q4_1 weights Q8_1 ones (ggml's vec_dot_type). Per block: sumi = sum_j wq_j xq_j in int32,
// y += (d_w * d_x) * sumi (Q4_0: wq - 8, exact in int32; Q4_1: + m_w * s_x), accumulated in fp32.
//
// Q8_0 weights are read in place (34-byte blocks, unaligned); Q4_0 / Q4_1 in q4_gemv's repacked layout (16 output
// rows interleaved, ``quant.py`` ``_repack``): there one 64-byte load holds 4 nibbles of each of 16 rows, so a
// masked load is 16 rows x 4 weights of u8 and one ``vpdpbusd`` against a broadcast word of 4 int8 activations
// serves 16 rows. Q8_0 on AVX-512: two rows' blocks in one register, offset to u8 (w ^ 0x80 = w + 128) with the
// 128 * sum(x) correction preloaded into the int32 sums. AVX2 has no u8 x s8 dot into int32: ``vpmaddubsw``
// (Q8_0 with the sign trick: |w| x sign(x, w)) then ``vpmaddwd`` by ones; portable C++ loops otherwise.
//
// The level is chosen at run time (``__builtin_cpu_supports``): AVX-512 with VNNI (F/BW/VL/VNNI), AVX2, portable;
// the SIMD paths are compiled with function target attributes, so every build has all three. ``isa`` (-1: the
// best) forces one for tests and comparisons. Output rows are split across threads; x's blocks stay in L1.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "kernels.h"

#include "cpu_common.h"

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PAGEDLLM_Q8A_X86 1
#define PAGEDLLM_Q8A_T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
#define PAGEDLLM_Q8A_T256 __attribute__((target("avx2,fma,f16c")))
#endif

namespace {

constexpr int64_t kBlock = 32;       // weights per block
constexpr int64_t kQ8Bytes = 34;     // Q8_0 block: fp16 d + 32 int8
constexpr int64_t kRows = 16;        // output rows per group of q4_gemv's layout
constexpr int64_t kTile = 4;         // rows of x per pass over the weights

enum Type { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };
enum Isa { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

inline uint16_t bits_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return bits;
}

inline float fp16_round(float v) {
  return c10::detail::fp16_ieee_to_fp32_value(c10::detail::fp16_ieee_from_fp32_value(v));
}

// x quantized for one weight type, rows [m][...]: q in the order the kernel reads (Q8_0 weights: natural; Q4: per
// block 8 words, word 2c = x[8c], x[8c+2], x[8c+4], x[8c+6], word 2c + 1 the odd ones: the repacked nibbles' order).
struct QuantX {
  int64_t nb = 0;
  std::vector<int8_t> q;       // [m][nb * 32]
  std::vector<float> d;        // [m][nb] fp16-rounded
  std::vector<float> s;        // [m][nb] Q8_1's fp16(d * sum q)
  std::vector<int32_t> sum;    // [m][nb] sum q
  std::vector<int32_t> corr;   // [m][nb][8] -128 * sum of each 4-byte lane (Q8_0 weights, AVX-512 offset trick)
};

// ggml's roundf (half away from zero), exact: v - trunc(v) is exact for |v| <= 127.
inline float round_away(float v) {
  const float t = std::trunc(v);
  return std::fabs(v - t) >= 0.5f ? t + std::copysign(1.f, v) : t;
}

// One block of 32: q = roundf(v * id) with d = amax / 127, id = 1 / d (0 for an all-zero block); returns d.
float quantize_block_portable(const float* v, int8_t* q) {
  float amax = 0.f;
  for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  for (int64_t j = 0; j < kBlock; ++j) q[j] = static_cast<int8_t>(round_away(v[j] * id));
  return d;
}

#ifdef PAGEDLLM_Q8A_X86
// The same operations in 8 lanes (IEEE mul and truncation: bit-identical to the portable block).
PAGEDLLM_Q8A_T256 float quantize_block_avx2(const float* v, int8_t* q) {
  const __m256 sign = _mm256_set1_ps(-0.f), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.f);
  __m256 x[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(v + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, x[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float d = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))) / 127.f;
  const __m256 id = _mm256_set1_ps(d != 0.f ? 1.f / d : 0.f);
  __m256i r[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 y = _mm256_mul_ps(x[i], id);
    const __m256 t = _mm256_round_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 up = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(y, t)), half, _CMP_GE_OQ);
    const __m256 step = _mm256_and_ps(up, _mm256_or_ps(_mm256_and_ps(y, sign), one));
    r[i] = _mm256_cvttps_epi32(_mm256_add_ps(t, step));
  }
  // int32 -> int8 (|q| <= 127: no saturation); packs interleave 128-bit lanes, the permute puts them back in order.
  const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return d;
}

PAGEDLLM_Q8A_T512 float quantize_block_avx512(const float* v, int8_t* q) {
  const __m512 x0 = _mm512_loadu_ps(v), x1 = _mm512_loadu_ps(v + 16);
  const float d = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1))) / 127.f;
  const __m512 id = _mm512_set1_ps(d != 0.f ? 1.f / d : 0.f);
  const __m512 sign = _mm512_set1_ps(-0.f), one = _mm512_set1_ps(1.f);
  for (int i = 0; i < 2; ++i) {
    const __m512 y = _mm512_mul_ps(i ? x1 : x0, id);
    const __m512 t = _mm512_roundscale_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(y, t)), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    const __m512 r = _mm512_mask_add_ps(t, up, t, _mm512_or_ps(_mm512_and_ps(y, sign), one));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * i), _mm512_cvtsepi32_epi8(_mm512_cvttps_epi32(r)));
  }
  return d;
}
#endif

void quantize_rows(Isa isa, const float* x, int64_t mrows, int64_t k, Type t, QuantX& out) {
  const int64_t nb = k / kBlock;
  out.nb = nb;
  out.q.resize(mrows * k);
  out.d.resize(mrows * nb);
  out.s.resize(mrows * nb);
  out.sum.resize(mrows * nb);
  out.corr.resize(t == kQ8_0 ? mrows * nb * 8 : 0);
  int8_t q[kBlock];
  for (int64_t i = 0; i < mrows * nb; ++i) {
    const float* v = x + i * kBlock;
#ifdef PAGEDLLM_Q8A_X86
    const float d = isa == kAvx512 ? quantize_block_avx512(v, q)
                    : isa == kAvx2 ? quantize_block_avx2(v, q)
                                   : quantize_block_portable(v, q);
#else
    const float d = quantize_block_portable(v, q);
#endif
    int32_t sum = 0;
    for (int64_t j = 0; j < kBlock; ++j) sum += q[j];
    out.d[i] = fp16_round(d);
    out.s[i] = fp16_round(static_cast<float>(sum) * d);
    out.sum[i] = sum;
    int8_t* dst = out.q.data() + i * kBlock;
    if (t == kQ8_0) {
      std::memcpy(dst, q, kBlock);
      for (int64_t l = 0; l < 8; ++l) out.corr[i * 8 + l] = -128 * (q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
    } else {
      for (int64_t c = 0; c < 4; ++c)
        for (int64_t i4 = 0; i4 < 4; ++i4) {
          dst[8 * c + i4] = q[8 * c + 2 * i4];
          dst[8 * c + 4 + i4] = q[8 * c + 2 * i4 + 1];
        }
    }
  }
}

// One call's view of x's quantized tile: rows m0.. of QuantX.
struct XTile {
  const QuantX* qx;
  int64_t m0;
  const int8_t* q(int m) const { return qx->q.data() + (m0 + m) * qx->nb * kBlock; }
  const float* d(int m) const { return qx->d.data() + (m0 + m) * qx->nb; }
  const float* s(int m) const { return qx->s.data() + (m0 + m) * qx->nb; }
  const int32_t* sum(int m) const { return qx->sum.data() + (m0 + m) * qx->nb; }
  const int32_t* corr(int m) const { return qx->corr.data() + (m0 + m) * qx->nb * 8; }
};

// ---- Q8_0: rows [r0, r1) of the blocks, y[m * ys + r] ------------------------------------------------------------
template <int MT>
void q8_rows_portable(const uint8_t* w, int64_t rs, int64_t r0, int64_t r1, int64_t nb, const XTile& x, float* y,
                      int64_t ys) {
  for (int64_t r = r0; r < r1; ++r) {
    float acc[MT] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = w + r * rs + b * kQ8Bytes;
      const float dw = c10::detail::fp16_ieee_to_fp32_value(bits_at(p));
      const int8_t* wq = reinterpret_cast<const int8_t*>(p + 2);
      for (int m = 0; m < MT; ++m) {
        const int8_t* xq = x.q(m) + b * kBlock;
        int32_t s = 0;
        for (int64_t j = 0; j < kBlock; ++j) s += wq[j] * xq[j];
        acc[m] += static_cast<float>(s) * (dw * x.d(m)[b]);
      }
    }
    for (int m = 0; m < MT; ++m) y[m * ys + r] = acc[m];
  }
}

#ifdef PAGEDLLM_Q8A_X86
PAGEDLLM_Q8A_T256 inline float hsum256(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

template <int MT>
PAGEDLLM_Q8A_T256 void q8_rows_avx2(const uint8_t* w, int64_t rs, int64_t r0, int64_t r1, int64_t nb, const XTile& x,
                                    float* y, int64_t ys) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t r = r0; r < r1; ++r) {
    __m256 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = w + r * rs + b * kQ8Bytes;
      const float dw = _cvtsh_ss(bits_at(p));
      const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
      const __m256i aw = _mm256_sign_epi8(wq, wq);  // |w| as u8 (-128 -> 128)
      for (int m = 0; m < MT; ++m) {
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q(m) + b * kBlock));
        const __m256i p16 = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xq, wq));  // |w| * x sign(w): |.| <= 32512
        const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
        acc[m] = _mm256_fmadd_ps(s, _mm256_set1_ps(dw * x.d(m)[b]), acc[m]);
      }
    }
    for (int m = 0; m < MT; ++m) y[m * ys + r] = hsum256(acc[m]);
  }
}

// Weights are read this many bytes ahead with software prefetches: on this project's VMs the hardware prefetcher alone
// left the batch-1 Q8_0 decode waiting on memory (1.7B Q8_0, 2 threads, Xeon with AMX: 9.9 tok/s at 1 KB ahead,
// 12.9 at 3 KB; q8_gemv.cpp measured 3 KB best too). Past a row's end it touches the next row's blocks (harmless).
constexpr int64_t kPrefetch = 3072;

// Two rows per register (row r in the low 256 bits, r + 1 in the high ones).
template <int MT>
PAGEDLLM_Q8A_T512 void q8_rows_avx512(const uint8_t* w, int64_t rs, int64_t r0, int64_t r1, int64_t nb,
                                      const XTile& x, float* y, int64_t ys) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t r = r0; r < r1; r += 2) {
    const bool pair = r + 1 < r1;
    const uint8_t* pa = w + r * rs;
    const uint8_t* pb = pair ? pa + rs : pa;
    __m512 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* a = pa + b * kQ8Bytes;
      const uint8_t* c = pb + b * kQ8Bytes;
      _mm_prefetch(reinterpret_cast<const char*>(a + kPrefetch), _MM_HINT_T0);  // see kPrefetch
      _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetch), _MM_HINT_T0);
      const __m512i wq = _mm512_xor_si512(
          _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 2))),
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 2)), 1),
          flip);
      const __m512 dw = _mm512_cvtph_ps(_mm256_set_m128i(_mm_set1_epi16(static_cast<short>(bits_at(c))),
                                                         _mm_set1_epi16(static_cast<short>(bits_at(a)))));
      for (int m = 0; m < MT; ++m) {
        const __m512i xq = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q(m) + b * kBlock)));
        const __m512i corr = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.corr(m) + b * 8)));
        const __m512 s = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(corr, wq, xq));  // sum (w + 128) x - 128 x
        acc[m] = _mm512_fmadd_ps(s, _mm512_mul_ps(dw, _mm512_set1_ps(x.d(m)[b])), acc[m]);
      }
    }
    for (int m = 0; m < MT; ++m) {
      const __m256 lo = _mm512_castps512_ps256(acc[m]);
      const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[m]), 1));
      y[m * ys + r] = hsum256(lo);
      if (pair) y[m * ys + r + 1] = hsum256(hi);
    }
  }
}
#endif

// ---- Q4_0 / Q4_1 in q4_gemv's layout: one group of 16 rows, y[m * ys + 0..valid) --------------------------------
int64_t q4_block_bytes(bool has_min) { return kRows * 2 * (has_min ? 2 : 1) + kRows * kBlock / 2; }

template <int MT>
void q4_group_portable(const uint8_t* g, int64_t nb, bool has_min, const XTile& x, float* y, int64_t ys,
                       int64_t valid) {
  const int64_t bb = q4_block_bytes(has_min);
  float acc[MT][kRows] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = g + b * bb;
    const uint8_t* q = p + (has_min ? 64 : 32);
    for (int64_t r = 0; r < kRows; ++r) {
      const float dw = c10::detail::fp16_ieee_to_fp32_value(bits_at(p + 2 * r));
      const float mw = has_min ? c10::detail::fp16_ieee_to_fp32_value(bits_at(p + 32 + 2 * r)) : 0.f;
      for (int m = 0; m < MT; ++m) {
        const int8_t* xq = x.q(m) + b * kBlock;
        int32_t s = 0;
        for (int64_t c = 0; c < 4; ++c)
          for (int64_t i = 0; i < 4; ++i) {
            const uint8_t byte = q[64 * c + 4 * r + i];
            s += (byte & 0xF) * xq[8 * c + i] + (byte >> 4) * xq[8 * c + 4 + i];
          }
        if (!has_min) s -= 8 * x.sum(m)[b];
        acc[m][r] += static_cast<float>(s) * (dw * x.d(m)[b]);
        if (has_min) acc[m][r] += mw * x.s(m)[b];
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int64_t r = 0; r < valid; ++r) y[m * ys + r] = acc[m][r];
}

#ifdef PAGEDLLM_Q8A_X86
template <int MT>
PAGEDLLM_Q8A_T256 void q4_group_avx2(const uint8_t* g, int64_t nb, bool has_min, const XTile& x, float* y,
                                     int64_t ys, int64_t valid) {
  const int64_t bb = q4_block_bytes(has_min);
  const __m256i low4 = _mm256_set1_epi8(0xF), ones = _mm256_set1_epi16(1);
  __m256 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = g + b * bb;
    const uint8_t* q = p + (has_min ? 64 : 32);
    __m256i s16[MT][2];  // |.| <= 16 products of 15 * 127: int16 holds the whole block
    for (int m = 0; m < MT; ++m) s16[m][0] = s16[m][1] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * c + 32 * h));
        const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        for (int m = 0; m < MT; ++m) {
          const int32_t* xw = reinterpret_cast<const int32_t*>(x.q(m) + b * kBlock + 8 * c);
          s16[m][h] = _mm256_add_epi16(s16[m][h], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xw[0])));
          s16[m][h] = _mm256_add_epi16(s16[m][h], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xw[1])));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
      const __m256 mw = has_min ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 16 * h)))
                                : _mm256_setzero_ps();
      for (int m = 0; m < MT; ++m) {
        __m256i si = _mm256_madd_epi16(s16[m][h], ones);
        if (!has_min) si = _mm256_sub_epi32(si, _mm256_set1_epi32(8 * x.sum(m)[b]));
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), _mm256_mul_ps(dw, _mm256_set1_ps(x.d(m)[b])), acc[m][h]);
        if (has_min) acc[m][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.s(m)[b]), acc[m][h]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    float out[kRows];
    _mm256_storeu_ps(out, acc[m][0]);
    _mm256_storeu_ps(out + 8, acc[m][1]);
    for (int64_t r = 0; r < valid; ++r) y[m * ys + r] = out[r];
  }
}

template <int MT>
PAGEDLLM_Q8A_T512 void q4_group_avx512(const uint8_t* g, int64_t nb, bool has_min, const XTile& x, float* y,
                                       int64_t ys, int64_t valid) {
  const int64_t bb = q4_block_bytes(has_min);
  const __m512i low4 = _mm512_set1_epi8(0xF);
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = g + b * bb;
    const uint8_t* q = p + (has_min ? 64 : 32);
    __m512i s[MT];
    for (int m = 0; m < MT; ++m) s[m] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(q + 64 * c);  // 16 rows x 8 nibbles (weights 8c..8c+7)
      const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      for (int m = 0; m < MT; ++m) {
        const int32_t* xw = reinterpret_cast<const int32_t*>(x.q(m) + b * kBlock + 8 * c);
        s[m] = _mm512_dpbusd_epi32(s[m], lo, _mm512_set1_epi32(xw[0]));
        s[m] = _mm512_dpbusd_epi32(s[m], hi, _mm512_set1_epi32(xw[1]));
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512 mw = has_min ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)))
                              : _mm512_setzero_ps();
    for (int m = 0; m < MT; ++m) {
      const __m512i si = has_min ? s[m] : _mm512_sub_epi32(s[m], _mm512_set1_epi32(8 * x.sum(m)[b]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si), _mm512_mul_ps(dw, _mm512_set1_ps(x.d(m)[b])), acc[m]);
      if (has_min) acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.s(m)[b]), acc[m]);
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
  for (int m = 0; m < MT; ++m) _mm512_mask_storeu_ps(y + m * ys, mask, acc[m]);
}
#endif

int64_t best_isa() {
  return pagedllm_cpu::cpu_avx512_vnni() ? kAvx512 : pagedllm_cpu::cpu_avx2() ? kAvx2 : kPortable;
}

template <int MT>
void q8_rows(Isa isa, const uint8_t* w, int64_t rs, int64_t r0, int64_t r1, int64_t nb, const XTile& x, float* y,
             int64_t ys) {
#ifdef PAGEDLLM_Q8A_X86
  if (isa == kAvx512) return q8_rows_avx512<MT>(w, rs, r0, r1, nb, x, y, ys);
  if (isa == kAvx2) return q8_rows_avx2<MT>(w, rs, r0, r1, nb, x, y, ys);
#endif
  q8_rows_portable<MT>(w, rs, r0, r1, nb, x, y, ys);
}

template <int MT>
void q4_group(Isa isa, const uint8_t* g, int64_t nb, bool has_min, const XTile& x, float* y, int64_t ys,
              int64_t valid) {
#ifdef PAGEDLLM_Q8A_X86
  if (isa == kAvx512) return q4_group_avx512<MT>(g, nb, has_min, x, y, ys, valid);
  if (isa == kAvx2) return q4_group_avx2<MT>(g, nb, has_min, x, y, ys, valid);
#endif
  q4_group_portable<MT>(g, nb, has_min, x, y, ys, valid);
}

Type parse_type(const std::string& s) {
  if (s == "Q8_0") return kQ8_0;
  if (s == "Q4_0") return kQ4_0;
  TORCH_CHECK(s == "Q4_1", "q8act_gemv: weight_type must be Q8_0, Q4_0 or Q4_1, got ", s);
  return kQ4_1;
}

#define PAGEDLLM_Q8A_TILE(mt, call) \
  switch (mt) {                     \
    case 1: call(1); break;         \
    case 2: call(2); break;         \
    case 3: call(3); break;         \
    default: call(4); break;        \
  }

// x [..., K] (K a multiple of 32; reduced dtypes quantized from their fp32 value); weights: Q8_0 blocks uint8
// [N, K / 32 * 34] (rows may be strided, bytes within a row contiguous) or Q4_0 / Q4_1 in q4_gemv's layout uint8
// [ceil(N / 16), K / 32, bytes] with n its output rows: y [..., N] in x's dtype. isa: 0 portable, 1 AVX2,
// 2 AVX-512 VNNI, -1 the best.
at::Tensor q8act_gemv(const at::Tensor& x, const at::Tensor& weight, const std::string& weight_type, int64_t n,
                      int64_t isa) {
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "q8act_gemv: x must be floating point");
  const Type t = parse_type(weight_type);
  const int64_t best = best_isa();
  TORCH_CHECK(isa >= -1 && isa <= best, "q8act_gemv: isa ", isa, " is not supported by this CPU (best: ", best, ")");
  const Isa level = static_cast<Isa>(isa < 0 ? best : isa);
  const int64_t k = x.size(-1), nb = k / kBlock;
  TORCH_CHECK(k % kBlock == 0, "q8act_gemv: K = ", k, " is not a multiple of 32");
  TORCH_CHECK(weight.scalar_type() == at::kByte, "q8act_gemv: weight must be uint8 blocks");
  const bool has_min = t == kQ4_1;
  if (t == kQ8_0) {
    TORCH_CHECK(weight.dim() == 2 && weight.stride(1) == 1 && weight.size(1) == nb * kQ8Bytes,
                "q8act_gemv: Q8_0 blocks must be uint8 [N, K / 32 * 34] with contiguous rows");
    n = weight.size(0);
  } else {
    TORCH_CHECK(weight.dim() == 3 && weight.is_contiguous() && weight.size(1) == nb &&
                    weight.size(2) == q4_block_bytes(has_min) && weight.size(0) == (n + kRows - 1) / kRows,
                "q8act_gemv: packed Q4 weight does not match x's K or n");
  }
  const at::Tensor rows = x.reshape({-1, k}).to(at::kFloat).contiguous();
  const int64_t mrows = rows.size(0);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  at::Tensor y = at::empty({mrows, n}, rows.options());
  QuantX qx;
  quantize_rows(level, rows.data_ptr<float>(), mrows, k, t, qx);
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (t == kQ8_0) {
    const int64_t rs = weight.stride(0);
    at::parallel_for(0, (n + 1) / 2, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r0 = 2 * begin; r0 < std::min(n, 2 * end); r0 += kRows) {  // rows stay in L2 across x's tiles
        const int64_t r1 = std::min({n, 2 * end, r0 + kRows});
        for (int64_t m0 = 0; m0 < mrows; m0 += kTile) {
          const XTile xt{&qx, m0};
#define PAGEDLLM_Q8A_CALL(MT) q8_rows<MT>(level, wp, rs, r0, r1, nb, xt, yp + m0 * n, n)
          PAGEDLLM_Q8A_TILE(std::min(kTile, mrows - m0), PAGEDLLM_Q8A_CALL)
#undef PAGEDLLM_Q8A_CALL
        }
      }
    });
  } else {
    const int64_t groups = weight.size(0), group_bytes = nb * q4_block_bytes(has_min);
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t valid = std::min(kRows, n - g * kRows);
        for (int64_t m0 = 0; m0 < mrows; m0 += kTile) {
          const XTile xt{&qx, m0};
#define PAGEDLLM_Q8A_CALL(MT) \
  q4_group<MT>(level, wp + g * group_bytes, nb, has_min, xt, yp + m0 * n + g * kRows, n, valid)
          PAGEDLLM_Q8A_TILE(std::min(kTile, mrows - m0), PAGEDLLM_Q8A_CALL)
#undef PAGEDLLM_Q8A_CALL
        }
      }
    });
  }
  return y.view(shape).to(x.scalar_type());
}

// x's blocks as the kernel quantizes them for weight_type (Q8_0 / Q4_0: Q8_0, Q4_1: Q8_1), in ggml's natural
// order: (q int8 [M, K], d fp32 [M, K / 32] (fp16 values), s fp32 [M, K / 32] (Q8_1's fp16(d * sum q))). For tests.
std::tuple<at::Tensor, at::Tensor, at::Tensor> q8act_quantize(const at::Tensor& x, int64_t isa) {
  const int64_t best = best_isa();
  TORCH_CHECK(isa >= -1 && isa <= best, "q8act_quantize: isa ", isa, " is not supported by this CPU (best: ", best, ")");
  const int64_t k = x.size(-1);
  TORCH_CHECK(k % kBlock == 0, "q8act_quantize: K = ", k, " is not a multiple of 32");
  const at::Tensor rows = x.reshape({-1, k}).to(at::kFloat).contiguous();
  const int64_t mrows = rows.size(0), nb = k / kBlock;
  QuantX qx;
  quantize_rows(static_cast<Isa>(isa < 0 ? best : isa), rows.data_ptr<float>(), mrows, k, kQ8_0, qx);
  at::Tensor q = at::empty({mrows, k}, rows.options().dtype(at::kChar));
  at::Tensor d = at::empty({mrows, nb}, rows.options());
  at::Tensor s = at::empty({mrows, nb}, rows.options());
  std::memcpy(q.data_ptr<int8_t>(), qx.q.data(), mrows * k);
  std::memcpy(d.data_ptr<float>(), qx.d.data(), mrows * nb * sizeof(float));
  std::memcpy(s.data_ptr<float>(), qx.s.data(), mrows * nb * sizeof(float));
  return {q, d, s};
}

int64_t q8act_best_isa() { return best_isa(); }

}  // namespace

at::Tensor pagedllm_cpu::kernels::q8act_gemv(const at::Tensor& x, const at::Tensor& weight,
                                            const std::string& weight_type, int64_t n, int64_t isa) {
  return ::q8act_gemv(x, weight, weight_type, n, isa);
}

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("q8act_gemv(Tensor x, Tensor weight, str weight_type, int n=0, int isa=-1) -> Tensor");
  m.def("q8act_quantize(Tensor x, int isa=-1) -> (Tensor, Tensor, Tensor)");
  m.def("q8act_best_isa() -> int", &q8act_best_isa);
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("q8act_gemv", &q8act_gemv);
  m.impl("q8act_quantize", &q8act_quantize);
}
