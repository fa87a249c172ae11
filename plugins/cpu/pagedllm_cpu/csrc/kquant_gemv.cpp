// y = x @ W.T for fp32 x straight from GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) in the file's row layout, no repack:
// what Q4_K_M / Q5_K_M files are made of. fp32 activations and accumulation, so a layer matches core's reference
// (``gguf.quants`` dequantization, fp32 matmul) up to summation order: each weight is decoded with the reference's
// own operations (``(d * sc) * q - dmin * m`` in fp32, never fused), not with int8 activations.
//
// Super-blocks of 256 weights (ggml): Q4_K 144 bytes (d, dmin fp16; 12 bytes of 8 six-bit scale/min pairs; 128 bytes
// of nibbles), Q5_K 176 (the same plus 32 bytes of fifth bits), Q6_K 210 (128 bytes of low nibbles, 64 of two high
// bits, 16 int8 scales of 16 weights each, d fp16).
//
// Per work item of 16 output rows and chunk of 512 inputs, the rows are decoded to fp32 in a 32 KB scratch (stays
// in L1/L2) with SIMD (nibbles widened to int32 lanes, masked, converted, scaled), then a register-blocked micro
// kernel (4 rows x up to 6 rows of x, vector partial sums kept per (row of x, output row) across chunks) runs the
// dot products over the chunk: the weights are decoded once per 64 rows of x, so batch 1 streams the file's bytes
// and a batch of 64 costs the fp32 GEMM plus one decode. Rows of x in blocks of 64 bound the partial sums.
//
// The SIMD level is chosen at run time from the CPU (``__builtin_cpu_supports``): AVX-512 (F/BW/VL/DQ), AVX2 + FMA
// + F16C, else portable C++; the AVX paths are compiled with function target attributes, so every library has all
// three whatever ATen's capability was at build time. ``isa`` (-1: best) forces a level for tests and comparisons.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_common.h"
#include "kernels.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PAGEDLLM_KQ_X86 1
#define PAGEDLLM_T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define PAGEDLLM_T256 __attribute__((target("avx2,fma,f16c")))
#endif

namespace {

constexpr int64_t kQK = 256;   // weights per super-block
constexpr int64_t kRows = 16;  // output rows per work item
constexpr int64_t kRW = 4;     // output rows per micro-kernel call
constexpr int64_t kKC = 512;   // inputs per chunk (a multiple of kQK)
constexpr int64_t kMB = 64;    // rows of x per block
constexpr int64_t kV = 16;     // floats per partial sum (the AVX-512 width; narrower paths use a prefix)

using pagedllm_cpu::half_at;
using pagedllm_cpu::kquant_bytes;
using pagedllm_cpu::kQ4K;
using pagedllm_cpu::kQ5K;
using pagedllm_cpu::kQ6K;
using Type = pagedllm_cpu::KQuant;
enum Isa { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

// Q4_K / Q5_K: the 8 sub-block scales (d * sc) and mins (dmin * m) of a super-block (ggml's get_scale_min_k4).
inline void scales_k4(const uint8_t* b, float* dl, float* ml) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* s = b + 4;
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    if (j < 4) {
      sc = s[j] & 63;
      m = s[j + 4] & 63;
    } else {
      sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
      m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    dl[j] = d * static_cast<float>(sc);  // each product rounded to fp32, as the reference does
    ml[j] = dmin * static_cast<float>(m);
  }
}

// Q6_K: the 16 scales d * sc of a super-block.
inline void scales_q6(const uint8_t* b, float* dl) {
  const float d = half_at(b + 208);
  const int8_t* s = reinterpret_cast<const int8_t*>(b + 192);
  for (int j = 0; j < 16; ++j) dl[j] = d * static_cast<float>(s[j]);
}

// ---- decode one super-block to 256 floats -------------------------------------------------------------------------

void decode_portable(Type t, const uint8_t* b, float* out) {
  if (t == kQ6K) {
    float dl[16];
    scales_q6(b, dl);
    for (int n = 0; n < 2; ++n) {
      const uint8_t* ql = b + 64 * n;
      const uint8_t* qh = b + 128 + 32 * n;
      for (int j = 0; j < 4; ++j)
        for (int l = 0; l < 32; ++l) {
          const int lo = (ql[l + 32 * (j & 1)] >> (4 * (j >> 1))) & 0xF;
          const int q = (lo | (((qh[l] >> (2 * j)) & 3) << 4)) - 32;
          out[128 * n + 32 * j + l] = dl[8 * n + 2 * j + l / 16] * static_cast<float>(q);
        }
    }
    return;
  }
  float dl[8], ml[8];
  scales_k4(b, dl, ml);
  const uint8_t* qs = b + (t == kQ5K ? 48 : 16);
  const uint8_t* qh = b + 16;
  for (int i = 0; i < 8; ++i)
    for (int l = 0; l < 32; ++l) {
      int q = (qs[32 * (i / 2) + l] >> (4 * (i % 2))) & 0xF;
      if (t == kQ5K) q |= ((qh[l] >> i) & 1) << 4;
      const float p = dl[i] * static_cast<float>(q);
      out[32 * i + l] = p - ml[i];
    }
}

#ifdef PAGEDLLM_KQ_X86
// Q6_K: the weights 128 n + 32 j + 16 h + (0..15) of a super-block (j = 0..3) as fp32, w[j] = (d * sc) * q: the
// integer decode the fp32 and the bf16 decoders share (they differ only in the store).
PAGEDLLM_T512 inline void decode_q6_avx512(const uint8_t* b, const float* dl, int n, int h, __m512 w[4]) {
  const __m512i low4 = _mm512_set1_epi32(0xF), three = _mm512_set1_epi32(3), bias = _mm512_set1_epi32(32);
  const uint8_t* ql = b + 64 * n + 16 * h;
  const __m512i l0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ql)));
  const __m512i l1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ql + 32)));
  const __m512i hv =
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 128 + 32 * n + 16 * h)));
  const __m512i lo[4] = {_mm512_and_si512(l0, low4), _mm512_and_si512(l1, low4), _mm512_srli_epi32(l0, 4),
                         _mm512_srli_epi32(l1, 4)};
  for (int j = 0; j < 4; ++j) {
    const __m512i hi = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hv, 2 * j), three), 4);
    const __m512 q = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_or_si512(lo[j], hi), bias));
    w[j] = _mm512_mul_ps(_mm512_set1_ps(dl[8 * n + 2 * j + h]), q);
  }
}

PAGEDLLM_T512 void decode_avx512(Type t, const uint8_t* b, float* out) {
  const __m512i low4 = _mm512_set1_epi32(0xF);
  if (t == kQ6K) {
    float dl[16];
    scales_q6(b, dl);
    for (int n = 0; n < 2; ++n)
      for (int h = 0; h < 2; ++h) {
        __m512 w[4];
        decode_q6_avx512(b, dl, n, h, w);
        for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + 128 * n + 32 * j + 16 * h, w[j]);
      }
    return;
  }
  float dl[8], ml[8];
  scales_k4(b, dl, ml);
  const uint8_t* qs = b + (t == kQ5K ? 48 : 16);
  const __m512i one = _mm512_set1_epi32(1);
  for (int h = 0; h < 2; ++h) {
    const __m512i hv = t == kQ5K
                           ? _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 + 16 * h)))
                           : _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 32 * c + 16 * h)));
      for (int s = 0; s < 2; ++s) {
        const int i = 2 * c + s;
        __m512i q = _mm512_and_si512(s ? _mm512_srli_epi32(v, 4) : v, low4);
        if (t == kQ5K) q = _mm512_or_si512(q, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hv, i), one), 4));
        const __m512 p = _mm512_mul_ps(_mm512_set1_ps(dl[i]), _mm512_cvtepi32_ps(q));
        _mm512_storeu_ps(out + 32 * i + 16 * h, _mm512_sub_ps(p, _mm512_set1_ps(ml[i])));
      }
    }
  }
}

// Eight bytes widened to int32 lanes. A function of its own, not a lambda: a lambda does not inherit its enclosing
// function's target attribute, so where the file is built without -mavx2 (the portable build) its intrinsic would
// not inline.
PAGEDLLM_T256 inline __m256i load8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

PAGEDLLM_T256 void decode_avx2(Type t, const uint8_t* b, float* out) {
  const __m256i low4 = _mm256_set1_epi32(0xF);
  if (t == kQ6K) {
    float dl[16];
    scales_q6(b, dl);
    const __m256i three = _mm256_set1_epi32(3), bias = _mm256_set1_epi32(32);
    for (int n = 0; n < 2; ++n)
      for (int h = 0; h < 4; ++h) {  // quarters of 8 of the 32 positions l
        const uint8_t* ql = b + 64 * n + 8 * h;
        const __m256i l0 = load8(ql), l1 = load8(ql + 32), hv = load8(b + 128 + 32 * n + 8 * h);
        const __m256i lo[4] = {_mm256_and_si256(l0, low4), _mm256_and_si256(l1, low4), _mm256_srli_epi32(l0, 4),
                               _mm256_srli_epi32(l1, 4)};
        for (int j = 0; j < 4; ++j) {
          const __m256i hi = _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hv, 2 * j), three), 4);
          const __m256 q = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(lo[j], hi), bias));
          _mm256_storeu_ps(out + 128 * n + 32 * j + 8 * h, _mm256_mul_ps(_mm256_set1_ps(dl[8 * n + 2 * j + h / 2]), q));
        }
      }
    return;
  }
  float dl[8], ml[8];
  scales_k4(b, dl, ml);
  const uint8_t* qs = b + (t == kQ5K ? 48 : 16);
  const __m256i one = _mm256_set1_epi32(1);
  for (int h = 0; h < 4; ++h) {
    const __m256i hv = t == kQ5K ? load8(b + 16 + 8 * h) : _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i v = load8(qs + 32 * c + 8 * h);
      for (int s = 0; s < 2; ++s) {
        const int i = 2 * c + s;
        __m256i q = _mm256_and_si256(s ? _mm256_srli_epi32(v, 4) : v, low4);
        if (t == kQ5K) q = _mm256_or_si256(q, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hv, i), one), 4));
        const __m256 p = _mm256_mul_ps(_mm256_set1_ps(dl[i]), _mm256_cvtepi32_ps(q));
        _mm256_storeu_ps(out + 32 * i + 8 * h, _mm256_sub_ps(p, _mm256_set1_ps(ml[i])));
      }
    }
  }
}
#endif

// ---- few rows of x on AVX-512: the super-blocks decoded in registers, fused with the dot products --------------
// A 64-byte load of nibbles holds, per 32-bit lane j, 8 nibbles p of 8 different weights; shifting by 4p and a
// vpermps on the table 0..15 (0..31 with Q5_K's fifth bit merged by one vpternlogd, through vpermt2ps) turns nibble
// p of every lane into 16 floats in one or two instructions. The activations are permuted once per call (``xperm``)
// so that the 16 inputs those weights meet are one contiguous vector. Per sub-block the sum of q * x is scaled once
// (a per-lane scale vector, each half of the lanes its own sub-block); the mins are subtracted as dmin * m * sum(x)
// per sub-block of 32. The weights are the reference's, their products summed in another order (fp32 tolerance).
#ifdef PAGEDLLM_KQ_X86
// Input index within a 128-weight unit of lane j's nibble p. Q4_K / Q5_K: bytes of two 32-byte chunks, low nibbles
// weights 0-31 of their 64, high nibbles 32-63; Q6_K: 64 bytes of ql, low nibbles weights 0-63, high 64-127.
inline int64_t perm_index(Type t, int p, int j) {
  return t == kQ6K ? 64 * (p % 2) + 4 * j + p / 2 : 64 * (j / 8) + 32 * (p % 2) + 4 * (j % 8) + p / 2;
}

// Q4_K / Q5_K: the 8 scales and mins as fp32 vectors (ggml's kmask shuffle of the 12 scale bytes).
PAGEDLLM_T512 inline void scales_k4_vec(const uint8_t* b, __m256* dl, __m256* ml) {
  uint32_t u[4];
  std::memcpy(u, b + 4, 12);
  constexpr uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
  u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
  const uint32_t aux = u[1] & k1;
  u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
  u[2] = aux;
  u[0] &= k1;
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
  const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
  *dl = _mm256_mul_ps(_mm256_set1_ps(half_at(b)), sc);
  *ml = _mm256_mul_ps(_mm256_set1_ps(half_at(b + 2)), mn);
}

// Each super-block's bytes this far ahead are prefetched into L1: at 1-4 rows of x the hardware prefetcher alone
// leaves the loop waiting on DRAM (2 threads, 2048 x 8192 matrices streamed from 1.1 GB, Xeon with AMX: Q4_K 11.5 ->
// 15.5 / 17.8 / 18.0 GB/s at 1 / 2 / 3 KB ahead, Q6_K 10.9 -> 16.1). Past the end: a no-op (prefetches never fault).
constexpr int64_t kFusedPrefetch = 2048;

// One output row (its nsb super-blocks at w) for MT rows of permuted x (stride xs) and their sub-block sums
// (xsum, stride ss): y[m * ys].
template <int MT>
PAGEDLLM_T512 void row_fused_avx512(Type t, const uint8_t* w, int64_t nsb, int64_t bb, const float* x, int64_t xs,
                                    const float* xsum, int64_t ss, float* y, int64_t ys) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 iota16 = _mm512_add_ps(iota, _mm512_set1_ps(16.f));
  const __m512i low4 = _mm512_set1_epi32(0xF), low6 = _mm512_set1_epi32(0x3F), b32 = _mm512_set1_epi32(32);
  const __m512i upper2 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
  __m512 acc[MT];
  __m256 macc[MT];
  for (int m = 0; m < MT; ++m) {
    acc[m] = _mm512_setzero_ps();
    macc[m] = _mm256_setzero_ps();
  }
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* b = w + sb * bb;
    const float* xb = x + sb * kQK;
    pagedllm_cpu::prefetch_ahead<kFusedPrefetch>(b, bb);  // see kFusedPrefetch
    if (t == kQ6K) {
      __m256 dl8[2];
      {
        const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
        const __m256 d = _mm256_set1_ps(half_at(b + 208));
        dl8[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8)));
        dl8[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8))));
      }
      for (int n = 0; n < 2; ++n) {
        const __m512i v = _mm512_loadu_si512(b + 64 * n);
        const __m512i hv = _mm512_srlv_epi32(
            _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * n))), upper2);
        __m512 s[MT][2];
        for (int m = 0; m < MT; ++m) s[m][0] = s[m][1] = _mm512_setzero_ps();
#define PAGEDLLM_KQ6_STEP(P)                                                                                   \
  {                                                                                                            \
    constexpr int sh = 8 * ((P) / 2) + 4 * ((P) % 2) - 4;                                                      \
    const __m512i h = sh < 0 ? _mm512_slli_epi32(hv, -sh) : _mm512_srli_epi32(hv, sh);                        \
    const __m512i q = _mm512_and_si512(_mm512_ternarylogic_epi32(_mm512_srli_epi32(v, 4 * (P)), h, low4, 0xE4), \
                                       low6);                                                                  \
    const __m512 qf = _mm512_cvtepi32_ps(_mm512_sub_epi32(q, b32));                                           \
    for (int m = 0; m < MT; ++m)                                                                               \
      s[m][(P) % 2] = _mm512_fmadd_ps(qf, _mm512_loadu_ps(xb + m * xs + 128 * n + 16 * (P)), s[m][(P) % 2]);   \
  }
        PAGEDLLM_KQ6_STEP(0) PAGEDLLM_KQ6_STEP(1) PAGEDLLM_KQ6_STEP(2) PAGEDLLM_KQ6_STEP(3)
        PAGEDLLM_KQ6_STEP(4) PAGEDLLM_KQ6_STEP(5) PAGEDLLM_KQ6_STEP(6) PAGEDLLM_KQ6_STEP(7)
#undef PAGEDLLM_KQ6_STEP
        const __m512 dl = _mm512_castps256_ps512(dl8[n]);
        for (int par = 0; par < 2; ++par) {  // lane j's scale: 4 par + j / 4 of this half's 8
          const __m512i idx = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                               _mm512_set1_epi32(4 * par));
          const __m512 dv = _mm512_permutexvar_ps(idx, dl);
          for (int m = 0; m < MT; ++m) acc[m] = _mm512_fmadd_ps(s[m][par], dv, acc[m]);
        }
      }
      continue;
    }
    __m256 dl8, ml8;
    scales_k4_vec(b, &dl8, &ml8);
    for (int m = 0; m < MT; ++m) macc[m] = _mm256_fmadd_ps(ml8, _mm256_loadu_ps(xsum + m * ss + 8 * sb), macc[m]);
    const __m512 dl = _mm512_castps256_ps512(dl8);
    const uint8_t* qs = b + (t == kQ5K ? 48 : 16);
    __m512i hv = _mm512_setzero_si512();
    if (t == kQ5K)
      hv = _mm512_srlv_epi32(_mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16))),
                             upper2);
    for (int cp = 0; cp < 2; ++cp) {
      const __m512i v = _mm512_loadu_si512(qs + 64 * cp);
      const __m512i hc = _mm512_srli_epi32(hv, 4 * cp);
      __m512 s[MT][2];
      for (int m = 0; m < MT; ++m) s[m][0] = s[m][1] = _mm512_setzero_ps();
#define PAGEDLLM_KQ4_STEP(P)                                                                                   \
  {                                                                                                            \
    const __m512i nib = _mm512_srli_epi32(v, 4 * (P));                                                         \
    __m512 qf;                                                                                                 \
    if (t == kQ5K) {                                                                                           \
      constexpr int sh = 8 * ((P) / 2) + ((P) % 2) - 4;                                                        \
      const __m512i h = sh < 0 ? _mm512_slli_epi32(hc, -sh) : _mm512_srli_epi32(hc, sh);                      \
      qf = _mm512_permutex2var_ps(iota, _mm512_ternarylogic_epi32(nib, h, low4, 0xE4), iota16);                \
    } else {                                                                                                   \
      qf = _mm512_permutexvar_ps(nib, iota);                                                                   \
    }                                                                                                          \
    for (int m = 0; m < MT; ++m)                                                                               \
      s[m][(P) % 2] = _mm512_fmadd_ps(qf, _mm512_loadu_ps(xb + m * xs + 128 * cp + 16 * (P)), s[m][(P) % 2]);  \
  }
      PAGEDLLM_KQ4_STEP(0) PAGEDLLM_KQ4_STEP(1) PAGEDLLM_KQ4_STEP(2) PAGEDLLM_KQ4_STEP(3)
      PAGEDLLM_KQ4_STEP(4) PAGEDLLM_KQ4_STEP(5) PAGEDLLM_KQ4_STEP(6) PAGEDLLM_KQ4_STEP(7)
#undef PAGEDLLM_KQ4_STEP
      for (int par = 0; par < 2; ++par) {  // lanes 0-7: sub-block 4 cp + par, lanes 8-15: 4 cp + 2 + par
        const int lo = 4 * cp + par;
        const __m512 dv = _mm512_permutexvar_ps(
            _mm512_setr_epi32(lo, lo, lo, lo, lo, lo, lo, lo, lo + 2, lo + 2, lo + 2, lo + 2, lo + 2, lo + 2, lo + 2,
                              lo + 2),
            dl);
        for (int m = 0; m < MT; ++m) acc[m] = _mm512_fmadd_ps(s[m][par], dv, acc[m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(macc[m]), _mm256_extractf128_ps(macc[m], 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    y[m * ys] = _mm512_reduce_add_ps(acc[m]) - _mm_cvtss_f32(h);
  }
}

void run_fused_avx512(int mt, Type t, const uint8_t* w, int64_t nsb, int64_t bb, const float* x, int64_t xs,
                      const float* xsum, int64_t ss, float* y, int64_t ys) {
  switch (mt) {
    case 1: return row_fused_avx512<1>(t, w, nsb, bb, x, xs, xsum, ss, y, ys);
    case 2: return row_fused_avx512<2>(t, w, nsb, bb, x, xs, xsum, ss, y, ys);
    case 3: return row_fused_avx512<3>(t, w, nsb, bb, x, xs, xsum, ss, y, ys);
    default: return row_fused_avx512<4>(t, w, nsb, bb, x, xs, xsum, ss, y, ys);
  }
}
#endif

constexpr int64_t kFusedRows = 8;  // up to this many rows of x take the fused path (tiles of 4)

// y [mrows, n] of the fused path: x permuted once (and its sub-block sums), then rows split across threads.
void fused_gemv(Type t, const float* xp, int64_t mrows, int64_t k, const uint8_t* wp, int64_t row_stride, int64_t n,
                float* yp) {
#ifdef PAGEDLLM_KQ_X86
  std::vector<float> xperm(mrows * k), xsum(mrows * (k / 32));
  for (int64_t m = 0; m < mrows; ++m)
    for (int64_t u = 0; u < k; u += 128)
      for (int p = 0; p < 8; ++p)
        for (int j = 0; j < 16; ++j) xperm[m * k + u + 16 * p + j] = xp[m * k + u + perm_index(t, p, j)];
  for (int64_t i = 0; i < mrows * (k / 32); ++i) {
    float s = 0.f;
    for (int64_t j = 0; j < 32; ++j) s += xp[i * 32 + j];
    xsum[i] = s;
  }
  const int64_t nsb = k / kQK, bb = kquant_bytes(t);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < mrows; m0 += 4) {
      const int mt = static_cast<int>(std::min<int64_t>(4, mrows - m0));
      for (int64_t r = begin; r < end; ++r)
        run_fused_avx512(mt, t, wp + r * row_stride, nsb, bb, xperm.data() + m0 * k, k, xsum.data() + m0 * (k / 32),
                         k / 32, yp + m0 * n + r, n);
    }
  });
#endif
}

// ---- micro kernels: acc[m][r][0..V) += w[r][k..k+V) * x[m][k..k+V) over a chunk ----------------------------------
// w: kRW rows of the scratch (row stride kKC); x: MT rows (stride xs) at the chunk; acc: [MT][kRW][kV].

template <int MT>
void micro_portable(const float* w, int64_t kc, const float* x, int64_t xs, float* acc) {
  for (int m = 0; m < MT; ++m)
    for (int64_t r = 0; r < kRW; ++r) {
      float* a = acc + (m * kRW + r) * kV;
      const float* wr = w + r * kKC;
      const float* xm = x + m * xs;
      for (int64_t k = 0; k < kc; k += 8)
        for (int v = 0; v < 8; ++v) a[v] += wr[k + v] * xm[k + v];
    }
}

#ifdef PAGEDLLM_KQ_X86
template <int MT>
PAGEDLLM_T512 void micro_avx512(const float* w, int64_t kc, const float* x, int64_t xs, float* acc) {
  __m512 a[MT][kRW];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < kRW; ++r) a[m][r] = _mm512_loadu_ps(acc + (m * kRW + r) * kV);
  for (int64_t k = 0; k < kc; k += 16) {
    __m512 wv[kRW];
    for (int r = 0; r < kRW; ++r) wv[r] = _mm512_loadu_ps(w + r * kKC + k);
    for (int m = 0; m < MT; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * xs + k);
      for (int r = 0; r < kRW; ++r) a[m][r] = _mm512_fmadd_ps(wv[r], xv, a[m][r]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < kRW; ++r) _mm512_storeu_ps(acc + (m * kRW + r) * kV, a[m][r]);
}

template <int MT>
PAGEDLLM_T256 void micro_avx2(const float* w, int64_t kc, const float* x, int64_t xs, float* acc) {
  __m256 a[MT][kRW];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < kRW; ++r) a[m][r] = _mm256_loadu_ps(acc + (m * kRW + r) * kV);
  for (int64_t k = 0; k < kc; k += 8) {
    __m256 wv[kRW];
    for (int r = 0; r < kRW; ++r) wv[r] = _mm256_loadu_ps(w + r * kKC + k);
    for (int m = 0; m < MT; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * xs + k);
      for (int r = 0; r < kRW; ++r) a[m][r] = _mm256_fmadd_ps(wv[r], xv, a[m][r]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < kRW; ++r) _mm256_storeu_ps(acc + (m * kRW + r) * kV, a[m][r]);
}
#endif

// Rows of x per micro-kernel call and its dispatch, per level (AVX-512: 24 accumulators of 32 registers).
int tile_of(Isa isa) { return isa == kAvx512 ? 6 : isa == kAvx2 ? 2 : 4; }

void micro(Isa isa, int mt, const float* w, int64_t kc, const float* x, int64_t xs, float* acc) {
#ifdef PAGEDLLM_KQ_X86
  if (isa == kAvx512) {
    switch (mt) {
      case 1: return micro_avx512<1>(w, kc, x, xs, acc);
      case 2: return micro_avx512<2>(w, kc, x, xs, acc);
      case 3: return micro_avx512<3>(w, kc, x, xs, acc);
      case 4: return micro_avx512<4>(w, kc, x, xs, acc);
      case 5: return micro_avx512<5>(w, kc, x, xs, acc);
      default: return micro_avx512<6>(w, kc, x, xs, acc);
    }
  }
  if (isa == kAvx2) return mt == 1 ? micro_avx2<1>(w, kc, x, xs, acc) : micro_avx2<2>(w, kc, x, xs, acc);
#endif
  switch (mt) {
    case 1: return micro_portable<1>(w, kc, x, xs, acc);
    case 2: return micro_portable<2>(w, kc, x, xs, acc);
    case 3: return micro_portable<3>(w, kc, x, xs, acc);
    default: return micro_portable<4>(w, kc, x, xs, acc);
  }
}

void decode(Isa isa, Type t, const uint8_t* b, float* out) {
#ifdef PAGEDLLM_KQ_X86
  if (isa == kAvx512) return decode_avx512(t, b, out);
  if (isa == kAvx2) return decode_avx2(t, b, out);
#endif
  decode_portable(t, b, out);
}

int64_t best_isa() { return pagedllm_cpu::cpu_avx512() ? kAvx512 : pagedllm_cpu::cpu_avx2() ? kAvx2 : kPortable; }

// x [..., K] (K a multiple of 256; reduced dtypes computed in fp32), blocks uint8 [N, K / 256 * bytes] (rows may be
// strided, bytes within a row contiguous): y [..., N] in x's dtype. isa: 0 portable, 1 AVX2, 2 AVX-512, -1 the best.
at::Tensor kquant_gemv(const at::Tensor& x, const at::Tensor& blocks, const std::string& weight_type, int64_t isa) {
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "kquant_gemv: x must be floating point");
  const Type t = pagedllm_cpu::parse_kquant(weight_type, "kquant_gemv");
  const int64_t best = best_isa();
  TORCH_CHECK(isa >= -1 && isa <= best, "kquant_gemv: isa ", isa, " is not supported by this CPU (best: ", best, ")");
  const Isa level = static_cast<Isa>(isa < 0 ? best : isa);
  const int64_t k = x.size(-1), nsb = k / kQK, bb = kquant_bytes(t);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.stride(1) == 1 && k % kQK == 0 &&
                  blocks.size(1) == nsb * bb,
              "kquant_gemv: blocks must be uint8 [N, K / 256 * ", bb, "] with contiguous rows for K = ", k);
  const int64_t n = blocks.size(0), row_stride = blocks.stride(0);
  const at::Tensor rows = x.reshape({-1, k}).to(at::kFloat).contiguous();
  const int64_t mrows = rows.size(0);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  at::Tensor y = at::empty({mrows, n}, rows.options());
  const float* xp = rows.data_ptr<float>();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (level == kAvx512 && mrows <= kFusedRows) {
    fused_gemv(t, xp, mrows, k, wp, row_stride, n, yp);
    return y.view(shape).to(x.scalar_type());
  }
  const int64_t items = (n + kRows - 1) / kRows, mt_max = tile_of(level);
  const int64_t width = level == kAvx512 ? 16 : 8;  // lanes of the partial sums in use
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(kRows * kKC, 0.f);
    std::vector<float> acc(std::min(kMB, mrows) * kRows * kV);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t n0 = it * kRows, valid = std::min(kRows, n - n0);
      if (valid < kRows) std::fill(scratch.begin(), scratch.end(), 0.f);  // missing rows: zero weights
      for (int64_t m0 = 0; m0 < mrows; m0 += kMB) {
        const int64_t mb = std::min(kMB, mrows - m0);
        std::fill(acc.begin(), acc.begin() + mb * kRows * kV, 0.f);
        for (int64_t k0 = 0; k0 < k; k0 += kKC) {
          const int64_t kc = std::min(kKC, k - k0);
          for (int64_t r = 0; r < valid; ++r)
            for (int64_t s = 0; s < kc / kQK; ++s)
              decode(level, t, wp + (n0 + r) * row_stride + (k0 / kQK + s) * bb, scratch.data() + r * kKC + s * kQK);
          for (int64_t g = 0; g < kRows; g += kRW) {
            if (g >= valid) break;
            for (int64_t m = 0; m < mb; m += mt_max) {
              const int mt = static_cast<int>(std::min(mt_max, mb - m));
              // acc of this (row group, first row of x): [mt][kRW][kV] inside [mb][kRows / kRW][kRW][kV]
              micro(level, mt, scratch.data() + g * kKC, kc, xp + (m0 + m) * k + k0, k,
                    acc.data() + ((g / kRW) * mb + m) * kRW * kV);
            }
          }
        }
        for (int64_t g = 0; g < valid; g += kRW)
          for (int64_t m = 0; m < mb; ++m)
            for (int64_t r = g; r < std::min(valid, g + kRW); ++r) {
              const float* a = acc.data() + (((g / kRW) * mb + m) * kRW + (r - g)) * kV;
              float s = 0.f;
              for (int64_t v = 0; v < width; ++v) s += a[v];
              yp[(m0 + m) * n + n0 + r] = s;
            }
      }
    }
  });
  return y.view(shape).to(x.scalar_type());
}

int64_t kquant_best_isa() { return best_isa(); }

// ---- batches on bf16 hardware: a panel of rows decoded to bf16, the GEMM on oneDNN (AMX / AVX512-BF16) ---------
// Where the CPU has bf16 dot-product instructions, a batch (prefill, batch-64 decode) is a GEMM that oneDNN runs on
// AMX tiles at 3-5x fp32's rate. Per call, output rows are taken in panels (2-4 MB of bf16: fewer oneDNN calls,
// still in L2): the panel's blocks are decoded straight to bf16 in parallel (each weight the fp32 decoders' value,
// rounded once: Q4_K / Q5_K through a per-sub-block table and vpermw), then ``at::mm`` multiplies the bf16
// activations by the panel (fp32 accumulation inside oneDNN, the result rounded to bf16 once). Nothing persists
// between calls: the file's blocks stay the only copy. Also GGUF Q8_0 (the file's rows) and Q4_0 / Q4_1 in
// ``q4_gemv``'s 16-row interleaved layout (``quant.py``'s ``_repack``; decoded by scalar code).
constexpr int64_t kPanelElems = int64_t{1} << 20;  // weights per panel (2 MB of bf16), at least kPanelRows rows
constexpr int64_t kPanelRows = 256;

#ifdef PAGEDLLM_KQ_X86
#define PAGEDLLM_TBF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")))
PAGEDLLM_TBF16 void to_bf16_avx512(const float* in, int64_t count, uint16_t* out) {
  for (int64_t i = 0; i < count; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(in + i)));
}

// One super-block (Q4_K / Q5_K / Q6_K) straight to 256 bf16, the values of the fp32 decoders above rounded once.
// Q4_K / Q5_K: per sub-block of 32 the 16 (32) possible weights d * sc * q - dmin * m are computed as a bf16 table,
// and one vpermw looks 32 weights up from their nibbles (Q5_K: the fifth bit merged into the index). Q6_K (a scale
// per 16 weights, 64 values): the fp32 path's integer decode (``decode_q6_avx512``), rounded 16 at a time.
PAGEDLLM_TBF16 void decode_bf16_avx512(Type t, const uint8_t* b, uint16_t* out) {
  if (t == kQ6K) {
    float dl[16];
    scales_q6(b, dl);
    for (int n = 0; n < 2; ++n)
      for (int h = 0; h < 2; ++h) {
        __m512 w[4];
        decode_q6_avx512(b, dl, n, h, w);  // the fp32 decoder's values, rounded once
        for (int j = 0; j < 4; ++j)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 128 * n + 32 * j + 16 * h),
                              (__m256i)_mm512_cvtneps_pbh(w[j]));
      }
    return;
  }
  float dl[8], ml[8];
  scales_k4(b, dl, ml);
  const uint8_t* qs = b + (t == kQ5K ? 48 : 16);
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 iota16 = _mm512_add_ps(iota, _mm512_set1_ps(16.f));
  const __m512i low4 = _mm512_set1_epi16(0xF), one = _mm512_set1_epi16(1);
  const __m512i hv = t == kQ5K ? _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)))
                               : _mm512_setzero_si512();
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c)));
    for (int s = 0; s < 2; ++s) {
      const int i = 2 * c + s;
      const __m512 d = _mm512_set1_ps(dl[i]), m = _mm512_set1_ps(ml[i]);
      // the same two fp32 operations as the reference: (d * q) rounded, then - m rounded; then to bf16
      const __m512 lo = _mm512_sub_ps(_mm512_mul_ps(d, iota), m);
      __m512i table, idx = _mm512_and_si512(s ? _mm512_srli_epi16(v, 4) : v, low4);
      if (t == kQ5K) {
        table = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(_mm512_mul_ps(d, iota16), m), lo);
        idx = _mm512_or_si512(idx, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hv, i), one), 4));
      } else {
        table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(lo));
      }
      _mm512_storeu_si512(out + 32 * i, _mm512_permutexvar_epi16(idx, table));
    }
  }
}

// Q8_0: 32 weights of one block (fp16 d, 32 int8 q) to bf16, w = d * q rounded once.
PAGEDLLM_TBF16 void decode_q8_bf16_avx512(const uint8_t* p, uint16_t* out) {
  const __m512 d = _mm512_set1_ps(half_at(p));
  for (int h = 0; h < 2; ++h) {
    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 + 16 * h))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * h), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(d, q)));
  }
}

#endif

bool has_bf16_dot() {
#ifdef PAGEDLLM_KQ_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") && best_isa() == kAvx512;
#else
  return false;
#endif
}

// fp32 -> bf16 round to nearest even (count a multiple of 16), one instruction per 16 where the CPU has it.
void to_bf16(const float* in, int64_t count, uint16_t* out, bool hw) {
#ifdef PAGEDLLM_KQ_X86
  if (hw) return to_bf16_avx512(in, count, out);
#endif
  for (int64_t i = 0; i < count; ++i) out[i] = c10::BFloat16(in[i]).x;
}

enum Format { kFmtQ4K = 0, kFmtQ5K = 1, kFmtQ6K = 2, kFmtQ8_0 = 3, kFmtQ4_0 = 4, kFmtQ4_1 = 5 };

// weight_type "Q4_K_R16" / "Q5_K_R16" / "Q6_K_R16": the blocks in kquant_r16.cpp's 16-row layout (``r16`` set).
Format parse_format(const std::string& s, bool* r16) {
  *r16 = s == "Q4_K_R16" || s == "Q5_K_R16" || s == "Q6_K_R16";
  if (*r16) return s[1] == '4' ? kFmtQ4K : s[1] == '5' ? kFmtQ5K : kFmtQ6K;
  if (s == "Q8_0") return kFmtQ8_0;
  if (s == "Q4_0") return kFmtQ4_0;
  if (s == "Q4_1") return kFmtQ4_1;
  TORCH_CHECK(s == "Q4_K" || s == "Q5_K" || s == "Q6_K", "kquant_mm_bf16: weight_type must be Q4_K, Q5_K, Q6_K, Q8_0, ",
              "Q4_0, Q4_1 or Q{4,5,6}_K_R16, got ", s);
  return static_cast<Format>(pagedllm_cpu::parse_kquant(s, "kquant_mm_bf16"));
}

// Q8_0: one row of k weights (k / 32 blocks of fp16 d + 32 int8) to fp32, w = d * q.
void decode_q8_row(const uint8_t* row, int64_t k, float* out) {
  for (int64_t b = 0; b < k / 32; ++b) {
    const uint8_t* p = row + b * 34;
    const float d = half_at(p);
    const int8_t* q = reinterpret_cast<const int8_t*>(p + 2);
    for (int j = 0; j < 32; ++j) out[32 * b + j] = d * static_cast<float>(q[j]);
  }
}

// Q4_0 / Q4_1 in q4_gemv's layout: 16 rows of a group (block stride gb bytes): d[16] (m[16]) fp16, then 4 chunks of
// [16 rows][4 bytes], weight 8c + j of row r at bits 4j of chunk c's word r. w = d q + m (Q4_0: m = -8 d).
void decode_q4_group(const uint8_t* g, int64_t nb, bool has_min, int64_t rows, float* out, int64_t ostride) {
  const int64_t sb = has_min ? 64 : 32, gb = sb + 256;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = g + b * gb;
    for (int64_t r = 0; r < rows; ++r) {
      const float d = half_at(p + 2 * r), m = has_min ? half_at(p + 32 + 2 * r) : -8.f * d;
      float* o = out + r * ostride + 32 * b;
      for (int c = 0; c < 4; ++c) {
        uint32_t word;
        std::memcpy(&word, p + sb + 64 * c + 4 * r, 4);
        for (int j = 0; j < 8; ++j) o[8 * c + j] = d * static_cast<float>((word >> (4 * j)) & 0xF) + m;
      }
    }
  }
}

// x [..., K], blocks as the format stores them ([N, row bytes] for the GGUF row formats, [ceil(N / 16), K / 32,
// bytes] for Q4_0 / Q4_1 repacked, with n the output rows, [N / 16, K / 256 * record] for the K-quants' 16-row
// layout): y [..., N] in x's dtype, computed as bf16 x bf16. The 16-row layout is turned back into the file's
// super-blocks one record at a time (bit for bit), so both layouts give the same bits.
at::Tensor kquant_mm_bf16(const at::Tensor& x, const at::Tensor& blocks, const std::string& weight_type, int64_t n) {
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "kquant_mm_bf16: x must be floating point");
  bool r16 = false;
  const Format f = parse_format(weight_type, &r16);
  const int64_t k = x.size(-1);
  const bool q4 = f == kFmtQ4_0 || f == kFmtQ4_1;
  const int64_t unit = f == kFmtQ8_0 || q4 ? 32 : kQK;
  TORCH_CHECK(k % unit == 0, "kquant_mm_bf16: K = ", k, " is not a multiple of ", unit);
  int64_t row_stride = 0, bb = 0, rec = 0;  // rec: the 16-row layout's record bytes
  if (q4) {
    bb = f == kFmtQ4_1 ? 64 + 256 : 32 + 256;
    TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.dim() == 3 &&
                    blocks.size(0) == (n + 15) / 16 && blocks.size(1) == k / 32 && blocks.size(2) == bb,
                "kquant_mm_bf16: ", weight_type, " blocks must be q4_gemv's uint8 [ceil(N / 16), K / 32, ", bb, "]");
  } else if (r16) {
    bb = kquant_bytes(static_cast<Type>(f));
    rec = pagedllm_cpu::kernels::kquant_r16_record_bytes(static_cast<int>(f));
    TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
                    blocks.size(1) == k / kQK * rec,
                "kquant_mm_bf16: ", weight_type, " blocks must be contiguous uint8 [N / 16, K / 256 * ", rec, "]");
    n = blocks.size(0) * 16;
  } else {
    bb = f == kFmtQ8_0 ? 34 : kquant_bytes(static_cast<Type>(f));
    TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.stride(1) == 1 &&
                    blocks.size(1) == k / unit * bb,
                "kquant_mm_bf16: blocks must be uint8 [N, K / ", unit, " * ", bb, "] with contiguous rows for K = ", k);
    n = blocks.size(0);
    row_stride = blocks.stride(0);
  }
  const bool hw = has_bf16_dot();
  const Isa level = static_cast<Isa>(best_isa());
  const at::Tensor xb = x.reshape({-1, k}).to(at::kBFloat16).contiguous();
  const int64_t mrows = xb.size(0);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  const int64_t panel = std::min(std::max(kPanelRows, kPanelElems / k / 16 * 16), (n + 15) / 16 * 16);
  at::Tensor w = at::empty({panel, k}, xb.options());
  at::Tensor y = at::empty({mrows, n}, x.options().dtype(x.scalar_type() == at::kBFloat16 ? at::kBFloat16 : at::kFloat));
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  uint16_t* dst = reinterpret_cast<uint16_t*>(w.data_ptr<at::BFloat16>());
  for (int64_t p0 = 0; p0 < n; p0 += panel) {
    const int64_t rows = std::min(panel, n - p0);
    // work items of 16 output rows (one q4_gemv group), each decoded through a 16 x 256 fp32 scratch
    at::parallel_for(0, (rows + 15) / 16, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> tmp(16 * kQK);
      std::vector<uint8_t> file_blocks(r16 ? 16 * bb : 0);  // a 16-row record as the file's 16 super-blocks
      for (int64_t it = begin; it < end; ++it) {
        const int64_t r0 = 16 * it, rr = std::min<int64_t>(16, rows - r0);
        for (int64_t k0 = 0; k0 < k; k0 += kQK) {
          const int64_t kc = std::min(kQK, k - k0);
          int64_t kofs = (k0 / kQK) * bb;  // row r's super-block k0 / 256: row_at(r) + kofs
          if (r16) {
            pagedllm_cpu::kernels::kquant_r16_to_blocks(static_cast<int>(f),
                                                        wp + ((p0 + r0) / 16) * blocks.size(1) + (k0 / kQK) * rec,
                                                        file_blocks.data());
            kofs = 0;
          }
          auto row_at = [&](int64_t r) {
            return r16 ? file_blocks.data() + r * bb : wp + (p0 + r0 + r) * row_stride;
          };
#ifdef PAGEDLLM_KQ_X86
          if (hw && !q4) {  // straight to bf16
            for (int64_t r = 0; r < rr; ++r) {
              const uint8_t* row = row_at(r);
              uint16_t* o = dst + (r0 + r) * k + k0;
              if (f == kFmtQ8_0) {
                for (int64_t b = 0; b < kc / 32; ++b) decode_q8_bf16_avx512(row + (k0 / 32 + b) * bb, o + 32 * b);
              } else {
                decode_bf16_avx512(static_cast<Type>(f), row + kofs, o);
              }
            }
            continue;
          }
#endif
          if (q4) {
            decode_q4_group(wp + ((p0 + r0) / 16) * (k / 32) * bb + (k0 / 32) * bb, kc / 32, f == kFmtQ4_1, rr,
                            tmp.data(), kQK);
          } else {
            for (int64_t r = 0; r < rr; ++r) {
              const uint8_t* row = row_at(r);
              if (f == kFmtQ8_0)
                decode_q8_row(row + (k0 / 32) * bb, kc, tmp.data() + r * kQK);
              else
                decode(level, static_cast<Type>(f), row + kofs, tmp.data() + r * kQK);
            }
          }
          for (int64_t r = 0; r < rr; ++r) to_bf16(tmp.data() + r * kQK, kc, dst + (r0 + r) * k + k0, hw);
        }
      }
    });
    const at::Tensor out = at::mm(xb, w.narrow(0, 0, rows).t());
    if (rows == n && y.scalar_type() == at::kBFloat16) {
      y = out;
    } else {
      y.narrow(1, p0, rows).copy_(out);
    }
  }
  return y.view(shape).to(x.scalar_type());
}

int64_t kquant_has_bf16() { return has_bf16_dot() ? 1 : 0; }

}  // namespace

at::Tensor pagedllm_cpu::kernels::kquant_gemv(const at::Tensor& x, const at::Tensor& blocks, const std::string& weight_type,
                                              int64_t isa) {
  return ::kquant_gemv(x, blocks, weight_type, isa);
}

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("kquant_gemv(Tensor x, Tensor blocks, str weight_type, int isa=-1) -> Tensor");
  m.def("kquant_best_isa() -> int", &kquant_best_isa);
  m.def("kquant_mm_bf16(Tensor x, Tensor blocks, str weight_type, int n=-1) -> Tensor");
  m.def("kquant_has_bf16() -> int", &kquant_has_bf16);
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("kquant_gemv", &kquant_gemv);
  m.impl("kquant_mm_bf16", &kquant_mm_bf16);
}
