// Neox rotary embedding for the CPU backend in one op call: the cos/sin rows gathered by position inside, q and k
// rotated into fresh contiguous outputs. The same arithmetic as core's reference (and ops.py's torch path): cos and
// sin rounded to the activations' dtype, then x1*cos - x2*sin and x2*cos + x1*sin with each product and the sum
// rounded to that dtype (the build uses -ffp-contract=off, so float32 is not fused into FMAs either).
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <tuple>
#include <type_traits>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();

template <typename T>
using VT = at::vec::Vectorized<T>;

// Two float vectors rounded to T and widened back (round to nearest even, as a scalar cast to T).
template <typename T>
inline std::tuple<Vec, Vec> rounded(const Vec& a, const Vec& b) {
  return at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(a, b));
}

// n <= VT<T>::size() cos/sin entries as two float vectors of T-rounded values (entries past n are 0).
template <typename T>
inline std::tuple<Vec, Vec> load_rounded(const float* p, int64_t n) {
  return rounded<T>(Vec::loadu(p, std::min(n, kW)), Vec::loadu(p + kW, std::max<int64_t>(0, n - kW)));
}

template <typename T>
inline std::tuple<Vec, Vec> load_rounded(const T* p, int64_t n) {
  return at::vec::convert_to_float<T>(VT<T>::loadu(p, n));
}

template <typename T, typename C>
void rotate(at::Tensor& out, const at::Tensor& x, const int64_t* pos, const at::Tensor& cos_sin) {
  const int64_t t = x.size(0), h = x.size(1), d = x.size(2);
  const int64_t rot = cos_sin.size(1), half = rot / 2;
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), cs0 = cos_sin.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const C* cp = cos_sin.data_ptr<C>();
  [[maybe_unused]] constexpr int64_t kN = VT<T>::size();
  at::parallel_for(0, t, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const C* cs = cp + pos[i] * cs0;
      for (int64_t k = 0; k < h; ++k) {
        const T* xi = xp + i * xs0 + k * xs1;
        T* oi = op + (i * h + k) * d;
        int64_t j = 0;
        if constexpr (std::is_same_v<T, float> && std::is_same_v<C, float>) {  // same IEEE ops, 16 or 8 lanes
          for (; j + kW <= half; j += kW) {
            const Vec c = Vec::loadu(cs + j), s = Vec::loadu(cs + half + j);
            const Vec x1 = Vec::loadu(xi + j), x2 = Vec::loadu(xi + half + j);
            (x1 * c - x2 * s).store(oi + j);
            (x2 * c + x1 * s).store(oi + half + j);
          }
        } else if constexpr (!std::is_same_v<T, float>) {  // bf16 / fp16: the scalar loop's roundings, vectorised
          for (; j < half; j += kN) {
            const int64_t n = std::min(kN, half - j);
            auto [c0, c1] = load_rounded<T>(cs + j, n);
            auto [s0, s1] = load_rounded<T>(cs + half + j, n);
            auto [a0, a1] = at::vec::convert_to_float<T>(VT<T>::loadu(xi + j, n));
            auto [b0, b1] = at::vec::convert_to_float<T>(VT<T>::loadu(xi + half + j, n));
            auto [p0, p1] = rounded<T>(a0 * c0, a1 * c1);  // x1 * cos
            auto [q0, q1] = rounded<T>(b0 * s0, b1 * s1);  // x2 * sin
            auto [e0, e1] = rounded<T>(b0 * c0, b1 * c1);  // x2 * cos
            auto [f0, f1] = rounded<T>(a0 * s0, a1 * s1);  // x1 * sin
            at::vec::convert_from_float<T>(p0 - q0, p1 - q1).store(oi + j, n);
            at::vec::convert_from_float<T>(e0 + f0, e1 + f1).store(oi + half + j, n);
          }
        }
        for (; j < half; ++j) {
          const float c = static_cast<float>(static_cast<T>(cs[j]));
          const float s = static_cast<float>(static_cast<T>(cs[half + j]));
          const float x1 = static_cast<float>(xi[j]), x2 = static_cast<float>(xi[half + j]);
          const float a = static_cast<float>(static_cast<T>(x1 * c)), b = static_cast<float>(static_cast<T>(x2 * s));
          const float e = static_cast<float>(static_cast<T>(x2 * c)), f = static_cast<float>(static_cast<T>(x1 * s));
          oi[j] = static_cast<T>(a - b);
          oi[half + j] = static_cast<T>(e + f);
        }
        for (int64_t j = rot; j < d; ++j) oi[j] = xi[j];
      }
    }
  });
}

template <typename T>
void rotate_any(at::Tensor& out, const at::Tensor& x, const int64_t* pos, const at::Tensor& cos_sin) {
  if (cos_sin.scalar_type() == at::kFloat) return rotate<T, float>(out, x, pos, cos_sin);
  TORCH_CHECK(cos_sin.scalar_type() == x.scalar_type(), "rotary: cos_sin_cache must be float32 or the query's dtype");
  return rotate<T, T>(out, x, pos, cos_sin);
}

std::tuple<at::Tensor, at::Tensor> rotary(at::Tensor positions, at::Tensor query, at::Tensor key,
                                          at::Tensor cos_sin) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && query.stride(2) == 1 && key.stride(2) == 1,
              "rotary: query and key must be [T, H, D] with a contiguous head dim");
  at::Tensor q_out = at::empty(query.sizes(), query.options()), k_out = at::empty(key.sizes(), key.options());
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.stride(1) == 1 && cos_sin.size(1) % 2 == 0 &&
                  cos_sin.size(1) <= query.size(2) && cos_sin.size(1) <= key.size(2),
              "rotary: cos_sin_cache must be [max_pos, rot_dim] with an even rot_dim <= head_size");
  TORCH_CHECK(query.scalar_type() == key.scalar_type(), "rotary: query and key must share a dtype");
  const at::Tensor pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == query.size(0) && pos.numel() == key.size(0), "rotary: one position per token");
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < pos.numel(); ++i)
    TORCH_CHECK(pp[i] >= 0 && pp[i] < cos_sin.size(0), "rotary: position ", pp[i], " outside the cos/sin cache");
  switch (query.scalar_type()) {
    case at::kFloat:
      rotate_any<float>(q_out, query, pp, cos_sin);
      rotate_any<float>(k_out, key, pp, cos_sin);
      break;
    case at::kBFloat16:
      rotate_any<at::BFloat16>(q_out, query, pp, cos_sin);
      rotate_any<at::BFloat16>(k_out, key, pp, cos_sin);
      break;
    case at::kHalf:
      rotate_any<at::Half>(q_out, query, pp, cos_sin);
      rotate_any<at::Half>(k_out, key, pp, cos_sin);
      break;
    default:
      TORCH_CHECK(false, "rotary: unsupported dtype ", query.scalar_type());
  }
  return {q_out, k_out};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> pagedllm_cpu::kernels::rotary(const at::Tensor& positions, const at::Tensor& query,
                                                               const at::Tensor& key,
                                                               const at::Tensor& cos_sin_cache) {
  return ::rotary(positions, query, key, cos_sin_cache);
}

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("rotary(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("rotary", &rotary); }
