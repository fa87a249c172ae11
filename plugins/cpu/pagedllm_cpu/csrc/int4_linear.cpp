// x @ W.T on torch's packed int4 CPU kernel in one op call: the cast of the activations to bfloat16 (the kernel's
// input dtype), the matmul and the cast back to x's dtype, with the reshapes around them. The same ATen ops as the
// Python path in quant.py, so the same numbers; at decode sizes its four extra dispatches cost about a third of the
// matmul itself.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <torch/library.h>

namespace {

at::Tensor int4pack_linear(const at::Tensor& x, const at::Tensor& packed, int64_t group_size,
                           const at::Tensor& scales_zeros) {
  std::vector<int64_t> shape = x.sizes().vec();
  TORCH_CHECK(!shape.empty(), "int4pack_linear: x must have a feature dim");
  const at::Tensor rows = x.reshape({-1, shape.back()}).to(at::kBFloat16);
  const at::Tensor y = at::_weight_int4pack_mm_for_cpu(rows, packed, group_size, scales_zeros);
  shape.back() = y.size(1);
  return y.to(x.scalar_type()).view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("int4pack_linear(Tensor x, Tensor packed, int group_size, Tensor scales_zeros) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("int4pack_linear", &int4pack_linear); }
