// y = x @ W.T for a few rows of fp32 x straight from GGUF Q4_0 / Q4_1 weights, fp32 throughout (batch-1 decode).
// torch's int4pack kernel reaches 10-14 GB/s at one row and wants bf16 activations; this one decodes the nibbles
// in registers and accumulates the fp32 activations exactly as the fp32 reference does, up to summation order.
//
// Layout (``quant.py`` repacks at load): output rows in groups of 16 (the last one zero-padded), each group all its
// K / 32 blocks in order, one block = d[16] fp16, then m[16] fp16 (Q4_1 only; Q4_0 has m = -8 d), then 256 bytes of
// nibbles as 4 chunks of [16 rows][4 bytes]: chunk c's 32-bit word of row r holds weights 8c..8c+7 of the block at
// bits 4j. One 64-byte load then gives a nibble of every row per 32-bit lane; a shift and a vpermps on the table
// 0..15 turn it into 16 floats, one FMA per input element serves 16 output rows. Per block:
// y += d * sum_j q_j x_j + m * sum_j x_j, the second sum computed once per row of x. AVX2 does the same on two
// halves of 8 rows; other CPUs run a scalar loop over the same layout.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_common.h"
#include "kernels.h"

#include <cstdint>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 16;   // output rows per group
constexpr int64_t kBlock = 32;  // GGUF block along K
constexpr int64_t kTile = 8;    // rows of x per pass over a group's weights

int64_t block_bytes(bool has_min) { return kRows * 2 * (has_min ? 2 : 1) + kRows * kBlock / 2; }

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// Each block's bytes this far ahead are prefetched into L1 (as q8_gemv and kquant_gemv do): weights larger than the
// LLC stream from DRAM, and at one row of x the hardware prefetcher alone leaves the loop waiting on it. Past the
// end of the group: the next group's blocks, or a no-op (prefetches never fault).
constexpr int64_t kPrefetch = 3072;

inline void prefetch_block(const uint8_t* p, int64_t bb) { pagedllm_cpu::prefetch_ahead<kPrefetch>(p, bb); }
#endif

struct Args {
  const uint8_t* w;     // one group's blocks
  int64_t nb;           // blocks along K
  bool has_min;         // Q4_1
  const float* x;       // first row of the tile
  int64_t xs;           // row stride of x
  const float* xsum;    // [rows of x][nb] block sums of the tile's first row
  float* y;             // first output of the group in the tile's first row
  int64_t ys;           // row stride of y
  int64_t valid;        // output rows of the group that exist (16 but in the last group)
};

#ifdef CPU_CAPABILITY_AVX512
template <int MT>
void group_rows(const Args& a) {
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int64_t bb = block_bytes(a.has_min);
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* p = a.w + b * bb;
    prefetch_block(p, bb);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512 mn = a.has_min ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)))
                                : _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
    const uint8_t* q = p + (a.has_min ? 64 : 32);
    __m512 s0[MT], s1[MT];
    for (int m = 0; m < MT; ++m) s0[m] = s1[m] = _mm512_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(q + 64 * c);
      const float* xc = a.x + b * kBlock + c * 8;
#define PAGEDLLM_Q4_STEP(j, s)                                                              \
  {                                                                                         \
    const __m512 wq = _mm512_permutexvar_ps((j) ? _mm512_srli_epi32(v, 4 * (j)) : v, table); \
    for (int m = 0; m < MT; ++m) s[m] = _mm512_fmadd_ps(wq, _mm512_set1_ps(xc[m * a.xs + (j)]), s[m]); \
  }
      PAGEDLLM_Q4_STEP(0, s0) PAGEDLLM_Q4_STEP(1, s1) PAGEDLLM_Q4_STEP(2, s0) PAGEDLLM_Q4_STEP(3, s1)
      PAGEDLLM_Q4_STEP(4, s0) PAGEDLLM_Q4_STEP(5, s1) PAGEDLLM_Q4_STEP(6, s0) PAGEDLLM_Q4_STEP(7, s1)
#undef PAGEDLLM_Q4_STEP
    }
    for (int m = 0; m < MT; ++m) {
      acc[m] = _mm512_fmadd_ps(_mm512_add_ps(s0[m], s1[m]), d, acc[m]);
      acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.xsum[m * a.nb + b]), acc[m]);
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << a.valid) - 1u);
  for (int m = 0; m < MT; ++m) _mm512_mask_storeu_ps(a.y + m * a.ys, mask, acc[m]);
}
#elif defined(CPU_CAPABILITY_AVX2)
// 8 lanes: a group's 16 rows are two halves; nibbles become floats by shift, mask and convert (no 16-entry vpermps).
template <int MT>
void group_rows(const Args& a) {
  const __m256i low4 = _mm256_set1_epi32(0xF);
  const int64_t bb = block_bytes(a.has_min);
  __m256 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* p = a.w + b * bb;
    prefetch_block(p, bb);
    const uint8_t* q = p + (a.has_min ? 64 : 32);
    __m256 d[2], mn[2], s[MT][2];
    for (int h = 0; h < 2; ++h) {
      d[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
      mn[h] = a.has_min ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 16 * h)))
                        : _mm256_mul_ps(d[h], _mm256_set1_ps(-8.f));
    }
    for (int m = 0; m < MT; ++m) s[m][0] = s[m][1] = _mm256_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * c));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * c + 32));
      const float* xc = a.x + b * kBlock + c * 8;
      for (int j = 0; j < 8; ++j) {
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v0, 4 * j), low4));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v1, 4 * j), low4));
        for (int m = 0; m < MT; ++m) {
          const __m256 xb = _mm256_set1_ps(xc[m * a.xs + j]);
          s[m][0] = _mm256_fmadd_ps(w0, xb, s[m][0]);
          s[m][1] = _mm256_fmadd_ps(w1, xb, s[m][1]);
        }
      }
    }
    for (int m = 0; m < MT; ++m) {
      const __m256 xs = _mm256_set1_ps(a.xsum[m * a.nb + b]);
      for (int h = 0; h < 2; ++h) acc[m][h] = _mm256_fmadd_ps(mn[h], xs, _mm256_fmadd_ps(s[m][h], d[h], acc[m][h]));
    }
  }
  for (int m = 0; m < MT; ++m) {
    float out[kRows];
    _mm256_storeu_ps(out, acc[m][0]);
    _mm256_storeu_ps(out + 8, acc[m][1]);
    for (int64_t r = 0; r < a.valid; ++r) a.y[m * a.ys + r] = out[r];
  }
}
#else
template <int MT>
void group_rows(const Args& a) {
  const int64_t bb = block_bytes(a.has_min);
  float acc[MT][kRows] = {};
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* p = a.w + b * bb;
    const c10::Half* dh = reinterpret_cast<const c10::Half*>(p);
    const uint8_t* q = p + (a.has_min ? 64 : 32);
    for (int64_t r = 0; r < kRows; ++r) {
      const float d = static_cast<float>(dh[r]);
      const float mn = a.has_min ? static_cast<float>(dh[kRows + r]) : -8.f * d;
      for (int m = 0; m < MT; ++m) {
        const float* xb = a.x + m * a.xs + b * kBlock;
        float s = 0.f;
        for (int64_t c = 0; c < 4; ++c) {
          const uint8_t* word = q + 64 * c + 4 * r;
          for (int64_t j = 0; j < 8; ++j) s += static_cast<float>((word[j / 2] >> (4 * (j % 2))) & 0xF) * xb[c * 8 + j];
        }
        acc[m][r] += d * s + mn * a.xsum[m * a.nb + b];
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int64_t r = 0; r < a.valid; ++r) a.y[m * a.ys + r] = acc[m][r];
}
#endif

void run_tile(int64_t mt, const Args& a) {
  switch (mt) {
    case 1: return group_rows<1>(a);
    case 2: return group_rows<2>(a);
    case 3: return group_rows<3>(a);
    case 4: return group_rows<4>(a);
    case 5: return group_rows<5>(a);
    case 6: return group_rows<6>(a);
    case 7: return group_rows<7>(a);
    default: return group_rows<8>(a);
  }
}

// x [..., K] (K a multiple of 32; reduced dtypes computed in fp32), packed uint8 [ceil(N / 16), K / 32, block bytes]:
// y [..., N] in x's dtype.
at::Tensor q4_gemv(const at::Tensor& x, const at::Tensor& packed, int64_t n, bool has_min) {
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "q4_gemv: x must be floating point");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous(),
              "q4_gemv: packed must be contiguous uint8 [groups, blocks, bytes]");
  const int64_t k = x.size(-1), nb = k / kBlock, groups = packed.size(0);
  TORCH_CHECK(k % kBlock == 0 && packed.size(1) == nb && packed.size(2) == block_bytes(has_min) &&
                  groups == (n + kRows - 1) / kRows,
              "q4_gemv: packed does not match x's K or n");
  const at::Tensor rows = x.reshape({-1, k}).to(at::kFloat).contiguous();
  const int64_t mrows = rows.size(0);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  at::Tensor y = at::empty({mrows, n}, rows.options());
  const float* xp = rows.data_ptr<float>();
  std::vector<float> xsum(mrows * nb);
  for (int64_t i = 0; i < mrows * nb; ++i) {
    float s = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) s += xp[i * kBlock + j];
    xsum[i] = s;
  }
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t group_bytes = nb * block_bytes(has_min);
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t m0 = 0; m0 < mrows; m0 += kTile) {
        const Args a{wp + g * group_bytes, nb,       has_min, xp + m0 * k, k, xsum.data() + m0 * nb,
                     yp + m0 * n + g * kRows, n, std::min(kRows, n - g * kRows)};
        run_tile(std::min(kTile, mrows - m0), a);
      }
    }
  });
  return y.view(shape).to(x.scalar_type());
}

}  // namespace

at::Tensor pagedllm_cpu::kernels::q4_gemv(const at::Tensor& x, const at::Tensor& packed, int64_t n, bool has_min) {
  return ::q4_gemv(x, packed, n, has_min);
}

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) { m.def("q4_gemv(Tensor x, Tensor packed, int n, bool has_min) -> Tensor"); }

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("q4_gemv", &q4_gemv); }
