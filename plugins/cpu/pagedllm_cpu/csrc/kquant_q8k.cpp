// y = x @ W.T for GGUF K-quant weights (Q4_K, Q5_K, Q6_K, the file's super-blocks read in place) with int8
// activations, as llama.cpp decodes: each row of x is quantized once per call to Q8_K (``quantize_row_q8_K_ref``:
// per 256 values a float d = max / -127 of the value of largest magnitude, int8 q = round-half-even(x / d), and the
// int16 sums of q per 16), then every super-block's dot product is exact integer arithmetic
// (``ggml_vec_dot_q{4,5,6}_K_q8_K``) scaled once by d_w * d_x in fp32. The weights stay 4-6 bits and the activations
// 8, so batch 1 reads the file's bytes with a few integer instructions per 64 weights instead of decoding them to
// fp32 (``kquant_gemv.cpp``): memory-bound rather than compute-bound. It is not exact to the fp32 reference: x is
// rounded to 8 bits per 256 values (llama.cpp's error; ``PAGEDLLM_CPU_INT8_ACT=0`` keeps the fp32 kernel).
//
// Weights are unsigned (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63 with the -32 folded into the sums: -32 * sum(sc * bsum))
// and activations signed, which is what u8 x s8 instructions multiply: AVX-512 VNNI ``vpdpbusd`` (4 products into an
// int32 lane; the sub-block scale then applied by ``vpdpwssd``, each lane's sum fitting int16), AVX-512 without VNNI
// and AVX2 ``vpmaddubsw`` + ``vpmaddwd`` by the scale (ggml's AVX2 path; pairs never saturate: 2 * 63 * 127 < 2^15),
// else portable C++. The level is chosen at run time (0 portable, 1 AVX2, 2 AVX-512, 3 AVX-512 VNNI; ``isa`` forces
// one for tests); the SIMD paths are compiled with function target attributes whatever ATen's capability was.
// Output rows are split across threads (at::parallel_for); up to 4 rows of x share one decode of a weight row.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "kernels.h"

#include "cpu_common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PAGEDLLM_Q8K_X86 1
#define PAGEDLLM_Q8K_T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define PAGEDLLM_Q8K_TVNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
#define PAGEDLLM_Q8K_T256 __attribute__((target("avx2,fma,f16c")))
#endif

namespace {

constexpr int64_t kQK = 256;  // values per super-block
constexpr int kTile = 4;      // rows of x per decode of a weight row
constexpr int64_t kGroup = 16;  // output rows per work item
constexpr int64_t kChunk = 16;  // super-blocks of x per pass of a work item's rows (beyond one tile)

using pagedllm_cpu::half_at;
using pagedllm_cpu::kquant_bytes;
using pagedllm_cpu::kQ4K;
using pagedllm_cpu::kQ5K;
using pagedllm_cpu::kQ6K;
using Type = pagedllm_cpu::KQuant;
enum Isa { kPortable = 0, kAvx2 = 1, kAvx512 = 2, kVnni = 3 };

#ifdef PAGEDLLM_Q8K_X86
// fp16 -> fp32 in one F16C instruction (the SIMD paths; ``half_at`` converts in software, ~20 instructions).
__attribute__((target("f16c"))) inline float half_f16c(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}
#endif

// One row of k values (a multiple of 256) to Q8_K: q [k], d [k / 256], bsums [k / 16] (quantize_row_q8_K_ref).
void quantize_row(const float* x, int64_t k, int8_t* q, float* d, int16_t* bsums) {
  for (int64_t b = 0; b < k / kQK; ++b) {
    int8_t* qb = q + b * kQK;
    d[b] = pagedllm_cpu::quantize_q8k_block(x + b * kQK, qb);
    for (int j = 0; j < kQK / 16; ++j) {
      int s = 0;
      for (int i = 0; i < 16; ++i) s += qb[16 * j + i];
      bsums[b * 16 + j] = static_cast<int16_t>(s);
    }
  }
}

// Q4_K / Q5_K: the 12 scale bytes as 8 six-bit scales then 8 six-bit mins (ggml's kmask shuffle).
inline void scales_mins(const uint8_t* b, uint8_t out[16]) {
  uint32_t u[4];
  std::memcpy(u, b + 4, 12);
  constexpr uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
  u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
  const uint32_t aux = u[1] & k1;
  u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
  u[2] = aux;
  u[0] &= k1;
  std::memcpy(out, u, 16);
}

// The activations of one call: rows of x quantized, and where one row's super-block starts.
struct Q8K {
  const int8_t* q;
  const float* d;
  const int16_t* bsums;
  int64_t k;
};

// ---- portable ---------------------------------------------------------------------------------------------------

void row_portable(Type t, const uint8_t* w, int64_t nsb, int64_t s0, int64_t s1, const Q8K& x, int64_t m, float* y) {
  const int8_t* q8 = x.q + m * x.k;
  const float* dx = x.d + m * nsb;
  const int16_t* bs = x.bsums + m * (x.k / 16);
  float sum = 0.f;
  for (int64_t sb = s0; sb < s1; ++sb) {
    const uint8_t* b = w + sb * kquant_bytes(t);
    const int8_t* xq = q8 + sb * kQK;
    const int16_t* xs = bs + sb * 16;
    int32_t sumi = 0;
    if (t == kQ6K) {
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      for (int n = 0; n < 2; ++n) {
        const uint8_t* ql = b + 64 * n;
        const uint8_t* qh = b + 128 + 32 * n;
        for (int j = 0; j < 4; ++j) {
          int32_t s[2] = {0, 0};
          for (int l = 0; l < 32; ++l) {
            const int q = ((ql[l + 32 * (j & 1)] >> (4 * (j >> 1))) & 0xF) | (((qh[l] >> (2 * j)) & 3) << 4);
            s[l / 16] += q * xq[128 * n + 32 * j + l];
          }
          for (int h = 0; h < 2; ++h) {
            const int i = 8 * n + 2 * j + h;
            sumi += sc[i] * (s[h] - 32 * xs[i]);
          }
        }
      }
      sum += half_at(b + 208) * dx[sb] * static_cast<float>(sumi);
      continue;
    }
    uint8_t sm[16];
    scales_mins(b, sm);
    const uint8_t* qs = b + (t == kQ5K ? 48 : 16);
    int32_t summ = 0;
    for (int i = 0; i < 8; ++i) {
      int32_t s = 0;
      for (int l = 0; l < 32; ++l) {
        int q = (qs[32 * (i / 2) + l] >> (4 * (i % 2))) & 0xF;
        if (t == kQ5K) q |= ((b[16 + l] >> i) & 1) << 4;
        s += q * xq[32 * i + l];
      }
      sumi += sm[i] * s;
      summ += sm[8 + i] * (xs[2 * i] + xs[2 * i + 1]);
    }
    sum += half_at(b) * dx[sb] * static_cast<float>(sumi) - half_at(b + 2) * dx[sb] * static_cast<float>(summ);
  }
  *y += sum;
}

#ifdef PAGEDLLM_Q8K_X86
// The super-block kPrefetch bytes ahead, into L1: at 1-4 rows of x the loop is short enough that the hardware
// prefetcher alone leaves it waiting on memory (measured, one thread, Q4_K 2048 x 8192 streamed from DRAM: 1.7 ms
// without, 1.2 with; 512-2048 bytes ahead all alike). Past the end of the blocks: a no-op (prefetches never fault).
constexpr int64_t kPrefetch = 1024;

inline void prefetch(const uint8_t* b, int64_t bytes) { pagedllm_cpu::prefetch_ahead<kPrefetch>(b, bytes); }

// ---- AVX2: 32 weights a vector, vpmaddubsw then vpmaddwd by the scale (ggml's AVX2 path) ------------------------

PAGEDLLM_Q8K_T256 inline __m256i dot32_scaled(__m256i w, const int8_t* x, __m256i scale16) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), scale16);
}

PAGEDLLM_Q8K_T256 inline float hsum256(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

template <int MT>
PAGEDLLM_Q8K_T256 void row_avx2(Type t, const uint8_t* w, int64_t nsb, int64_t s0, int64_t s1, const Q8K& x,
                                int64_t m0, float* y, int64_t ys) {
  const __m256i low4 = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1), three = _mm256_set1_epi8(3);
  const int64_t bb = kquant_bytes(t), k16 = x.k / 16;
  __m256 acc[MT], accm[MT];
  for (int m = 0; m < MT; ++m) acc[m] = accm[m] = _mm256_setzero_ps();
  for (int64_t sb = s0; sb < s1; ++sb) {
    const uint8_t* b = w + sb * bb;
    prefetch(b, bb);
    __m256i sumi[MT];
    for (int m = 0; m < MT; ++m) sumi[m] = _mm256_setzero_si256();
    if (t == kQ6K) {
      const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
      const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
      for (int n = 0; n < 2; ++n) {
        const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * n));
        const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * n + 32));
        const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * n));
        const __m256i lo[4] = {_mm256_and_si256(l0, low4), _mm256_and_si256(l1, low4),
                               _mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                               _mm256_and_si256(_mm256_srli_epi16(l1, 4), low4)};
        for (int j = 0; j < 4; ++j) {
          const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, 2 * j), three), 4);
          const __m256i q = _mm256_or_si256(lo[j], hi);
          const int i = 8 * n + 2 * j;  // scales of the two halves of these 32 weights
          const int8_t* s = reinterpret_cast<const int8_t*>(b + 192);
          const __m256i scale = _mm256_setr_m128i(_mm_set1_epi16(s[i]), _mm_set1_epi16(s[i + 1]));
          for (int m = 0; m < MT; ++m)
            sumi[m] = _mm256_add_epi32(sumi[m], dot32_scaled(q, x.q + (m0 + m) * x.k + sb * kQK + 128 * n + 32 * j,
                                                             scale));
        }
      }
      const float d = half_f16c(b + 208);
      for (int m = 0; m < MT; ++m) {
        const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bsums + (m0 + m) * k16 + 16 * sb));
        sumi[m] = _mm256_sub_epi32(sumi[m], _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5));
        acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.d[(m0 + m) * nsb + sb]), _mm256_cvtepi32_ps(sumi[m]), acc[m]);
      }
      continue;
    }
    alignas(16) uint8_t sm[16];
    scales_mins(b, sm);
    const __m128i smv = _mm_load_si128(reinterpret_cast<const __m128i*>(sm));
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(smv, smv));  // m0 m0 m1 m1 ...: one per 16
    const uint8_t* qs = b + (t == kQ5K ? 48 : 16);
    const __m256i hv =
        t == kQ5K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)) : _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
      for (int h = 0; h < 2; ++h) {
        const int i = 2 * c + h;
        __m256i q = _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, low4);
        if (t == kQ5K) q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, i), one), 4));
        const __m256i scale = _mm256_set1_epi16(sm[i]);
        for (int m = 0; m < MT; ++m)
          sumi[m] = _mm256_add_epi32(sumi[m], dot32_scaled(q, x.q + (m0 + m) * x.k + sb * kQK + 32 * i, scale));
      }
    }
    const float d = half_f16c(b), dmin = half_f16c(b + 2);
    for (int m = 0; m < MT; ++m) {
      const float dx = x.d[(m0 + m) * nsb + sb];
      const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bsums + (m0 + m) * k16 + 16 * sb));
      accm[m] = _mm256_fmadd_ps(_mm256_set1_ps(dmin * dx), _mm256_cvtepi32_ps(_mm256_madd_epi16(mins, bs)), accm[m]);
      acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sumi[m]), acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) y[m * ys] += hsum256(acc[m]) - hsum256(accm[m]);
}

// ---- AVX-512: 64 weights a vector (32-byte halves of two sub-blocks, or four 16-weight Q6_K groups) -------------
// dot64 adds, per int32 lane, scale * (4 products): vpdpbusd + vpdpwssd with VNNI (the lane's sum fits int16: at most
// 4 * 63 * 127; the scale lanes have their high 16 bits zero), vpmaddubsw + vpmaddwd + vpmulld + vpaddd without.

template <bool VNNI>
inline __m512i dot64(__m512i acc, __m512i w, const int8_t* x, __m512i scale32);

template <>
PAGEDLLM_Q8K_TVNNI inline __m512i dot64<true>(__m512i acc, __m512i w, const int8_t* x, __m512i scale32) {
  const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(x));
  return _mm512_dpwssd_epi32(acc, p, scale32);
}

template <>
PAGEDLLM_Q8K_T512 inline __m512i dot64<false>(__m512i acc, __m512i w, const int8_t* x, __m512i scale32) {
  const __m512i p = _mm512_madd_epi16(_mm512_maddubs_epi16(w, _mm512_loadu_si512(x)), _mm512_set1_epi16(1));
  const __m512i scale = _mm512_srai_epi32(_mm512_slli_epi32(scale32, 16), 16);  // Q6_K's signed scales back
  return _mm512_add_epi32(acc, _mm512_mullo_epi32(p, scale));
}

PAGEDLLM_Q8K_T512 inline float hsum256_512(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// One body for both (VNNI selects dot64's instructions); instantiated with each target attribute below.
#define PAGEDLLM_Q8K_ROW512_BODY                                                                                       \
  const __m512i low4 = _mm512_set1_epi8(0xF), three = _mm512_set1_epi8(3), b5 = _mm512_set1_epi8(0x10);                \
  const __m512i lanes8 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);                            \
  const __m512i lanes4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);                            \
  /* 16-bit shifts: the lower 32 bytes by a, the upper by b */                                                         \
  const __m512i sh04 = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(4), 1);                              \
  const __m512i sh02 = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);                              \
  const __m512i sh46 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);                              \
  const __m512i mask16 = _mm512_set1_epi32(0xFFFF);                                                                    \
  const int64_t bb = kquant_bytes(t), k16 = x.k / 16;                                                                  \
  __m512 acc[MT];                                                                                                      \
  __m256 accm[MT];                                                                                                     \
  for (int m = 0; m < MT; ++m) {                                                                                       \
    acc[m] = _mm512_setzero_ps();                                                                                      \
    accm[m] = _mm256_setzero_ps();                                                                                     \
  }                                                                                                                    \
  for (int64_t sb = s0; sb < s1; ++sb) {                                                                               \
    const uint8_t* b = w + sb * bb;                                                                                    \
    prefetch(b, bb);                                                                                                   \
    __m512i sumi[MT];                                                                                                  \
    for (int m = 0; m < MT; ++m) sumi[m] = _mm512_setzero_si512();                                                     \
    if (t == kQ6K) {                                                                                                   \
      const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));                                  \
      const __m512i sc32 = _mm512_and_si512(_mm512_cvtepi8_epi32(sc8), mask16);                                        \
      for (int n = 0; n < 2; ++n) {                                                                                    \
        const __m512i v = _mm512_loadu_si512(b + 64 * n);                                                              \
        const __m256i h256 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * n));                   \
        const __m512i hv = _mm512_broadcast_i64x4(h256);                                                               \
        for (int p = 0; p < 2; ++p) { /* low nibbles: weights 0-63 of this 128, high: 64-127 */                        \
          const __m512i lo = _mm512_and_si512(p ? _mm512_srli_epi16(v, 4) : v, low4);                                  \
          const __m512i hi = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(hv, p ? sh46 : sh02), three), 4);    \
          const __m512i idx = _mm512_add_epi32(lanes4, _mm512_set1_epi32(8 * n + 4 * p));                              \
          const __m512i scale = _mm512_permutexvar_epi32(idx, sc32);                                                   \
          const __m512i q = _mm512_or_si512(lo, hi);                                                                   \
          for (int m = 0; m < MT; ++m)                                                                                 \
            sumi[m] = dot64<VNNI>(sumi[m], q, x.q + (m0 + m) * x.k + sb * kQK + 128 * n + 64 * p, scale);              \
        }                                                                                                              \
      }                                                                                                                \
      const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);                                                                  \
      const float d = half_f16c(b + 208);                                                                              \
      for (int m = 0; m < MT; ++m) {                                                                                   \
        const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bsums + (m0 + m) * k16 + 16 * sb));   \
        const __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5);                                        \
        sumi[m] = _mm512_sub_epi32(sumi[m], _mm512_zextsi256_si512(corr));                                             \
        acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(d * x.d[(m0 + m) * nsb + sb]), _mm512_cvtepi32_ps(sumi[m]), acc[m]);   \
      }                                                                                                                \
      continue;                                                                                                        \
    }                                                                                                                  \
    alignas(16) uint8_t sm[16];                                                                                        \
    scales_mins(b, sm);                                                                                                \
    const __m128i smv = _mm_load_si128(reinterpret_cast<const __m128i*>(sm));                                          \
    const __m512i sc32 = _mm512_cvtepu8_epi32(smv);                                                                    \
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(smv, smv));                                            \
    const uint8_t* qs = b + (t == kQ5K ? 48 : 16);                                                                     \
    const __m512i hv = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));           \
    for (int c = 0; c < 4; ++c) { /* 32 bytes: low nibbles sub-block 2c (lower half), high 2c + 1 (upper half) */      \
      const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c)));     \
      __m512i q = _mm512_and_si512(_mm512_srlv_epi16(v, sh04), low4);                                                  \
      if (t == kQ5K) {                                                                                                 \
        const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << (2 * c))),                      \
                                               _mm256_set1_epi8(static_cast<char>(1 << (2 * c + 1))), 1);              \
        q = _mm512_or_si512(q, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(hv, bit), b5));                             \
      }                                                                                                                \
      const __m512i scale = _mm512_permutexvar_epi32(_mm512_add_epi32(lanes8, _mm512_set1_epi32(2 * c)), sc32);        \
      for (int m = 0; m < MT; ++m) sumi[m] = dot64<VNNI>(sumi[m], q, x.q + (m0 + m) * x.k + sb * kQK + 64 * c, scale); \
    }                                                                                                                  \
    const float d = half_f16c(b), dmin = half_f16c(b + 2);                                                             \
    for (int m = 0; m < MT; ++m) {                                                                                     \
      const float dx = x.d[(m0 + m) * nsb + sb];                                                                       \
      const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bsums + (m0 + m) * k16 + 16 * sb));     \
      accm[m] = _mm256_fmadd_ps(_mm256_set1_ps(dmin * dx), _mm256_cvtepi32_ps(_mm256_madd_epi16(mins, bs)), accm[m]);  \
      acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(d * dx), _mm512_cvtepi32_ps(sumi[m]), acc[m]);                           \
    }                                                                                                                  \
  }                                                                                                                    \
  for (int m = 0; m < MT; ++m) y[m * ys] += _mm512_reduce_add_ps(acc[m]) - hsum256_512(accm[m]);

template <int MT>
PAGEDLLM_Q8K_TVNNI void row_vnni(Type t, const uint8_t* w, int64_t nsb, int64_t s0, int64_t s1, const Q8K& x,
                                 int64_t m0, float* y, int64_t ys) {
  constexpr bool VNNI = true;
  PAGEDLLM_Q8K_ROW512_BODY
}

template <int MT>
PAGEDLLM_Q8K_T512 void row_avx512(Type t, const uint8_t* w, int64_t nsb, int64_t s0, int64_t s1, const Q8K& x,
                                  int64_t m0, float* y, int64_t ys) {
  constexpr bool VNNI = false;
  PAGEDLLM_Q8K_ROW512_BODY
}
#undef PAGEDLLM_Q8K_ROW512_BODY
#endif

// y[m * ys] += the dot products of rows m0 .. m0 + mt of x with one weight row over super-blocks s0 .. s1.
template <int MT>
void rows(Isa isa, Type t, const uint8_t* w, int64_t nsb, int64_t s0, int64_t s1, const Q8K& x, int64_t m0, float* y,
          int64_t ys) {
#ifdef PAGEDLLM_Q8K_X86
  if (isa == kVnni) return row_vnni<MT>(t, w, nsb, s0, s1, x, m0, y, ys);
  if (isa == kAvx512) return row_avx512<MT>(t, w, nsb, s0, s1, x, m0, y, ys);
  if (isa == kAvx2) return row_avx2<MT>(t, w, nsb, s0, s1, x, m0, y, ys);
#endif
  for (int m = 0; m < MT; ++m) row_portable(t, w, nsb, s0, s1, x, m0 + m, y + m * ys);
}

void run_rows(int mt, Isa isa, Type t, const uint8_t* w, int64_t nsb, int64_t s0, int64_t s1, const Q8K& x,
              int64_t m0, float* y, int64_t ys) {
  switch (mt) {
    case 1: return rows<1>(isa, t, w, nsb, s0, s1, x, m0, y, ys);
    case 2: return rows<2>(isa, t, w, nsb, s0, s1, x, m0, y, ys);
    case 3: return rows<3>(isa, t, w, nsb, s0, s1, x, m0, y, ys);
    default: return rows<4>(isa, t, w, nsb, s0, s1, x, m0, y, ys);
  }
}

int64_t best_isa() {
  using namespace pagedllm_cpu;
  return cpu_avx512_vnni() ? kVnni : cpu_avx512() ? kAvx512 : cpu_avx2() ? kAvx2 : kPortable;
}

// x [..., K] (K a multiple of 256, any float dtype) as Q8_K: q int8 [M, K], d fp32 [M, K / 256], bsums int16
// [M, K / 16] with M the rows of x (exposed for tests: the exact activations the dot products see).
std::tuple<at::Tensor, at::Tensor, at::Tensor> kquant_q8k_quantize(const at::Tensor& x) {
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "kquant_q8k_quantize: x must be floating point");
  const int64_t k = x.size(-1);
  TORCH_CHECK(k % kQK == 0, "kquant_q8k_quantize: K = ", k, " is not a multiple of 256");
  const at::Tensor rows = x.reshape({-1, k}).to(at::kFloat).contiguous();
  const int64_t m = rows.size(0);
  at::Tensor q = at::empty({m, k}, rows.options().dtype(at::kChar));
  at::Tensor d = at::empty({m, k / kQK}, rows.options());
  at::Tensor bs = at::empty({m, k / 16}, rows.options().dtype(at::kShort));
  const float* xp = rows.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  int16_t* bp = bs.data_ptr<int16_t>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      quantize_row(xp + i * k, k, qp + i * k, dp + i * (k / kQK), bp + i * (k / 16));
  });
  return {q, d, bs};
}

// x [..., K] (reduced dtypes read as fp32), blocks uint8 [N, K / 256 * bytes] (rows may be strided, bytes within a
// row contiguous): y [..., N] in x's dtype. isa: 0 portable, 1 AVX2, 2 AVX-512, 3 AVX-512 VNNI, -1 the best.
at::Tensor kquant_q8k_gemv(const at::Tensor& x, const at::Tensor& blocks, const std::string& weight_type,
                           int64_t isa) {
  const Type t = pagedllm_cpu::parse_kquant(weight_type, "kquant_q8k_gemv");
  const int64_t best = best_isa();
  TORCH_CHECK(isa >= -1 && isa <= best, "kquant_q8k_gemv: isa ", isa, " is not supported by this CPU (best: ", best,
              ")");
  const Isa level = static_cast<Isa>(isa < 0 ? best : isa);
  const int64_t k = x.size(-1), nsb = k / kQK, bb = kquant_bytes(t);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.stride(1) == 1 && k % kQK == 0 &&
                  blocks.size(1) == nsb * bb,
              "kquant_q8k_gemv: blocks must be uint8 [N, K / 256 * ", bb, "] with contiguous rows for K = ", k);
  auto [q, d, bs] = kquant_q8k_quantize(x);
  const int64_t mrows = q.size(0), n = blocks.size(0), row_stride = blocks.stride(0);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  at::Tensor y = at::zeros({mrows, n}, d.options());
  const Q8K xq{q.data_ptr<int8_t>(), d.data_ptr<float>(), bs.data_ptr<int16_t>(), k};
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // Work items of kGroup output rows. Beyond one tile of x, inputs in chunks of kChunk super-blocks: a chunk of x
  // (4 KB a row) stays in L1 while the item's rows pass over it, instead of every output row reading all of x (8 rows
  // of K = 8192: 64 KB). One tile reads whole rows: the weights stream in file order (the prefetcher's best case).
  const int64_t chunk = mrows <= kTile ? nsb : kChunk;
  at::parallel_for(0, (n + kGroup - 1) / kGroup, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t s0 = 0; s0 < nsb; s0 += chunk) {
        const int64_t s1 = std::min(nsb, s0 + chunk);
        for (int64_t r = g * kGroup; r < std::min(n, (g + 1) * kGroup); ++r)
          for (int64_t m0 = 0; m0 < mrows; m0 += kTile)
            run_rows(static_cast<int>(std::min<int64_t>(kTile, mrows - m0)), level, t, wp + r * row_stride, nsb, s0,
                     s1, xq, m0, yp + m0 * n + r, n);
      }
  });
  return y.view(shape).to(x.scalar_type());
}

int64_t kquant_q8k_best_isa() { return best_isa(); }

}  // namespace

at::Tensor pagedllm_cpu::kernels::kquant_q8k_gemv(const at::Tensor& x, const at::Tensor& blocks,
                                                 const std::string& weight_type, int64_t isa) {
  return ::kquant_q8k_gemv(x, blocks, weight_type, isa);
}

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("kquant_q8k_gemv(Tensor x, Tensor blocks, str weight_type, int isa=-1) -> Tensor");
  m.def("kquant_q8k_quantize(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("kquant_q8k_best_isa() -> int", &kquant_q8k_best_isa);
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("kquant_q8k_gemv", &kquant_q8k_gemv);
  m.impl("kquant_q8k_quantize", &kquant_q8k_quantize);
}
