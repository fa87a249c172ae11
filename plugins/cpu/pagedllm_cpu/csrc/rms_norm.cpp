// RMSNorm and vLLM's fused residual add + RMSNorm for the CPU backend, one op call per layer norm instead of torch's
// five to nine (at decode sizes the dispatch of each op costs more than its arithmetic). HF's order of casts:
// the sum of squares, the mean and rsqrt in float32, x * rsqrt rounded to the input dtype, then times the weight in
// that dtype; the fused add rounds x + residual to the input dtype first, as a separate ``add_`` does.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "kernels.h"

#include <cmath>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();

float sum_squares(const float* x, int64_t n) {
  Vec a0(0.f), a1(0.f);
  int64_t i = 0;
  for (; i + 2 * kW <= n; i += 2 * kW) {
    Vec u = Vec::loadu(x + i), v = Vec::loadu(x + i + kW);
    a0 = at::vec::fmadd(u, u, a0);
    a1 = at::vec::fmadd(v, v, a1);
  }
  for (; i + kW <= n; i += kW) {
    Vec u = Vec::loadu(x + i);
    a0 = at::vec::fmadd(u, u, a0);
  }
  float s = at::vec::vec_reduce_all<float>([](Vec& p, Vec& q) { return p + q; }, a0 + a1);
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// Rows of x [N, D] (last dim contiguous) normalised into out [N, D]; with residual: x[i] = T(x[i] + residual[i])
// first, written back into x (the new residual stream).
template <typename T>
void norm_rows(at::Tensor& out, at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps) {
  const int64_t n = x.size(0), d = x.size(1);
  const int64_t xs = x.stride(0), os = out.stride(0), rs = residual ? residual->stride(0) : 0;
  T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(d);
    for (int64_t i = begin; i < end; ++i) {
      T* xi = xp + i * xs;
      if (rp) {
        const T* ri = rp + i * rs;
        for (int64_t j = 0; j < d; ++j) xi[j] = static_cast<T>(static_cast<float>(xi[j]) + static_cast<float>(ri[j]));
      }
      for (int64_t j = 0; j < d; ++j) row[j] = static_cast<float>(xi[j]);
      const float mean = sum_squares(row.data(), d) / static_cast<float>(d);
      const float r = 1.0f / std::sqrt(mean + static_cast<float>(eps));
      T* oi = op + i * os;
      for (int64_t j = 0; j < d; ++j) {
        const T h = static_cast<T>(row[j] * r);
        oi[j] = static_cast<T>(static_cast<float>(wp[j]) * static_cast<float>(h));
      }
    }
  });
}

void check(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() >= 1 && weight.is_contiguous() && weight.numel() == x.size(-1),
              "rms_norm: weight must be contiguous [D] for x [..., D]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight must share a dtype");
}

template <typename F>
void dispatch(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(at::BFloat16{});
    case at::kHalf: return f(at::Half{});
    default: TORCH_CHECK(false, "rms_norm: unsupported dtype ", t);
  }
}

// x [..., D] as rows [N, D] with a contiguous last dim: a view when its leading dims collapse, else a copy (q/k norms
// over the heads of a split qkv).
at::Tensor rows_of(const at::Tensor& x) {
  const int64_t d = x.size(-1);
  if (x.dim() == 2 && x.stride(1) == 1) return x;
  if (x.is_contiguous()) return x.view({-1, d});
  return x.contiguous().view({-1, d});
}

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check(x, weight);
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor rows = rows_of(x), out_rows = out.view({-1, x.size(-1)});
  dispatch(x.scalar_type(), [&](auto tag) { norm_rows<decltype(tag)>(out_rows, rows, nullptr, weight, eps); });
  return out;
}

at::Tensor fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check(x, weight);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && residual.sizes() == x.sizes() && residual.stride(1) == 1 &&
                  residual.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: x and residual must be [N, D] of one dtype with contiguous rows");
  at::Tensor out = at::empty(x.sizes(), x.options());
  dispatch(x.scalar_type(), [&](auto tag) { norm_rows<decltype(tag)>(out, x, &residual, weight, eps); });
  return out;
}

}  // namespace

at::Tensor pagedllm_cpu::kernels::rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return ::rms_norm(x, weight, eps);
}

at::Tensor pagedllm_cpu::kernels::fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                     const at::Tensor& weight, double eps) {
  return ::fused_add_rms_norm(x, residual, weight, eps);
}

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor residual, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
}
