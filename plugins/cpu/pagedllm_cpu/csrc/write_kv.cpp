// KV-cache write for the CPU backend in one op call: token t's keys and values copied into flat slot
// slot_mapping[t] of the canonical cache [2, num_blocks, block_size, num_kv_heads, head_size]; slots < 0 skipped.
// Same dtype only (fp8 caches keep the Python path, which quantizes first).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"

#include <cstring>

namespace {

void write_kv(at::Tensor kv_cache, at::Tensor key, at::Tensor value, at::Tensor slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "write_kv: kv_cache must be a contiguous [2, num_blocks, block_size, num_kv_heads, head_size]");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.stride(2) == 1 && value.stride(2) == 1 &&
                  key.sizes() == value.sizes() && key.size(1) == kv_cache.size(3) && key.size(2) == kv_cache.size(4),
              "write_kv: key and value must be [T, num_kv_heads, head_size] with a contiguous head dim");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
              "write_kv: key, value and cache must share a dtype");
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == key.size(0), "write_kv: one slot per token");
  const int64_t t = key.size(0), h = key.size(1), d = key.size(2);
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(sp[i] < num_slots, "write_kv: slot ", sp[i], " outside the cache");
  const int64_t elem = kv_cache.element_size(), row = h * d;
  char* base = static_cast<char*>(kv_cache.data_ptr());
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), vs0 = value.stride(0), vs1 = value.stride(1);
  at::parallel_for(0, t, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (sp[i] < 0) continue;
      char* kd = base + sp[i] * row * elem;
      char* vd = kd + num_slots * row * elem;
      for (int64_t k = 0; k < h; ++k) {
        std::memcpy(kd + k * d * elem, kp + (i * ks0 + k * ks1) * elem, d * elem);
        std::memcpy(vd + k * d * elem, vp + (i * vs0 + k * vs1) * elem, d * elem);
      }
    }
  });
}

}  // namespace

void pagedllm_cpu::kernels::write_kv(const at::Tensor& kv_cache, const at::Tensor& key, const at::Tensor& value,
                                     const at::Tensor& slot_mapping) {
  ::write_kv(kv_cache, key, value, slot_mapping);
}

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("write_kv(Tensor(a!) kv_cache, Tensor key, Tensor value, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("write_kv", &write_kv); }
