// What several kernels share: the SIMD levels the running CPU has, fp16 bits to float, ggml's rounding, GGUF K-quant
// super-block types, and the software prefetch of a block's bytes a fixed distance ahead. Header-only (inline): each
// kernel file stays one translation unit with its own anonymous namespace.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PAGEDLLM_CPU_X86 1
#endif

namespace pagedllm_cpu {

// AVX-512 F/BW/VL/DQ (the kernels' AVX-512 paths), and AVX2 + FMA + F16C (their AVX2 paths), on the running CPU.
inline bool cpu_avx512() {
#ifdef PAGEDLLM_CPU_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

inline bool cpu_avx2() {
#ifdef PAGEDLLM_CPU_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

inline bool cpu_avx512_vnni() {
#ifdef PAGEDLLM_CPU_X86
  return cpu_avx512() && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// fp16 bits at an unaligned address to float, in software (the portable paths).
inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// ggml's nearest_int: round half to even through the float adder (|v| < 2^22), as llama.cpp's quantizers round.
inline int nearest_int(float v) {
  float f = v + 12582912.f;
  int32_t i;
  std::memcpy(&i, &f, 4);
  return (i & 0x007fffff) - 0x00400000;
}

// 256 values to llama.cpp's Q8_K (``quantize_row_q8_K_ref``): q = round(x * -127 / max) with max the value of the
// largest magnitude, at most 127; returns the scale d (x ~ d * q; 0 for an all-zero block). kquant_q8k.cpp's int8
// activations and kquant_r16.cpp's one term.
inline float quantize_q8k_block(const float* x, int8_t* q) {
  float amax = 0.f, max = 0.f;
  for (int j = 0; j < 256; ++j) {
    const float a = std::fabs(x[j]);
    if (a > amax) {
      amax = a;
      max = x[j];
    }
  }
  if (amax == 0.f) {
    std::memset(q, 0, 256);
    return 0.f;
  }
  const float iscale = -127.f / max;
  for (int j = 0; j < 256; ++j) q[j] = static_cast<int8_t>(std::min(127, nearest_int(iscale * x[j])));
  return 1.f / iscale;
}

// GGUF K-quant super-blocks of 256 weights: Q4_K 144 bytes, Q5_K 176, Q6_K 210.
enum KQuant { kQ4K = 0, kQ5K = 1, kQ6K = 2 };

inline int64_t kquant_bytes(KQuant t) { return t == kQ4K ? 144 : t == kQ5K ? 176 : 210; }

inline KQuant parse_kquant(const std::string& s, const char* op) {
  if (s == "Q4_K") return kQ4K;
  if (s == "Q5_K") return kQ5K;
  TORCH_CHECK(s == "Q6_K", op, ": weight_type must be Q4_K, Q5_K or Q6_K, got ", s);
  return kQ6K;
}

#ifdef PAGEDLLM_CPU_X86
// Every cache line of [p + Ahead, p + Ahead + bytes) into L1: at a few rows of x a weight-streaming loop is too short
// for the hardware prefetcher alone to keep DRAM busy. Past the end of the weights it is a no-op (prefetches never
// fault). Each kernel measured its own distance (see its kPrefetch).
template <int64_t Ahead>
inline void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + Ahead + o), _MM_HINT_T0);
}

// The line at p into L1, where the code says: GCC moves the intrinsic's prefetch freely, and in a fully unrolled loop
// (kquant_r16.cpp's Q6_K) it issued a super-block's 52 requests at its start, which halved that kernel's speed from
// DRAM. The loops of ``prefetch_ahead``'s callers are not unrolled that way and keep the intrinsic (not re-measured).
inline void prefetch_line(const uint8_t* p) { asm volatile("prefetcht0 %0" ::"m"(*p)); }

// The line at p into L2 (``prefetcht1``), in program order likewise: a request far enough ahead that DRAM's latency is
// covered, which the L1 requests a line or two ahead cannot do alone (see kquant_r16.cpp's kL2Records).
inline void prefetch_line_l2(const uint8_t* p) { asm volatile("prefetcht1 %0" ::"m"(*p)); }
#endif

}  // namespace pagedllm_cpu
