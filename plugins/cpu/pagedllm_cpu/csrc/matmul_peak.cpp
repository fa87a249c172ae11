// The CPU's bf16 peak behind ``pagedllm bench throughput --gemm-ceiling``: at batch 64 a decode step's linear layers
// are bf16 GEMMs, compute-bound on a CPU, so what its bf16 unit can do at most bounds them. ``matmul_peak(seconds)``
// runs bf16 dot products on every thread at once for about ``seconds`` and returns the FLOP/s they did together in
// TFLOP/s: AMX tile dot products (``tdpbf16ps``, 16 x 16 x 32 a call, four independent accumulator tiles) where the
// CPU has AMX-BF16 and the kernel grants the tile state (Linux's ARCH_REQ_XCOMP_PERM), else AVX512-BF16 vector dot
// products (``vdpbf16ps``, 16 independent accumulators, more than its latency times its rate), else 0. Operands stay
// in registers: what no GEMM can beat, memory aside. Measured on a 2-core VM's Xeon: AMX 1.1-2.9 TFLOP/s a core
// minutes apart (a shared host; cause not determined), so the bench measures it beside its run; on a Zen 4 EPYC
// (no AMX) one ``vdpbf16ps`` a cycle a core, 0.47 TFLOP/s on 2 threads.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_common.h"

// AMX intrinsics: GCC 11+, clang 12+; older compilers build the library without the probe (it returns 0).
#if defined(PAGEDLLM_CPU_X86) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PAGEDLLM_AMX 1
#endif
// AVX512-BF16 intrinsics: GCC 10+, clang 9+.
#if defined(PAGEDLLM_CPU_X86) && \
    ((defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10))
#define PAGEDLLM_AVX512_BF16 1
#endif

namespace {

#ifdef PAGEDLLM_AMX
constexpr int kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an XSAVE feature's state
constexpr int kXfeatureXtiledata = 18;     // AMX tile data

bool amx_usable() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = d & (1u << 24), bf16 = d & (1u << 22);
  return tile && bf16 && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// ``calls`` rounds of 4 tile dot products; 16 x 16 x 32 multiply-adds each.
__attribute__((target("amx-tile,amx-bf16"))) void tile_dots(int64_t calls) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  alignas(64) static const uint16_t operand[16 * 32] = {};  // zeros: the unit's timing does not depend on values
  // GCC does not see ldtilecfg read the struct and drops the stores above (measured: a #GP, SIGSEGV); the barrier
  // makes them happen.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, operand, 64);
  _tile_loadd(5, operand, 64);
  _tile_loadd(6, operand, 64);
  _tile_loadd(7, operand, 64);
  for (int64_t i = 0; i < calls; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_release();
}
#endif

#ifdef PAGEDLLM_AVX512_BF16
bool avx512_bf16_usable() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
}

// ``calls`` rounds of 16 vector dot products; 16 lanes x 2 bf16 multiply-adds each. The accumulators start apart so
// the compiler cannot fold their identical chains into one (it did, and reported twice the rate).
__attribute__((target("avx512f,avx512bf16"))) float vector_dots(int64_t calls) {
  constexpr int kChains = 16;
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3c00);  // 1.0, 2^-7
  for (int64_t c = 0; c < calls; ++c) {
#pragma GCC unroll 16
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], x, y);
    asm volatile("" : "+v"(x));  // x may have changed: no hoisting across rounds
  }
  __m512 sum = acc[0];
  for (int i = 1; i < kChains; ++i) sum = _mm512_add_ps(sum, acc[i]);
  return _mm512_reduce_add_ps(sum);
}
#endif

// Runs ``batch()`` on every thread until ``seconds`` have passed; the FLOP/s of them all, in TFLOP/s.
template <class F>
double run_on_all_threads(double seconds, double flops_a_batch, F batch) {
  const int threads = at::get_num_threads();
  std::atomic<int64_t> batches{0};
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t done = 0;
      do {
        batch();
        ++done;
      } while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < seconds);
      batches.fetch_add(done, std::memory_order_relaxed);
    }
  });
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return batches.load() * flops_a_batch / elapsed / 1e12;
}

double matmul_peak(double seconds) {
  constexpr int64_t kCalls = 1 << 14;  // ~0.1-0.3 ms a batch per thread
#ifdef PAGEDLLM_AMX
  if (amx_usable()) return run_on_all_threads(seconds, 4.0 * 2 * 16 * 16 * 32 * kCalls, [] { tile_dots(kCalls); });
#endif
#ifdef PAGEDLLM_AVX512_BF16
  if (avx512_bf16_usable()) {
    std::atomic<float> sink{0.f};  // the chains' sum is used, so they are computed
    const double tflops = run_on_all_threads(seconds, 16.0 * 2 * 32 * kCalls, [&] {
      sink.store(vector_dots(kCalls), std::memory_order_relaxed);
    });
    return std::isfinite(sink.load()) ? tflops : 0.0;
  }
#endif
  (void)seconds;
  return 0.0;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) { m.def("matmul_peak(float seconds=0.5) -> float", &matmul_peak); }
