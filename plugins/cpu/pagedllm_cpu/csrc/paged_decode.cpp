// Paged decode attention for the CPU backend: one query token per sequence, keys and values read in place from the
// canonical cache [2, num_blocks, block_size, num_kv_heads, head_size] through the block table (no gather copy).
// Work item = a sequence (small batches: a sequence's share of the kv heads), so one cache block's rows for all its
// kv heads are read together; each kv head's GQA group of query heads shares every key/value row it loads. Scores
// and the online softmax are float32, one cache block at a time; attention sinks (GPT-OSS: a per-head logit with a
// zero value) join the softmax's denominator at the end. Vectorized<float> is compiled for the capability the
// loader passes (CPU_CAPABILITY_AVX2 / _AVX512 from ATen's own detection, or the portable default).
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();

inline Vec load_f(const float* p) { return Vec::loadu(p); }

template <typename T>
inline Vec load_f(const T* p) {
  Vec out;
  at::vec::load_to_float<T>(p, out);
  return out;
}

// The inner loops, for a chunk of G <= 8 query heads of one GQA group (G a compile-time constant, so the per-head
// accumulators live in registers): each key or value row is loaded once for the whole chunk. p . V splits the
// head dimension over NV vectors, so that G * NV >= 4 FMA chains run side by side (with G = 1, MHA, every FMA waited
// on the one before); each element's sum keeps its order. The unroll pragmas keep its [G][NV] accumulators in
// registers: without them GCC left them on the stack.
template <int G>
constexpr int kChains = G == 1 ? 4 : (G == 2 ? 2 : 1);

#define UNROLL _Pragma("GCC unroll 8")

// sc[j * bs + t] = q_j . k_t for t in [t0, t1); q is G rows of D floats. One FMA chain a head, unlike p . V: a head's
// sum keeps its order whatever G (TP=2 over replicated KV heads halves G, and its logits must equal one rank's bit
// for bit).
template <int G, typename T>
void qk_rows(const float* q, int64_t D, int64_t dv, const T* kblk, int64_t tok_s, int64_t t0, int64_t t1, float* sc,
             int64_t bs) {
  for (int64_t t = t0; t < t1; ++t) {
    const T* k = kblk + t * tok_s;
    Vec d[G];
    UNROLL for (int j = 0; j < G; ++j) d[j] = Vec(0.f);
    for (int64_t i = 0; i < dv; i += kW) {
      const Vec kv = load_f(k + i);
      UNROLL for (int j = 0; j < G; ++j) d[j] = at::vec::fmadd(Vec::loadu(q + j * D + i), kv, d[j]);
    }
    UNROLL for (int j = 0; j < G; ++j) {
      float s = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, d[j]);
      for (int64_t i = dv; i < D; ++i) s += q[j * D + i] * static_cast<float>(k[i]);
      sc[j * bs + t] = s;
    }
  }
}

// acc_j += sum_t p[j * bs + t] * v_t for t in [t0, t1); acc is G rows of D floats.
template <int G, typename T>
void pv_rows(const float* p, int64_t bs, const T* vblk, int64_t tok_s, int64_t t0, int64_t t1, float* acc, int64_t D,
             int64_t dv) {
  constexpr int NV = kChains<G>;
  int64_t i = 0;
  for (; i + NV * kW <= dv; i += NV * kW) {
    Vec a[G][NV];
    UNROLL for (int j = 0; j < G; ++j) UNROLL for (int u = 0; u < NV; ++u) a[j][u] = Vec::loadu(acc + j * D + i + u * kW);
    for (int64_t t = t0; t < t1; ++t) {
      Vec v[NV];
      UNROLL for (int u = 0; u < NV; ++u) v[u] = load_f(vblk + t * tok_s + i + u * kW);
      UNROLL for (int j = 0; j < G; ++j) {
        const Vec pj(p[j * bs + t]);
        UNROLL for (int u = 0; u < NV; ++u) a[j][u] = at::vec::fmadd(pj, v[u], a[j][u]);
      }
    }
    UNROLL for (int j = 0; j < G; ++j) UNROLL for (int u = 0; u < NV; ++u) a[j][u].store(acc + j * D + i + u * kW);
  }
  for (; i < dv; i += kW) {
    Vec a[G];
    UNROLL for (int j = 0; j < G; ++j) a[j] = Vec::loadu(acc + j * D + i);
    for (int64_t t = t0; t < t1; ++t) {
      const Vec v = load_f(vblk + t * tok_s + i);
      UNROLL for (int j = 0; j < G; ++j) a[j] = at::vec::fmadd(Vec(p[j * bs + t]), v, a[j]);
    }
    UNROLL for (int j = 0; j < G; ++j) a[j].store(acc + j * D + i);
  }
  for (int j = 0; j < G; ++j)
    for (int64_t i = dv; i < D; ++i)
      for (int64_t t = t0; t < t1; ++t) acc[j * D + i] += p[j * bs + t] * static_cast<float>(vblk[t * tok_s + i]);
}

// Blocks lie scattered in a pool far larger than the caches, and the hardware prefetcher does not cross pages, so
// the kernel requests the block kAhead ahead into L2 while it computes this one. Measured on SmolLM2's shape with
// the cache evicted between calls: ~0.71 ms a call against ~0.94 without (medians of alternated runs); 3 or 4 blocks
// ahead, into L1, or also the next sequence's first blocks were slower. The requests go out one kv head at a time,
// beside that head's work on the current block: issued for the whole block at once (all kv heads: 2,048 lines at
// SmolLM2-1.7B's shape) they stalled the core on full fill buffers before it computed anything (Xeon with AMX,
// 2 threads, bf16, 64 sequences x 192 tokens streamed from a 1 GiB pool: 16.7 -> 19.3 GB/s one block ahead, 18.9
// two, 17.8 three; GQA shapes no slower). Where a token's row (all kv heads) fills a 4 KiB page, the hardware's
// per-page streams already follow each head's walk and the requests only cost issue slots: none are made (the
// 1.7B shape, 4 KiB rows: 18.8 -> 20.6 GB/s without; 1 KiB rows: 19.8 with, 14.4 without).
constexpr int64_t kAhead = 1;
constexpr int64_t kPageBytes = 4096;

// Where a row fills a page, a block is walked twice instead: every kv head of the item over the block's keys, the
// whole block's softmax, every kv head over its values, rather than each kv head over keys, softmax and values in
// turn. `pagedllm bench paged-attention` (64 sequences, blocks at random from a 2 GiB pool, AMD EPYC Zen 4, 2
// threads, bf16): 8.9-9.6 ms at 192 tokens and 90.3-94.1 at 2,048 per head (37-44% of the streaming-read floor),
// 5.1-7.6 and 57.0-68.4 in two walks (61-72%). The walks first went a tile of
// rows at a time across the kv heads (16 KiB: 4 rows at SmolLM2-1.7B's shape, 2 in fp32): on Zen 4 tiles of 1-8 rows
// and the whole block measured alike, on Zen 5 the whole block took 4.60-4.70 ms against 5.31-5.34 (bf16, 192
// tokens; 24.2-25.0 against 27.8-28.2 at 1,024) and in fp32 6.25-7.13 against 11.73-11.93, so a call is the whole
// block. At rows under a page (GQA) the two walks measured 10-30% slower than the per-head walk, which those shapes
// keep. So do items of a few kv heads (a small batch splits the heads): the slice of a row such an item reads is
// under a page whatever the row (SmolLM2-1.7B's shape, one sequence, blocks at random from a 1 GiB pool, AMD EPYC
// Zen 4, 2 threads: fp32 634 -> 390 us at 512 tokens, bf16 475 -> 269; a 1.7B Q4_K_M decode step's attention, both
// walks alternated in one process: 1.72 -> 1.06 ms at ~48 tokens, 30.6 -> 17.8 ms at ~1,056).

// Request ``rows`` rows of ``width`` elements, ``stride`` apart, into L2.
template <typename T>
inline void prefetch_rows(const T* base, int64_t rows, int64_t stride, int64_t width) {
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < width; i += kLine) __builtin_prefetch(base + r * stride + i, 0, 2);
}

// f<G>(args...) for the runtime chunk size gc in 1..8.
#define PAGED_DECODE_DISPATCH(f, gc, ...)  \
  switch (gc) {                            \
    case 1: f<1, T>(__VA_ARGS__); break;   \
    case 2: f<2, T>(__VA_ARGS__); break;   \
    case 3: f<3, T>(__VA_ARGS__); break;   \
    case 4: f<4, T>(__VA_ARGS__); break;   \
    case 5: f<5, T>(__VA_ARGS__); break;   \
    case 6: f<6, T>(__VA_ARGS__); break;   \
    case 7: f<7, T>(__VA_ARGS__); break;   \
    default: f<8, T>(__VA_ARGS__); break;  \
  }

template <typename T>
void decode_kernel(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                   double soft_cap, const float* slopes, const float* sinks) {
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t bs = kv_cache.size(2), hkv = kv_cache.size(3);
  const int64_t g = H / hkv;
  const int64_t q_s0 = query.stride(0), q_s1 = query.stride(1);
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1);
  const int64_t kv_half = kv_cache.stride(0), blk_s = kv_cache.stride(1), tok_s = kv_cache.stride(2),
                head_s = kv_cache.stride(3);
  const int64_t bt_s = block_tables.stride(0), max_blocks = block_tables.size(1);
  const T* q_base = query.data_ptr<T>();
  const T* k_base = kv_cache.data_ptr<T>();
  const T* v_base = k_base + kv_half;
  T* o_base = out.data_ptr<T>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(soft_cap);
  const int64_t dv = (D / kW) * kW;

  // Large batches: one work item per sequence, so a cache block's rows for all kv heads (contiguous in the
  // canonical layout) are read together, once, in address order. Small batches: split the kv heads over items too,
  // or a single sequence would run on one thread.
  const int64_t threads = at::get_num_threads();
  const int64_t splits = B >= 4 * threads ? 1 : std::min<int64_t>(hkv, (4 * threads + B - 1) / B);
  const int64_t heads_per = (hkv + splits - 1) / splits;
  // What an item reads of a token row: the whole row, or its kv heads' slice where the heads are split.
  const bool per_head_walk = heads_per * head_s * static_cast<int64_t>(sizeof(T)) < kPageBytes;
  at::parallel_for(0, B * splits, 1, [&](int64_t begin, int64_t end) {
    const int64_t hh = heads_per * g;  // query heads of one item
    std::vector<float> q(hh * D), acc(hh * D), scores(hh * bs), m(hh), l(hh);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / splits, kh0 = (item % splits) * heads_per;
      const int64_t kh1 = std::min(hkv, kh0 + heads_per);
      if (kh0 >= kh1) continue;
      const int64_t nh = (kh1 - kh0) * g;  // query heads kh0 * g .. kh1 * g
      const int64_t len = lens[b];
      T* o_row = o_base + b * o_s0 + kh0 * g * o_s1;
      if (len <= 0) {  // nothing to attend (padding row): zeros, never garbage
        for (int64_t j = 0; j < nh; ++j) std::fill(o_row + j * o_s1, o_row + j * o_s1 + D, T(0));
        continue;
      }
      for (int64_t j = 0; j < nh; ++j) {
        const T* src = q_base + b * q_s0 + (kh0 * g + j) * q_s1;
        for (int64_t i = 0; i < D; ++i) q[j * D + i] = static_cast<float>(src[i]);
      }
      std::fill(acc.begin(), acc.begin() + nh * D, 0.f);
      std::fill(m.begin(), m.begin() + nh, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + nh, 0.f);
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t qpos = len - 1;
      for (int64_t blk = first / bs; blk * bs < len && blk < max_blocks; ++blk) {
        const int64_t phys = bt[b * bt_s + blk];
        const int64_t t0 = std::max(first, blk * bs) - blk * bs, t1 = std::min(len - blk * bs, bs);
        // The online softmax of query heads [ja, jb) over this block's scores: what came before is rescaled to the
        // new running max.
        auto softmax = [&](int64_t ja, int64_t jb) {
          for (int64_t j = ja; j < jb; ++j) {
            float* sc = &scores[j * bs];
            const int64_t h = kh0 * g + j;  // the query head
            for (int64_t t = t0; t < t1; ++t) {
              float s = sc[t] * fscale;
              if (cap > 0.f) s = cap * std::tanh(s / cap);
              if (slopes) s += slopes[h] * static_cast<float>(blk * bs + t - qpos);
              sc[t] = s;
            }
            float mx = m[j];
            for (int64_t t = t0; t < t1; ++t) mx = std::max(mx, sc[t]);
            const float corr = std::exp(m[j] - mx);
            float sum = 0.f;
            for (int64_t t = t0; t < t1; t += kW) {  // exp_u20: ATen's vectorised exp (no Sleef symbols needed)
              const int64_t n = std::min(kW, t1 - t);
              const Vec e = (Vec::loadu(sc + t, n) - Vec(mx)).exp_u20();
              e.store(sc + t, n);
              for (int64_t i = 0; i < n; ++i) sum += sc[t + i];
            }
            l[j] = l[j] * corr + sum;
            m[j] = mx;
            if (corr != 1.f) at::vec::map([corr](Vec x) { return x * Vec(corr); }, &acc[j * D], &acc[j * D], D);
          }
        };
        // q . k (or acc += p . V) of kv head kh over token rows [ta, tb): each row loaded once per chunk of <= 8
        // query heads
        auto qk = [&](int64_t kh, int64_t ta, int64_t tb) {
          const int64_t j0 = (kh - kh0) * g;
          const T* kblk = k_base + phys * blk_s + kh * head_s;
          for (int64_t jc = 0; jc < g; jc += 8) {
            const int64_t gc = std::min<int64_t>(8, g - jc);
            PAGED_DECODE_DISPATCH(qk_rows, gc, &q[(j0 + jc) * D], D, dv, kblk, tok_s, ta, tb, &scores[(j0 + jc) * bs], bs)
          }
        };
        auto pv = [&](int64_t kh, int64_t ta, int64_t tb) {
          const int64_t j0 = (kh - kh0) * g;
          const T* vblk = v_base + phys * blk_s + kh * head_s;
          for (int64_t jc = 0; jc < g; jc += 8) {
            const int64_t gc = std::min<int64_t>(8, g - jc);
            PAGED_DECODE_DISPATCH(pv_rows, gc, &scores[(j0 + jc) * bs], bs, vblk, tok_s, ta, tb, &acc[(j0 + jc) * D], D, dv)
          }
        };
        if (per_head_walk) {  // rows under a page: each kv head walks keys, softmax, values, the block ahead requested
          const bool pf = (blk + kAhead) * bs < len && blk + kAhead < max_blocks;
          const int64_t ahead = pf ? bt[b * bt_s + blk + kAhead] : 0;
          for (int64_t kh = kh0; kh < kh1; ++kh) {
            if (pf) {
              prefetch_rows(k_base + ahead * blk_s + kh * head_s, bs, tok_s, head_s);
              prefetch_rows(v_base + ahead * blk_s + kh * head_s, bs, tok_s, head_s);
            }
            qk(kh, t0, t1);
            softmax((kh - kh0) * g, (kh - kh0 + 1) * g);
            pv(kh, t0, t1);
          }
        } else {  // rows of a page or more: every kv head's keys, the softmax, every kv head's values
          for (int64_t kh = kh0; kh < kh1; ++kh) qk(kh, t0, t1);
          softmax(0, nh);
          for (int64_t kh = kh0; kh < kh1; ++kh) pv(kh, t0, t1);
        }
      }
      for (int64_t j = 0; j < nh; ++j) {
        float inv = 1.f / l[j];
        if (sinks) {  // the sink's exp(s) joins the denominator; rescaled to the larger of the two maxima
          const float s = sinks[kh0 * g + j], mx = std::max(m[j], s), c = std::exp(m[j] - mx);
          inv = c / (l[j] * c + std::exp(s - mx));
        }
        T* dst = o_row + j * o_s1;
        for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<T>(acc[j * D + i] * inv);
      }
    }
  });
}

void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                            int64_t window, double soft_cap, const std::optional<at::Tensor>& alibi_slopes,
                            const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [B, H, D] of one shape");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, "kv_cache must be [2, num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(kv_cache.size(4) == query.size(2), "kv_cache head size ", kv_cache.size(4), " != query's ",
              query.size(2));
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "query, out and kv_cache must share a dtype");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && kv_cache.stride(4) == 1,
              "the head dimension must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
                  block_tables.size(0) >= query.size(0),
              "block_tables must be int32 [>= B, max_blocks] with contiguous rows");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() && seq_lens.numel() >= query.size(0),
              "seq_lens must be contiguous int32 [>= B]");
  at::Tensor slopes;
  if (alibi_slopes.has_value()) {
    slopes = alibi_slopes->to(at::kFloat).contiguous();
    TORCH_CHECK(slopes.numel() == query.size(1), "alibi_slopes must have num_heads entries");
  }
  const float* sp = slopes.defined() ? slopes.data_ptr<float>() : nullptr;
  at::Tensor sink;
  if (sinks.has_value()) {
    sink = sinks->to(at::kFloat).contiguous();
    TORCH_CHECK(sink.numel() == query.size(1), "sinks must have num_heads entries");
  }
  const float* kp = sink.defined() ? sink.data_ptr<float>() : nullptr;
  switch (query.scalar_type()) {
    case at::kFloat:
      return decode_kernel<float>(out, query, kv_cache, block_tables, seq_lens, scale, window, soft_cap, sp, kp);
    case at::kBFloat16:
      return decode_kernel<at::BFloat16>(out, query, kv_cache, block_tables, seq_lens, scale, window, soft_cap, sp, kp);
    case at::kHalf:
      return decode_kernel<at::Half>(out, query, kv_cache, block_tables, seq_lens, scale, window, soft_cap, sp, kp);
    default:
      TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", query.scalar_type());
  }
}

}  // namespace

void pagedllm_cpu::kernels::paged_decode_attention(const at::Tensor& out, const at::Tensor& query,
                                                   const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                                   const at::Tensor& seq_lens, double scale, int64_t window,
                                                   double soft_cap) {
  ::paged_decode_attention(out, query, kv_cache, block_tables, seq_lens, scale, window, soft_cap, std::nullopt,
                           std::nullopt);
}

TORCH_LIBRARY(pagedllm_cpu, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int window, float soft_cap, Tensor? alibi_slopes, Tensor? sinks=None) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
