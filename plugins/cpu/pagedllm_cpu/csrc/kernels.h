// The library's per-layer ops as plain C++ functions, for code in the library that runs many of them per call
// (decode_layers.cpp) with neither Python nor the dispatcher between them. Each is the very function its file
// registers as an op (defined there, after its anonymous namespace), so both paths compute the same bits.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace pagedllm_cpu::kernels {

at::Tensor q4_gemv(const at::Tensor& x, const at::Tensor& packed, int64_t n, bool has_min);
at::Tensor q8_gemv(const at::Tensor& x, const at::Tensor& blocks);
at::Tensor kquant_gemv(const at::Tensor& x, const at::Tensor& blocks, const std::string& weight_type, int64_t isa);
at::Tensor q8act_gemv(const at::Tensor& x, const at::Tensor& weight, const std::string& weight_type, int64_t n,
                      int64_t isa);
at::Tensor kquant_q8k_gemv(const at::Tensor& x, const at::Tensor& blocks, const std::string& weight_type,
                           int64_t isa);
at::Tensor kquant_r16_gemv(const at::Tensor& x, const at::Tensor& packed, const std::string& weight_type,
                           int64_t terms);
at::Tensor kquant_r16_gemv_joined(const at::Tensor& x, const std::vector<at::Tensor>& packed,
                                  const std::vector<std::string>& weight_types, int64_t terms);
// kquant_r16.cpp's layout for kquant_mm_bf16: a record's bytes (type: pagedllm_cpu::KQuant), and one
// record (16 rows' super-block) back to the file's 16 super-blocks, row after row (16 * bytes).
int64_t kquant_r16_record_bytes(int type);
void kquant_r16_to_blocks(int type, const uint8_t* record, uint8_t* blocks);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
                                          const at::Tensor& cos_sin_cache);
at::Tensor silu_and_mul(const at::Tensor& x);
void write_kv(const at::Tensor& kv_cache, const at::Tensor& key, const at::Tensor& value,
              const at::Tensor& slot_mapping);
void paged_decode_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                            double soft_cap);

}  // namespace pagedllm_cpu::kernels
