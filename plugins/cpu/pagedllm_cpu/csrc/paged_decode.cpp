// Paged decode attention for the CPU backend: one query token per sequence, keys and values read in place from the
// canonical cache [2, num_blocks, block_size, num_kv_heads, head_size] through the block table (no gather copy).
// Work item = (sequence, kv head): its GQA group of query heads shares every key/value row it loads. Scores and
// the online softmax are float32, one cache block at a time. Vectorized<float> is compiled for the capability the
// loader passes (CPU_CAPABILITY_AVX2 / _AVX512 from ATen's own detection, or the portable default).
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

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

template <typename T>
void decode_kernel(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                   double soft_cap, const float* slopes) {
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

  at::parallel_for(0, B * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(g * D), acc(g * D), scores(g * bs), m(g), l(g);
    std::vector<Vec> dots(g);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / hkv, kh = item % hkv;
      const int64_t len = lens[b];
      T* o_row = o_base + b * o_s0 + kh * g * o_s1;
      if (len <= 0) {  // nothing to attend (padding row): zeros, never garbage
        for (int64_t j = 0; j < g; ++j) std::fill(o_row + j * o_s1, o_row + j * o_s1 + D, T(0));
        continue;
      }
      for (int64_t j = 0; j < g; ++j) {
        const T* src = q_base + b * q_s0 + (kh * g + j) * q_s1;
        for (int64_t i = 0; i < D; ++i) q[j * D + i] = static_cast<float>(src[i]);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t qpos = len - 1;
      for (int64_t blk = first / bs; blk * bs < len && blk < max_blocks; ++blk) {
        const int64_t phys = bt[b * bt_s + blk];
        const int64_t t0 = std::max(first, blk * bs) - blk * bs, t1 = std::min(len - blk * bs, bs);
        const T* kblk = k_base + phys * blk_s + kh * head_s;
        const T* vblk = v_base + phys * blk_s + kh * head_s;
        for (int64_t t = t0; t < t1; ++t) {  // q . k for the whole group, each key row loaded once
          const T* k = kblk + t * tok_s;
          for (int64_t j = 0; j < g; ++j) dots[j] = Vec(0.f);
          for (int64_t i = 0; i < dv; i += kW) {
            const Vec kv = load_f(k + i);
            for (int64_t j = 0; j < g; ++j) dots[j] = at::vec::fmadd(Vec::loadu(&q[j * D + i]), kv, dots[j]);
          }
          for (int64_t j = 0; j < g; ++j) {
            float s = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, dots[j]);
            for (int64_t i = dv; i < D; ++i) s += q[j * D + i] * static_cast<float>(k[i]);
            s *= fscale;
            if (cap > 0.f) s = cap * std::tanh(s / cap);
            if (slopes) s += slopes[kh * g + j] * static_cast<float>(blk * bs + t - qpos);
            scores[j * bs + t] = s;
          }
        }
        for (int64_t j = 0; j < g; ++j) {  // online softmax: rescale what came before to the new running max
          float* sc = &scores[j * bs];
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
        for (int64_t j = 0; j < g; ++j) {  // acc += p . V: each accumulator chunk stays in a register per block
          const float* p = &scores[j * bs];
          float* a = &acc[j * D];
          for (int64_t i = 0; i < dv; i += kW) {
            Vec av = Vec::loadu(a + i);
            for (int64_t t = t0; t < t1; ++t) av = at::vec::fmadd(Vec(p[t]), load_f(vblk + t * tok_s + i), av);
            av.store(a + i);
          }
          for (int64_t i = dv; i < D; ++i)
            for (int64_t t = t0; t < t1; ++t) a[i] += p[t] * static_cast<float>(vblk[t * tok_s + i]);
        }
      }
      for (int64_t j = 0; j < g; ++j) {
        const float inv = 1.f / l[j];
        T* dst = o_row + j * o_s1;
        for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<T>(acc[j * D + i] * inv);
      }
    }
  });
}

void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                            int64_t window, double soft_cap, const std::optional<at::Tensor>& alibi_slopes) {
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
  switch (query.scalar_type()) {
    case at::kFloat:
      return decode_kernel<float>(out, query, kv_cache, block_tables, seq_lens, scale, window, soft_cap, sp);
    case at::kBFloat16:
      return decode_kernel<at::BFloat16>(out, query, kv_cache, block_tables, seq_lens, scale, window, soft_cap, sp);
    case at::kHalf:
      return decode_kernel<at::Half>(out, query, kv_cache, block_tables, seq_lens, scale, window, soft_cap, sp);
    default:
      TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", query.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(pagedllm_cpu, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int window, float soft_cap, Tensor? alibi_slopes) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
