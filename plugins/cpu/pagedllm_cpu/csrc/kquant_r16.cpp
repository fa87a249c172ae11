// y = x @ W.T for GGUF Q4_K / Q5_K / Q6_K weights repacked at load into groups of 16 output rows, with x in two int8
// terms: the decode kernel of CPUs with AVX-512 VNNI.
//
// Why: at few rows of x the file's layout costs ALU, not memory. Decoding its super-blocks to fp32
// (``kquant_gemv.cpp``) is ~3 vector ops per 16 weights; llama.cpp's int8 dot products over the same bytes
// (``kquant_q8k.cpp``) still pay a scale multiply per 64 weights and the scales' unpacking per super-block and row.
// Here one 64-byte load holds 4 bytes of each of 16 rows, so one ``vpdpbusd`` against 4 broadcast activations
// advances 16 output rows (one per int32 lane) and the scales, unpacked once at load, are vectors of 16 rows.
//
// x is quantized per 32 values to 15 bits, x ~ d * v with d = max|x| / 16256 and v = round(x / d), and v is split
// into two int8 terms, v = 128 * hi + lo (hi = v >> 7 in -127..127, lo = v & 127 in 0..127): each weight byte (the
// unsigned first operand of ``vpdpbusd``) meets hi and lo (both fit its signed second operand), and the two int32 sums
// join as 128 * hi_sum + lo_sum (below 2^24: exact in fp32). The error is at most d / 2 = 1/32512 of the largest
// value of its 32, 128 times below llama.cpp's int8 activations (``terms`` = 1: hi alone as round(x * 127 / max) per
// 256, llama.cpp's Q8_K, ``PAGEDLLM_CPU_INT8_ACT=1``) and far below bf16's rounding of the batched path. x's and the
// sub-blocks' scales apply in fp32 per 16 rows; the weights are the file's values.
//
// Layouts (uint8 [N / 16, K / 256 * record], one record per group of 16 rows and super-block):
//   Q4_K, 2368 bytes (148 a row): d fp16 [16], dmin fp16 [16], scales u8 [8][16], mins u8 [8][16], then qs as 32
//     chunks of 64 bytes, chunk t holding bytes 4t..4t+3 of each row's 128 (low nibbles: weights 64 (t / 8) + 4 (t % 8)
//     + 0..3, high nibbles the 32 after them).
//   Q5_K, 2880 bytes (180 a row for 176): Q4_K's record, then the fifth bits as 8 chunks (bytes 4v..4v+3 of each
//     row's 32: bit 2c of byte l is that of weight 64c + l, bit 2c + 1 of weight 64c + 32 + l).
//   Q6_K, 3360 bytes (210 a row, the file's size): d fp16 [16], scales i8 [16][16], ql as 32 chunks (bytes 4u..4u+3
//     of each row's 128), qh as 16 chunks (bytes 4v..4v+3 of each row's 64).
// ``kquant_r16_to_blocks`` turns a record back into the file's 16 super-blocks bit for bit (the batched path's bf16
// GEMM decodes those), ``kquant_r16_unpack`` a whole matrix (tests).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "kernels.h"

#include "cpu_common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PAGEDLLM_R16_X86 1
#define PAGEDLLM_R16_TVNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
#endif

namespace {

constexpr int64_t kQK = 256;  // values per super-block
constexpr int64_t kRows = 16;  // output rows per group (one per int32 lane)
constexpr int64_t kQ4Rec = 32 + 32 + 128 + 128 + 2048;
constexpr int64_t kQ5Rec = kQ4Rec + 512;  // Q4_K's record, then the fifth bits
constexpr int64_t kQ6Rec = 32 + 256 + 2048 + 1024;
constexpr float kLevels = 16256.f;  // 127 * 128: v = 128 * hi + lo with hi in -127..127

using pagedllm_cpu::kQ4K;
using pagedllm_cpu::kQ5K;
using pagedllm_cpu::kQ6K;
using pagedllm_cpu::nearest_int;
using Type = pagedllm_cpu::KQuant;

int64_t record_bytes(Type t) { return t == kQ4K ? kQ4Rec : t == kQ5K ? kQ5Rec : kQ6Rec; }

// Q4_K's 12 scale bytes <-> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4 and its inverse).
void unpack_scales(const uint8_t* q, uint8_t sc[8], uint8_t mn[8]) {
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      sc[j] = q[j] & 63;
      mn[j] = q[j + 4] & 63;
    } else {
      sc[j] = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
      mn[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
  }
}

void pack_scales(const uint8_t sc[8], const uint8_t mn[8], uint8_t* q) {
  std::memset(q, 0, 12);
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      q[j] |= sc[j] & 63;
      q[j + 4] |= mn[j] & 63;
    } else {
      q[j + 4] = (sc[j] & 0xF) | ((mn[j] & 0xF) << 4);
      q[j - 4] |= (sc[j] >> 4) << 6;
      q[j] |= (mn[j] >> 4) << 6;
    }
  }
}

// One group's record <-> its 16 rows' super-block sb. ``to_record``: file -> record; else record -> file.
void convert(Type t, bool to_record, uint8_t* rec, uint8_t* const rows[kRows]) {
  for (int i = 0; i < kRows; ++i) {
    uint8_t* b = rows[i];
    auto mv = [&](uint8_t* r, uint8_t* f, size_t n) { to_record ? std::memcpy(r, f, n) : std::memcpy(f, r, n); };
    if (t == kQ4K || t == kQ5K) {
      mv(rec + 2 * i, b, 2);
      mv(rec + 32 + 2 * i, b + 2, 2);
      uint8_t sc[8], mn[8];
      if (to_record) {
        unpack_scales(b + 4, sc, mn);
        for (int s = 0; s < 8; ++s) {
          rec[64 + 16 * s + i] = sc[s];
          rec[192 + 16 * s + i] = mn[s];
        }
      } else {
        for (int s = 0; s < 8; ++s) {
          sc[s] = rec[64 + 16 * s + i];
          mn[s] = rec[192 + 16 * s + i];
        }
        pack_scales(sc, mn, b + 4);
      }
      const int64_t qs = t == kQ5K ? 48 : 16;
      for (int c = 0; c < 32; ++c) mv(rec + 320 + 64 * c + 4 * i, b + qs + 4 * c, 4);
      if (t == kQ5K)
        for (int v = 0; v < 8; ++v) mv(rec + kQ4Rec + 64 * v + 4 * i, b + 16 + 4 * v, 4);
    } else {
      mv(rec + 2 * i, b + 208, 2);
      for (int s = 0; s < 16; ++s) mv(rec + 32 + 16 * s + i, b + 192 + s, 1);
      for (int u = 0; u < 32; ++u) mv(rec + 288 + 64 * u + 4 * i, b + 4 * u, 4);
      for (int v = 0; v < 16; ++v) mv(rec + 2336 + 64 * v + 4 * i, b + 128 + 4 * v, 4);
    }
  }
}

void check_blocks(const at::Tensor& blocks, Type t, const char* op) {
  const int64_t bb = pagedllm_cpu::kquant_bytes(t);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.stride(1) == 1 &&
                  blocks.size(1) % bb == 0 && blocks.size(0) % kRows == 0,
              op, ": blocks must be uint8 [N, K / 256 * ", bb, "] with contiguous rows and N a multiple of 16");
}

// blocks uint8 [N, K / 256 * bytes] (the file's) -> uint8 [N / 16, K / 256 * record], into ``out`` where given (a
// contiguous uint8 tensor of that many bytes: the caller places the weights, e.g. on huge pages).
at::Tensor kquant_r16_repack(const at::Tensor& blocks, const std::string& weight_type,
                             const std::optional<at::Tensor>& out_arg) {
  const Type t = pagedllm_cpu::parse_kquant(weight_type, "kquant_r16_repack");
  check_blocks(blocks, t, "kquant_r16_repack");
  const int64_t bb = pagedllm_cpu::kquant_bytes(t), rb = record_bytes(t);
  const int64_t n = blocks.size(0), nsb = blocks.size(1) / bb, rs = blocks.stride(0);
  at::Tensor out;
  if (out_arg.has_value()) {
    TORCH_CHECK(out_arg->scalar_type() == at::kByte && out_arg->is_contiguous() &&
                    out_arg->numel() == n / kRows * nsb * rb,
                "kquant_r16_repack: out must be a contiguous uint8 tensor of ", n / kRows * nsb * rb, " bytes");
    out = out_arg->view({n / kRows, nsb * rb});
  } else {
    out = at::empty({n / kRows, nsb * rb}, blocks.options());
  }
  uint8_t* w = const_cast<uint8_t*>(blocks.data_ptr<uint8_t>());  // read only (to_record)
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, n / kRows, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t sb = 0; sb < nsb; ++sb) {
        uint8_t* rows[kRows];
        for (int i = 0; i < kRows; ++i) rows[i] = w + (g * kRows + i) * rs + sb * bb;
        convert(t, true, o + (g * nsb + sb) * rb, rows);
      }
  });
  return out;
}

// The inverse: uint8 [N / 16, K / 256 * record] -> the file's blocks uint8 [N, K / 256 * bytes], bit for bit.
at::Tensor kquant_r16_unpack(const at::Tensor& packed, const std::string& weight_type) {
  const Type t = pagedllm_cpu::parse_kquant(weight_type, "kquant_r16_unpack");
  const int64_t bb = pagedllm_cpu::kquant_bytes(t), rb = record_bytes(t);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous() &&
                  packed.size(1) % rb == 0,
              "kquant_r16_unpack: packed must be contiguous uint8 [N / 16, K / 256 * ", rb, "]");
  const int64_t groups = packed.size(0), nsb = packed.size(1) / rb;
  at::Tensor out = at::empty({groups * kRows, nsb * bb}, packed.options());
  uint8_t* p = const_cast<uint8_t*>(packed.data_ptr<uint8_t>());  // read only (!to_record)
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t sb = 0; sb < nsb; ++sb) {
        uint8_t* rows[kRows];
        for (int i = 0; i < kRows; ++i) rows[i] = o + (g * kRows + i) * nsb * bb + sb * bb;
        convert(t, false, p + (g * nsb + sb) * rb, rows);
      }
  });
  return out;
}

// One row of x [k] as the dot products see it: hi int8 [k], lo uint8 [k] (zero for one term), d fp32 [k / 32] and
// the sums of v per 16 values as fp32 [k / 16] (exact integers), x ~ d * (128 hi + lo) = d * v. Two terms: a scale
// per 32 values (a Q4_K sub-block; an outlier coarsens only its own 32); one term: llama.cpp's Q8_K, a scale per
// 256 (repeated per 32 here).
void quantize_row(const float* x, int64_t k, int terms, int8_t* hi, uint8_t* lo, float* d, float* sums) {
  const int64_t unit = terms == 1 ? kQK : 32;
  for (int64_t b = 0; b < k / unit; ++b) {
    const float* xb = x + b * unit;
    int8_t* h = hi + b * unit;
    uint8_t* l = lo + b * unit;
    int v[kQK];
    float scale = 0.f;
    if (terms == 1) {
      int8_t q[kQK];
      scale = pagedllm_cpu::quantize_q8k_block(xb, q);
      std::copy(q, q + kQK, v);
    } else {
      float amax = 0.f;
      for (int j = 0; j < unit; ++j) amax = std::max(amax, std::fabs(xb[j]));
      std::fill(v, v + unit, 0);
      if (amax != 0.f) {
        const float iscale = kLevels / amax;
        for (int j = 0; j < unit; ++j)
          v[j] = std::max(-static_cast<int>(kLevels), std::min(static_cast<int>(kLevels), nearest_int(iscale * xb[j])));
        scale = amax / kLevels;
      }
    }
    for (int j = 0; j < unit / 32; ++j) d[b * (unit / 32) + j] = scale;
    for (int j = 0; j < unit; ++j) {
      h[j] = static_cast<int8_t>(terms == 1 ? v[j] : v[j] >> 7);  // arithmetic shift: floor
      l[j] = static_cast<uint8_t>(terms == 1 ? 0 : v[j] & 127);
    }
    for (int s = 0; s < unit / 16; ++s) {
      int sum = 0;
      for (int j = 0; j < 16; ++j) sum += v[16 * s + j];
      sums[b * (unit / 16) + s] = static_cast<float>(sum);
    }
  }
}

struct XQ {
  const int8_t* hi;
  const uint8_t* lo;
  const float* d;
  const float* xm;  // per 32 values: d * (sum of v), what the sub-block's min multiplies (Q4_K, Q5_K)
  const float* x6;  // per 16 values: 32 * d * (sum of v), Q6_K's -32 on them
  int64_t k;
};

#ifdef PAGEDLLM_R16_X86
// Q4_K reads a record in address order: each line kPrefetch ahead into L1 (measured the same as none, 29 GB/s on the
// 1.7B model's 24 layers of Q4_K shapes from DRAM on 2 threads). Q6_K reads three interleaved streams of a record, so
// it asks for a record ahead in address order instead (its shapes: 74.5 ms with each stream's line 2 KB ahead,
// 55-57 ms; half a record or two ahead alike then). Two records ahead since its loop takes ~330 cycles a record, not
// ~460: one record is then ~90 ns, under the VM's DRAM latency (LM head 2.60 -> 2.23 ms, one ahead 2.32, at 34 GB/s).
// Beside those L1 requests, every type asks for the record kL2Records ahead into L2, in the same order: the L1
// requests alone keep too few lines in flight to cover DRAM's latency (a core's compute and reads barely overlapped:
// the Q6_K LM head read 26-35 GB/s from DRAM against ~50 streaming). From DRAM, 2 threads (AMD EPYC Zen 4), alternated:
// the Q6_K head shape 25.9 -> 38.3 GB/s (3 records ahead 30.1, 6: 36.6, 8: 34.2), a Q4_K one of the same rows 27.3 ->
// 30.1 (2: 29.7, 6: 25.8); the 1.7B Q4_K_M's decode step 32.2 -> 27.7 ms (10 alternated pairs, docs/benchmarks.md).
constexpr int64_t kPrefetch = 2048;
constexpr int64_t kQ6Ahead = 2 * kQ6Rec;
constexpr int64_t kL2Records = 4;

PAGEDLLM_R16_TVNNI inline __m512i bcast(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

PAGEDLLM_R16_TVNNI inline __m512 scales_f32(const uint8_t* p, bool is_signed) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
}

// 128 * hi_sum + lo_sum (TERMS 2) or hi_sum, as fp32 (exact: below 2^24).
template <int TERMS>
PAGEDLLM_R16_TVNNI inline __m512 joined(__m512i h, __m512i l) {
  return _mm512_cvtepi32_ps(TERMS == 2 ? _mm512_add_epi32(_mm512_slli_epi32(h, 7), l) : h);
}

// Keeps a loaded vector in a register: GCC otherwise folds the load into each instruction that uses it (Q4_K's
// and + shift read a chunk twice, Q6_K's up to four times), and the loads, not the ALU, then set the pace: one core
// ran a Q4_K super-block in ~240 cycles with the folded loads, ~211 without; Q6_K ~371 and ~337.
PAGEDLLM_R16_TVNNI inline void in_register(__m512i& v) { asm("" : "+v"(v)); }

// Prefetches are ``prefetch_line`` (cpu_common.h), kept in program order: with Q6_K's loops unrolled the intrinsic's
// were all issued at a super-block's start (the 1.7B model's LM head 2.4 -> 4.7 ms from DRAM).
using pagedllm_cpu::prefetch_line;
using pagedllm_cpu::prefetch_line_l2;

// quantize_row's two terms, 32 values a step in AVX-512 (the same operations: fp32 max, fp32 product, round half to
// even, so the same bits): ~10x the scalar loop, which cost ~1 ms of a 1.7B decode token.
PAGEDLLM_R16_TVNNI void quantize_row2_avx512(const float* x, int64_t k, int8_t* hi, uint8_t* lo, float* d,
                                             float* sums) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  const __m512i lim = _mm512_set1_epi32(static_cast<int>(kLevels)), m127 = _mm512_set1_epi32(127);
  for (int64_t b = 0; b < k / 32; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1)));
    __m512i v0 = _mm512_setzero_si512(), v1 = v0;
    d[b] = 0.f;
    if (amax != 0.f) {
      const __m512 is = _mm512_set1_ps(kLevels / amax);
      v0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, is));  // MXCSR's default: round half to even
      v1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, is));
      v0 = _mm512_max_epi32(_mm512_min_epi32(v0, lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
      v1 = _mm512_max_epi32(_mm512_min_epi32(v1, lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
      d[b] = amax / kLevels;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + 32 * b), _mm512_cvtepi32_epi8(_mm512_srai_epi32(v0, 7)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + 32 * b + 16), _mm512_cvtepi32_epi8(_mm512_srai_epi32(v1, 7)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + 32 * b), _mm512_cvtepi32_epi8(_mm512_and_si512(v0, m127)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + 32 * b + 16), _mm512_cvtepi32_epi8(_mm512_and_si512(v1, m127)));
    sums[2 * b] = static_cast<float>(_mm512_reduce_add_epi32(v0));
    sums[2 * b + 1] = static_cast<float>(_mm512_reduce_add_epi32(v1));
  }
}

// The 16 rows' sums over super-block sb of one row of x, x's scales applied (dx: one per 32 values), before the
// weights' d and dmin: S = sum(sc * dot) and M = sum(m * xm). Two chains each (sub-blocks 2c and 2c + 1; mins of even
// and odd sub-blocks) in registers, the mins' products on x precomputed per call (xm): with the rows' sums in registers
// (``group``) ~15% fewer cycles a super-block than through memory, the dot products' 128 vpdpbusd being the floor.
template <int TERMS, bool Q5>
PAGEDLLM_R16_TVNNI inline void q4k_superblock(const uint8_t* r, const int8_t* h, const uint8_t* l, const float* dx,
                                              const float* xm, __m512& S, __m512& M) {
  const __m512i m4 = _mm512_set1_epi8(0xF);
  __m512 S0 = _mm512_setzero_ps(), S1 = S0;
  for (int c = 0; c < 4; ++c) {  // sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles)
    __m512i aH = _mm512_setzero_si512(), aL = aH, bH = aH, bL = aH;
    for (int t = 0; t < 8; ++t) {
      const uint8_t* q = r + 320 + 64 * (8 * c + t);
      if (Q5) {  // its fifth bits (the record's end) are read with each chunk: the next record in address order
        const uint8_t* ahead = r + kQ5Rec + 128 * (8 * c + t);
        prefetch_line(ahead);
        prefetch_line(ahead + 64);
        prefetch_line_l2(ahead + (kL2Records - 1) * kQ5Rec);
        prefetch_line_l2(ahead + (kL2Records - 1) * kQ5Rec + 64);
      } else {
        prefetch_line(q + kPrefetch);
        prefetch_line_l2(q + kL2Records * kQ4Rec);
      }
      __m512i v = _mm512_loadu_si512(q);
      in_register(v);
      // Q4_K's high nibbles stay in place (16 q: one op, not a shift and a mask), their sub-block's sums shifted
      // back below (exact); Q5_K's take the fifth bit as bit 4, so they come down
      __m512i q0 = _mm512_and_si512(v, m4);
      __m512i q1 = Q5 ? _mm512_and_si512(_mm512_srli_epi16(v, 4), m4) : _mm512_andnot_si512(m4, v);
      if (Q5) {  // bit 2c (2c + 1) of the chunk's fifth-bit bytes is bit 4 of its low (high) nibbles' weights
        const uint8_t* qh = r + kQ4Rec + 64 * t;
        const __m512i hv = _mm512_loadu_si512(qh), b4 = _mm512_set1_epi8(0x10);
        const __m512i h0 = c < 2 ? _mm512_slli_epi16(hv, 4 - 2 * c) : _mm512_srli_epi16(hv, 2 * c - 4);
        const __m512i h1 = c < 2 ? _mm512_slli_epi16(hv, 3 - 2 * c) : _mm512_srli_epi16(hv, 2 * c - 3);
        q0 = _mm512_or_si512(q0, _mm512_and_si512(h0, b4));
        q1 = _mm512_or_si512(q1, _mm512_and_si512(h1, b4));
      }
      const int64_t o = 64 * c + 4 * t;
      aH = _mm512_dpbusd_epi32(aH, q0, bcast(h + o));
      bH = _mm512_dpbusd_epi32(bH, q1, bcast(h + o + 32));
      if (TERMS == 2) {  // lo (0..127) as the signed operand: the weights, up to 240 here, as the unsigned one
        aL = _mm512_dpbusd_epi32(aL, q0, bcast(l + o));
        bL = _mm512_dpbusd_epi32(bL, q1, bcast(l + o + 32));
      }
    }
    const __m512 s0 = _mm512_mul_ps(scales_f32(r + 64 + 32 * c, false), _mm512_set1_ps(dx[2 * c]));
    const __m512 s1 = _mm512_mul_ps(scales_f32(r + 64 + 32 * c + 16, false), _mm512_set1_ps(dx[2 * c + 1]));
    S0 = _mm512_fmadd_ps(joined<TERMS>(aH, aL), s0, S0);
    if (Q5) {
      S1 = _mm512_fmadd_ps(joined<TERMS>(bH, bL), s1, S1);
    } else {  // 16 times the sums (below 2^28: int32), every product a multiple of 16: the shift is exact
      const __m512i j = TERMS == 2 ? _mm512_add_epi32(_mm512_slli_epi32(bH, 7), bL) : bH;
      S1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(j, 4)), s1, S1);
    }
  }
  __m512 M0 = _mm512_setzero_ps(), M1 = M0;
  for (int s = 0; s < 8; s += 2) {
    M0 = _mm512_fmadd_ps(scales_f32(r + 192 + 16 * s, false), _mm512_set1_ps(xm[s]), M0);
    M1 = _mm512_fmadd_ps(scales_f32(r + 192 + 16 * s + 16, false), _mm512_set1_ps(xm[s + 1]), M1);
  }
  S = _mm512_add_ps(S0, S1);
  M = _mm512_add_ps(M0, M1);
}

// Q6_K: (q - 32) per weight, the -32 taken off as x6 = 32 * d * the sum of v per sub-block of 16 (one fmsub with
// x's scale, then the sub-block's: ~4% fewer cycles than a subtraction and two multiplies).
template <int TERMS>
PAGEDLLM_R16_TVNNI __m512 q6k_superblock(const uint8_t* r, const int8_t* h, const uint8_t* l, const float* dx,
                                         const float* x6) {
  const __m512i m4 = _mm512_set1_epi8(0xF), m03 = _mm512_set1_epi8(0x03), m0c = _mm512_set1_epi8(0x0C),
                m30 = _mm512_set1_epi8(0x30);
  __m512 S = _mm512_setzero_ps();
  // Unrolled: as loops GCC kept two of the eight accumulators on the stack, a store and a reload in their chains
  // (~430 cycles a super-block on one core against ~365 unrolled).
#pragma GCC unroll 2
  for (int n = 0; n < 2; ++n)
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      __m512i aH[4], aL[4];
      for (int j = 0; j < 4; ++j) aH[j] = aL[j] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int t = 4 * half; t < 4 * half + 4; ++t) {
        const uint8_t* p0 = r + 288 + 64 * (16 * n + t);
        const uint8_t* p1 = p0 + 64 * 8;
        const uint8_t* ph = r + 2336 + 64 * (8 * n + t);
        for (int o = 0; o < 256; o += 64) {  // two records ahead into L1, kL2Records into L2, in address order
          prefetch_line(r + kQ6Ahead + 256 * (8 * n + t) + o);
          prefetch_line_l2(r + kL2Records * kQ6Rec + 256 * (8 * n + t) + o);
        }
        __m512i v0 = _mm512_loadu_si512(p0), v1 = _mm512_loadu_si512(p1), hv = _mm512_loadu_si512(ph);
        in_register(v0);
        in_register(v1);
        in_register(hv);
        __m512i w[4];
        w[0] = _mm512_or_si512(_mm512_and_si512(v0, m4), _mm512_slli_epi16(_mm512_and_si512(hv, m03), 4));
        w[1] = _mm512_or_si512(_mm512_and_si512(v1, m4), _mm512_slli_epi16(_mm512_and_si512(hv, m0c), 2));
        w[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v0, 4), m4), _mm512_and_si512(hv, m30));
        w[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v1, 4), m4),
                               _mm512_and_si512(_mm512_srli_epi16(hv, 2), m30));
        for (int j = 0; j < 4; ++j) {
          const int64_t o = 128 * n + 32 * j + 4 * t;
          aH[j] = _mm512_dpbusd_epi32(aH[j], w[j], bcast(h + o));
          if (TERMS == 2) aL[j] = _mm512_dpbusd_epi32(aL[j], w[j], bcast(l + o));
        }
      }
      for (int j = 0; j < 4; ++j) {
        const int s = 8 * n + 2 * j + half;  // sub-block of 16
        const __m512 dot =
            _mm512_fmsub_ps(joined<TERMS>(aH[j], aL[j]), _mm512_set1_ps(dx[s / 2]), _mm512_set1_ps(x6[s]));
        S = _mm512_fmadd_ps(dot, scales_f32(r + 32 + 16 * s, true), S);
      }
    }
  return S;
}

// Super-block r of one row of x (h, l, dx, xm, x6 at the super-block) into the 16 rows' sums of d * S (acc) and of
// dmin * M (accm, Q4_K and Q5_K), kept apart until the row's end.
template <int TERMS>
PAGEDLLM_R16_TVNNI inline void superblock(Type t, const uint8_t* r, const int8_t* h, const uint8_t* l, const float* dx,
                                          const float* xm, const float* x6, __m512& acc, __m512& accm) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r)));
  if (t == kQ6K) {
    acc = _mm512_fmadd_ps(d, q6k_superblock<TERMS>(r, h, l, dx, x6), acc);
    return;
  }
  __m512 S, M;
  if (t == kQ5K)
    q4k_superblock<TERMS, true>(r, h, l, dx, xm, S, M);
  else
    q4k_superblock<TERMS, false>(r, h, l, dx, xm, S, M);
  acc = _mm512_fmadd_ps(d, S, acc);
  accm = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 32))), M, accm);
}

// Output rows g*16 .. g*16 + 15 for every row of x: y[m * ys + 0..15]. One row keeps its sums in registers; more rows
// take each record once for all of them (one read from DRAM), their sums in memory. The same operations per row either
// way, so a row's outputs do not depend on how many rows share the call.
template <int TERMS>
PAGEDLLM_R16_TVNNI void group(Type t, const uint8_t* w, int64_t nsb, const XQ& x, int64_t mrows, float* y,
                              int64_t ys) {
  const int64_t rb = record_bytes(t);
  auto row = [&](int64_t m, int64_t sb, __m512& acc, __m512& accm) {
    superblock<TERMS>(t, w + sb * rb, x.hi + m * x.k + sb * kQK, x.lo + m * x.k + sb * kQK,
                      x.d + m * (x.k / 32) + sb * 8, x.xm + m * (x.k / 32) + sb * 8, x.x6 + m * (x.k / 16) + sb * 16,
                      acc, accm);
  };
  if (mrows == 1) {
    __m512 acc = _mm512_setzero_ps(), accm = acc;
    for (int64_t sb = 0; sb < nsb; ++sb) row(0, sb, acc, accm);
    _mm512_storeu_ps(y, _mm512_sub_ps(acc, accm));
    return;
  }
  float small[2 * 8 * kRows];  // (no allocation per group for decode-sized calls)
  std::vector<float> large(mrows > 8 ? 2 * mrows * kRows : 0);
  float* const sums = mrows > 8 ? large.data() : small;  // acc of row m at 2m * 16, accm after it
  std::fill(sums, sums + 2 * mrows * kRows, 0.f);
  for (int64_t sb = 0; sb < nsb; ++sb)
    for (int64_t m = 0; m < mrows; ++m) {
      float* a = sums + 2 * m * kRows;
      __m512 acc = _mm512_loadu_ps(a), accm = _mm512_loadu_ps(a + kRows);
      row(m, sb, acc, accm);
      _mm512_storeu_ps(a, acc);
      _mm512_storeu_ps(a + kRows, accm);
    }
  for (int64_t m = 0; m < mrows; ++m)
    _mm512_storeu_ps(y + m * ys, _mm512_sub_ps(_mm512_loadu_ps(sums + 2 * m * kRows),
                                               _mm512_loadu_ps(sums + 2 * m * kRows + kRows)));
}
#endif

bool have_vnni() {
  static const bool vnni = pagedllm_cpu::cpu_avx512_vnni();
  return vnni;
}

// One row of x as ``quantize_row`` does it, two terms in AVX-512 where the CPU has it.
void quantize(const float* x, int64_t k, int64_t terms, int8_t* hi, uint8_t* lo, float* d, float* sums) {
#ifdef PAGEDLLM_R16_X86
  if (terms == 2 && have_vnni()) return quantize_row2_avx512(x, k, hi, lo, d, sums);
#endif
  quantize_row(x, k, static_cast<int>(terms), hi, lo, d, sums);
}

// x [..., K] (K a multiple of 256, any float dtype) as the kernel sees it: (hi int8 [M, K], lo uint8 [M, K], d fp32
// [M, K / 32], sums fp32 [M, K / 16]) with x ~ d * (128 hi + lo) (terms 2) or d * hi (terms 1), d per 32 values. For
// tests.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> kquant_r16_quantize(const at::Tensor& x, int64_t terms) {
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "kquant_r16_quantize: x must be floating point");
  TORCH_CHECK(terms == 1 || terms == 2, "kquant_r16_quantize: terms must be 1 or 2, got ", terms);
  const int64_t k = x.size(-1);
  TORCH_CHECK(k % kQK == 0, "kquant_r16_quantize: K = ", k, " is not a multiple of 256");
  const at::Tensor rows = x.reshape({-1, k}).to(at::kFloat).contiguous();
  const int64_t m = rows.size(0);
  at::Tensor hi = at::empty({m, k}, rows.options().dtype(at::kChar));
  at::Tensor lo = at::empty({m, k}, rows.options().dtype(at::kByte));
  at::Tensor d = at::empty({m, k / 32}, rows.options());
  at::Tensor sums = at::empty({m, k / 16}, rows.options());
  const float* xp = rows.data_ptr<float>();
  int8_t* hp = hi.data_ptr<int8_t>();
  uint8_t* lp = lo.data_ptr<uint8_t>();
  float* dp = d.data_ptr<float>();
  float* sp = sums.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) quantize(xp + i * k, k, terms, hp + i * k, lp + i * k, dp + i * (k / 32),
                                                   sp + i * (k / 16));
  });
  return {hi, lo, d, sums};
}

// One packed matrix of a call: its type, records and output columns.
struct Part {
  Type t;
  const uint8_t* w;
  int64_t groups;
  int64_t col;  // its first output column in y
};

// y [M, N] = x @ W.T over the parts' groups of 16 rows (each part's rows at its columns), x [M, K] fp32 quantized
// once. One parallel region for all parts, each thread a contiguous run of their groups holding an even share of the
// bytes (groups differ in size by type): each call's streams start cold and its threads meet at its end, so a
// Q4_K_M's q, k and v (Q4_K, Q4_K, Q6_K) read 1.7-4.2% faster from DRAM as one call than as three.
at::Tensor r16_gemv(const at::Tensor& x, const std::vector<Part>& parts, int64_t n, int64_t terms) {
  const int64_t k = x.size(-1), nsb = k / kQK;
  const at::Tensor rows = x.reshape({-1, k}).to(at::kFloat).contiguous();
  const int64_t mrows = rows.size(0);
  // x quantized into buffers kept by the calling thread (a decode step makes ~170 of these calls)
  thread_local std::vector<int8_t> hi;
  thread_local std::vector<uint8_t> lo;
  thread_local std::vector<float> d, sums, xm, x6;
  hi.resize(mrows * k);
  lo.resize(mrows * k);
  d.resize(mrows * k / 32);
  sums.resize(mrows * k / 16);
  xm.resize(mrows * k / 32);
  x6.resize(mrows * k / 16);
  const float* xp = rows.data_ptr<float>();
  for (int64_t i = 0; i < mrows; ++i)
    quantize(xp + i * k, k, terms, hi.data() + i * k, lo.data() + i * k, d.data() + i * (k / 32),
             sums.data() + i * (k / 16));
  for (int64_t s = 0; s < mrows * k / 32; ++s) xm[s] = d[s] * (sums[2 * s] + sums[2 * s + 1]);
  for (int64_t s = 0; s < mrows * k / 16; ++s) x6[s] = 32.f * d[s / 2] * sums[s];
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  at::Tensor y = at::empty({mrows, n}, rows.options());
  const XQ xq{hi.data(), lo.data(), d.data(), xm.data(), x6.data(), k};
  float* yp = y.data_ptr<float>();
#ifdef PAGEDLLM_R16_X86
  // the parts' groups one after another: part j's are first[j] .. first[j + 1] - 1, after bytes[j] bytes
  std::vector<int64_t> first(parts.size() + 1, 0), bytes(parts.size() + 1, 0);
  for (size_t j = 0; j < parts.size(); ++j) {
    first[j + 1] = first[j] + parts[j].groups;
    bytes[j + 1] = bytes[j] + parts[j].groups * nsb * record_bytes(parts[j].t);
  }
  const int64_t total = first.back();
  if (nsb == 0 || total == 0) return y.zero_().view(shape).to(x.scalar_type());  // K = 0: empty sums
  auto group_at = [&](int64_t b) {  // the first group starting at byte b or after it
    size_t j = 0;
    while (j + 1 < parts.size() && bytes[j + 1] <= b) ++j;
    const int64_t gb = nsb * record_bytes(parts[j].t);
    return std::min(first[j + 1], first[j] + (b - bytes[j] + gb - 1) / gb);
  };
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total));
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t th = t0; th < t1; ++th) {
      const int64_t g1 = th + 1 == nt ? total : group_at(bytes.back() * (th + 1) / nt);
      size_t j = 0;
      for (int64_t i = group_at(bytes.back() * th / nt); i < g1; ++i) {
        while (i >= first[j + 1]) ++j;
        const Part& pt = parts[j];
        const int64_t g = i - first[j], rb = record_bytes(pt.t);
        float* yg = yp + pt.col + g * kRows;
        if (terms == 2)
          group<2>(pt.t, pt.w + g * nsb * rb, nsb, xq, mrows, yg, n);
        else
          group<1>(pt.t, pt.w + g * nsb * rb, nsb, xq, mrows, yg, n);
      }
    }
  });
#endif
  return y.view(shape).to(x.scalar_type());
}

Part checked_part(const at::Tensor& packed, const std::string& weight_type, int64_t k, int64_t col, const char* op) {
  const Type t = pagedllm_cpu::parse_kquant(weight_type, op);
  const int64_t nsb = k / kQK, rb = record_bytes(t);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous() && k % kQK == 0 &&
                  packed.size(1) == nsb * rb,
              op, ": packed must be contiguous uint8 [N / 16, K / 256 * ", rb, "] for K = ", k);
  return Part{t, packed.data_ptr<uint8_t>(), packed.size(0), col};
}

void check_call(int64_t terms, const char* op) {
  TORCH_CHECK(have_vnni(), op, ": needs AVX-512 VNNI (this CPU has none: kquant_gemv runs instead)");
  TORCH_CHECK(terms == 1 || terms == 2, op, ": terms must be 1 or 2, got ", terms);
}

// x [..., K] (read as fp32), packed from ``kquant_r16_repack``: y [..., N] in x's dtype.
at::Tensor kquant_r16_gemv(const at::Tensor& x, const at::Tensor& packed, const std::string& weight_type,
                           int64_t terms) {
  check_call(terms, "kquant_r16_gemv");
  const Part p = checked_part(packed, weight_type, x.size(-1), 0, "kquant_r16_gemv");
  return r16_gemv(x, {p}, p.groups * kRows, terms);
}

// The parts of one fused linear (packed[i] of weight_types[i], all over the same K), outputs joined along N: the
// same bits as each part's ``kquant_r16_gemv`` joined, in one call.
at::Tensor kquant_r16_gemv_joined(const at::Tensor& x, const std::vector<at::Tensor>& packed,
                                  const std::vector<std::string>& weight_types, int64_t terms) {
  check_call(terms, "kquant_r16_gemv_joined");
  TORCH_CHECK(!packed.empty() && packed.size() == weight_types.size(), "kquant_r16_gemv_joined: ", packed.size(),
              " packed parts for ", weight_types.size(), " weight types");
  std::vector<Part> parts;
  int64_t n = 0;
  for (size_t j = 0; j < packed.size(); ++j) {
    parts.push_back(checked_part(packed[j], weight_types[j], x.size(-1), n, "kquant_r16_gemv_joined"));
    n += parts.back().groups * kRows;
  }
  return r16_gemv(x, parts, n, terms);
}

bool kquant_r16_available() { return have_vnni(); }

}  // namespace

at::Tensor pagedllm_cpu::kernels::kquant_r16_gemv(const at::Tensor& x, const at::Tensor& packed,
                                                 const std::string& weight_type, int64_t terms) {
  return ::kquant_r16_gemv(x, packed, weight_type, terms);
}

at::Tensor pagedllm_cpu::kernels::kquant_r16_gemv_joined(const at::Tensor& x, const std::vector<at::Tensor>& packed,
                                                        const std::vector<std::string>& weight_types, int64_t terms) {
  return ::kquant_r16_gemv_joined(x, packed, weight_types, terms);
}

int64_t pagedllm_cpu::kernels::kquant_r16_record_bytes(int type) { return record_bytes(static_cast<Type>(type)); }

void pagedllm_cpu::kernels::kquant_r16_to_blocks(int type, const uint8_t* record, uint8_t* blocks) {
  const Type t = static_cast<Type>(type);
  uint8_t* rows[kRows];
  for (int i = 0; i < kRows; ++i) rows[i] = blocks + i * pagedllm_cpu::kquant_bytes(t);
  convert(t, false, const_cast<uint8_t*>(record), rows);  // read only (!to_record)
}

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("kquant_r16_gemv(Tensor x, Tensor packed, str weight_type, int terms=2) -> Tensor");
  m.def("kquant_r16_gemv_joined(Tensor x, Tensor[] packed, str[] weight_types, int terms=2) -> Tensor");
  m.def("kquant_r16_repack(Tensor blocks, str weight_type, Tensor(a!)? out=None) -> Tensor");
  m.def("kquant_r16_unpack(Tensor packed, str weight_type) -> Tensor");
  m.def("kquant_r16_quantize(Tensor x, int terms=2) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("kquant_r16_available() -> bool", &kquant_r16_available);
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("kquant_r16_gemv", &kquant_r16_gemv);
  m.impl("kquant_r16_gemv_joined", &kquant_r16_gemv_joined);
  m.impl("kquant_r16_repack", &kquant_r16_repack);
  m.impl("kquant_r16_unpack", &kquant_r16_unpack);
  m.impl("kquant_r16_quantize", &kquant_r16_quantize);
}
