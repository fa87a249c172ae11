// The streaming-read bandwidth probe behind ``pagedllm bench latency``'s decode floor: batch-1 decode reads every
// weight byte once per token and writes almost nothing, so its bound is read bandwidth, not the read + write of a
// copy. ``stream_read(buf)`` XORs every 64-bit word of a contiguous buffer (the caller makes it several times the
// last-level cache) across all threads, 4 vector accumulators per thread so loads, not the XOR chain, set the pace,
// and returns the XOR as a checksum (bit-cast to int64) so no compiler can drop the loads; the caller checks it.
// AVX-512 / AVX2 / portable chosen at run time, as kquant_gemv.cpp does.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstring>

namespace {

#define PAGEDLLM_SR512 __attribute__((target("avx512f")))
#define PAGEDLLM_SR256 __attribute__((target("avx2")))

constexpr int64_t kLine = 64;  // bytes per step of every path (one cache line): chunks are whole lines

PAGEDLLM_SR512 uint64_t xor_avx512(const uint8_t* p, int64_t lines) {
  __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
  int64_t i = 0;
  for (; i + 4 <= lines; i += 4) {
    a = _mm512_xor_si512(a, _mm512_loadu_si512(p + (i + 0) * kLine));
    b = _mm512_xor_si512(b, _mm512_loadu_si512(p + (i + 1) * kLine));
    c = _mm512_xor_si512(c, _mm512_loadu_si512(p + (i + 2) * kLine));
    d = _mm512_xor_si512(d, _mm512_loadu_si512(p + (i + 3) * kLine));
  }
  for (; i < lines; ++i) a = _mm512_xor_si512(a, _mm512_loadu_si512(p + i * kLine));
  a = _mm512_xor_si512(_mm512_xor_si512(a, b), _mm512_xor_si512(c, d));
  alignas(64) uint64_t w[8];
  _mm512_store_si512(w, a);
  return w[0] ^ w[1] ^ w[2] ^ w[3] ^ w[4] ^ w[5] ^ w[6] ^ w[7];
}

PAGEDLLM_SR256 uint64_t xor_avx2(const uint8_t* p, int64_t lines) {
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  int64_t i = 0;
  for (; i + 2 <= lines; i += 2) {
    const uint8_t* q = p + i * kLine;
    a = _mm256_xor_si256(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
    b = _mm256_xor_si256(b, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32)));
    c = _mm256_xor_si256(c, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64)));
    d = _mm256_xor_si256(d, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 96)));
  }
  for (; i < lines; ++i) {
    const uint8_t* q = p + i * kLine;
    a = _mm256_xor_si256(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
    b = _mm256_xor_si256(b, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32)));
  }
  a = _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d));
  alignas(32) uint64_t w[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(w), a);
  return w[0] ^ w[1] ^ w[2] ^ w[3];
}

uint64_t xor_portable(const uint8_t* p, int64_t lines) {
  uint64_t acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < lines; ++i) {
    uint64_t w[8];
    std::memcpy(w, p + i * kLine, kLine);
    for (int j = 0; j < 8; ++j) acc[j] ^= w[j];
  }
  return acc[0] ^ acc[1] ^ acc[2] ^ acc[3] ^ acc[4] ^ acc[5] ^ acc[6] ^ acc[7];
}

//! 2: AVX-512, 1: AVX2, 0: portable; ``isa`` >= 0 forces a level (tests run each one the CPU has).
int stream_read_isa() {
  if (__builtin_cpu_supports("avx512f")) return 2;
  if (__builtin_cpu_supports("avx2")) return 1;
  return 0;
}

int64_t stream_read(const at::Tensor& buf, int64_t isa) {
  TORCH_CHECK(buf.device().is_cpu() && buf.is_contiguous(), "stream_read: buf must be a contiguous CPU tensor");
  const int64_t nbytes = buf.numel() * static_cast<int64_t>(buf.element_size());
  TORCH_CHECK(nbytes % kLine == 0, "stream_read: buf must be a whole number of 64-byte lines, got ", nbytes,
              " bytes");
  const int best = stream_read_isa();
  TORCH_CHECK(isa <= best, "stream_read: isa ", isa, " is above what this CPU runs (", best, ")");
  const int level = isa < 0 ? best : static_cast<int>(isa);
  const auto* p = static_cast<const uint8_t*>(buf.data_ptr());
  const int64_t lines = nbytes / kLine;
  std::atomic<uint64_t> total{0};
  // 4096 lines (256 KiB) per task at least: threads stream long runs, as a GEMV's row blocks do.
  at::parallel_for(0, lines, 4096, [&](int64_t begin, int64_t end) {
    const uint8_t* q = p + begin * kLine;
    const uint64_t x = level == 2 ? xor_avx512(q, end - begin) : level == 1 ? xor_avx2(q, end - begin)
                                                                             : xor_portable(q, end - begin);
    total.fetch_xor(x, std::memory_order_relaxed);
  });
  uint64_t v = total.load();
  int64_t out;
  std::memcpy(&out, &v, sizeof(out));
  return out;
}

int64_t stream_read_best_isa() { return stream_read_isa(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("stream_read(Tensor buf, int isa=-1) -> int");
  m.def("stream_read_best_isa() -> int", &stream_read_best_isa);
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("stream_read", &stream_read); }
