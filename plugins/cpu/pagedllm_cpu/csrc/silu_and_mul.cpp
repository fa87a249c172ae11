// SwiGLU's activation for the CPU backend: out = silu(x[..., :d]) * x[..., d:] in one pass over each row, instead of
// torch's silu (a temporary) then mul. Reference order of roundings: silu(a) = a / (1 + exp(-a)) in float32,
// rounded to the input dtype, times b rounded again. exp is ATen's vectorised exp_u20 (no Sleef symbols needed).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();

inline Vec silu(const Vec& a) { return a / (Vec(1.f) + a.neg().exp_u20()); }

inline Vec load_f(const float* p, int64_t n) { return Vec::loadu(p, n); }

template <typename T>
inline Vec load_f(const T* p, int64_t n) {
  float tmp[kW] = {};
  for (int64_t i = 0; i < n; ++i) tmp[i] = static_cast<float>(p[i]);
  return Vec::loadu(tmp);
}

template <typename T>
void silu_mul_rows(at::Tensor& out, const at::Tensor& x, int64_t rows, int64_t d) {
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)), [&](int64_t begin, int64_t end) {
    float s[kW], b[kW];
    for (int64_t r = begin; r < end; ++r) {
      const T* a_row = xp + r * xs;
      const T* b_row = a_row + d;
      T* o_row = op + r * os;
      for (int64_t j = 0; j < d; j += kW) {
        const int64_t n = std::min(kW, d - j);
        if constexpr (std::is_same_v<T, float>) {
          (silu(Vec::loadu(a_row + j, n)) * Vec::loadu(b_row + j, n)).store(o_row + j, n);
        } else {
          silu(load_f(a_row + j, n)).store(s);
          load_f(b_row + j, n).store(b);
          for (int64_t i = 0; i < n; ++i)
            o_row[j + i] = static_cast<T>(static_cast<float>(static_cast<T>(s[i])) * b[i]);
        }
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul: x must be [N, 2d] with a contiguous last dim");
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  at::Tensor out = at::empty({rows, d}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat:
      silu_mul_rows<float>(out, x, rows, d);
      break;
    case at::kBFloat16:
      silu_mul_rows<at::BFloat16>(out, x, rows, d);
      break;
    case at::kHalf:
      silu_mul_rows<at::Half>(out, x, rows, d);
      break;
    default:
      TORCH_CHECK(false, "silu_and_mul: unsupported dtype ", x.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) { m.def("silu_and_mul(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("silu_and_mul", &silu_and_mul); }
