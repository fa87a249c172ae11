// y = x @ W.T for a few rows of fp32 x straight from GGUF Q8_0 blocks in the file's row layout (no repack), fp32
// throughout: SmolLM2's tied LM head reads the token embedding's blocks (30 MB) instead of a 56 MB bf16 copy.
//
// Q8_0 block (ggml): d fp16, then 32 int8 q; w = d * q. A row is K / 32 blocks of 34 bytes, read in place (the
// blocks are unaligned). Per block and row of x: s = sum_j q_j x_j in vector lanes, acc += d * s; one horizontal
// sum per output row. Output rows are split across threads; x (a few rows of K floats) stays in L1. AVX2 does the
// same on 8 lanes; other CPUs run a scalar loop.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "kernels.h"

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;       // weights per block
constexpr int64_t kBlockBytes = 34;  // fp16 d + 32 int8
constexpr int64_t kTile = 8;         // rows of x per pass over a weight row
// Each block's cache line this many bytes ahead is prefetched into L1: at one row of x the loop is too short for the
// hardware prefetcher alone to keep DRAM busy (2 threads, Q8_0 2048 x 8192 matrices streamed from 1.1 GB, Xeon with
// AMX: 14.5 GB/s without, 20.0 / 23.7 / 26.0 / 24.5 GB/s at 1 / 2 / 3 / 4 KB ahead; the streaming-read floor is
// 26-28). Past the end of the blocks it is a no-op (prefetches never fault).
constexpr int64_t kPrefetch = 3072;
// AVX-512 also asks for the line kFarPrefetch ahead into L2 when a row holds at least kFarMinRowBytes, so DRAM's
// latency is covered (kquant_r16.cpp's kL2Records says why). AMD EPYC Zen 4, 2 threads, the 1.7B Q8_0's decode step
// (8 alternated pairs in one process): 70.8 -> 62.6 ms (8, 12 and 16 KB ahead alike); on SmolLM2-135M's tied head
// (rows of 576 weights) it cost ~3% of the step, so short rows keep the L1 request alone.
constexpr int64_t kFarPrefetch = 12288;
constexpr int64_t kFarMinRowBytes = 2048;

inline uint16_t scale_bits(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return bits;
}

// One output row (its nb blocks at w) for MT rows of x: y[m * ys] = sum_b d_b * sum_j q_bj x[m][32 b + j].
template <int MT>
void row_dot(const uint8_t* w, int64_t nb, const float* x, int64_t xs, float* y, int64_t ys) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const bool far = nb * kBlockBytes >= kFarMinRowBytes;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = w + b * kBlockBytes;
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch), _MM_HINT_T0);
    if (far) _mm_prefetch(reinterpret_cast<const char*>(p + kFarPrefetch), _MM_HINT_T1);
    const __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(scale_bits(p))));  // d in every lane
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2))));
    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 18))));
    for (int m = 0; m < MT; ++m) {
      const float* xb = x + m * xs + b * kBlock;
      const __m512 s = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(xb)));
      acc[m] = _mm512_fmadd_ps(s, d, acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) y[m * ys] = _mm512_reduce_add_ps(acc[m]);
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = w + b * kBlockBytes;
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch), _MM_HINT_T0);
    const __m256 d = _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(scale_bits(p))));
    __m256 q[4];
    for (int c = 0; c < 4; ++c)
      q[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 2 + 8 * c))));
    for (int m = 0; m < MT; ++m) {
      const float* xb = x + m * xs + b * kBlock;
      __m256 s = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
      for (int c = 1; c < 4; ++c) s = _mm256_fmadd_ps(q[c], _mm256_loadu_ps(xb + 8 * c), s);
      acc[m] = _mm256_fmadd_ps(s, d, acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    float out[8];
    _mm256_storeu_ps(out, acc[m]);
    y[m * ys] = ((out[0] + out[1]) + (out[2] + out[3])) + ((out[4] + out[5]) + (out[6] + out[7]));
  }
#else
  float acc[MT] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = w + b * kBlockBytes;
    const float d = c10::detail::fp16_ieee_to_fp32_value(scale_bits(p));
    const int8_t* q = reinterpret_cast<const int8_t*>(p + 2);
    for (int m = 0; m < MT; ++m) {
      const float* xb = x + m * xs + b * kBlock;
      float s = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) s += static_cast<float>(q[j]) * xb[j];
      acc[m] += d * s;
    }
  }
  for (int m = 0; m < MT; ++m) y[m * ys] = acc[m];
#endif
}

void run_tile(int64_t mt, const uint8_t* w, int64_t nb, const float* x, int64_t xs, float* y, int64_t ys) {
  switch (mt) {
    case 1: return row_dot<1>(w, nb, x, xs, y, ys);
    case 2: return row_dot<2>(w, nb, x, xs, y, ys);
    case 3: return row_dot<3>(w, nb, x, xs, y, ys);
    case 4: return row_dot<4>(w, nb, x, xs, y, ys);
    case 5: return row_dot<5>(w, nb, x, xs, y, ys);
    case 6: return row_dot<6>(w, nb, x, xs, y, ys);
    case 7: return row_dot<7>(w, nb, x, xs, y, ys);
    default: return row_dot<8>(w, nb, x, xs, y, ys);
  }
}

// x [..., K] (K a multiple of 32; reduced dtypes computed in fp32), blocks uint8 [N, K / 32 * 34] (rows may be
// strided, bytes within a row contiguous): y [..., N] in x's dtype.
at::Tensor q8_gemv(const at::Tensor& x, const at::Tensor& blocks) {
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "q8_gemv: x must be floating point");
  const int64_t k = x.size(-1), nb = k / kBlock;
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.stride(1) == 1 &&
                  k % kBlock == 0 && blocks.size(1) == nb * kBlockBytes,
              "q8_gemv: blocks must be uint8 [N, K / 32 * 34] with contiguous rows");
  const int64_t n = blocks.size(0), row_stride = blocks.stride(0);
  const at::Tensor rows = x.reshape({-1, k}).to(at::kFloat).contiguous();
  const int64_t mrows = rows.size(0);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  at::Tensor y = at::empty({mrows, n}, rows.options());
  const float* xp = rows.data_ptr<float>();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < mrows; m0 += kTile) {
      const int64_t mt = std::min(kTile, mrows - m0);
      for (int64_t r = begin; r < end; ++r) run_tile(mt, wp + r * row_stride, nb, xp + m0 * k, k, yp + m0 * n + r, n);
    }
  });
  return y.view(shape).to(x.scalar_type());
}

}  // namespace

at::Tensor pagedllm_cpu::kernels::q8_gemv(const at::Tensor& x, const at::Tensor& blocks) { return ::q8_gemv(x, blocks); }

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) { m.def("q8_gemv(Tensor x, Tensor blocks) -> Tensor"); }

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("q8_gemv", &q8_gemv); }
