// Every decoder layer of a pure-decode step in one call from Python (``decode_layers.py``): the ops the eager layers
// call, in their order, on the same tensors, so the hidden states are the eager path's bit for bit. What it removes is
// the interpreter between them: at one sequence the embedded SmolLM2-135M spent ~3 ms of an ~8 ms step in Python and
// the dispatcher around ~5 ms of kernels (``perf``, AMD EPYC AVX-512, docs/benchmarks.md), ~12 op calls and ~8 module
// calls per layer, 30 layers.
//
// ``DecodeLayers`` holds each layer's weights as the eager modules hold them (the same tensors, no copies): norms, and
// four linears (qkv, o, gate_up, down) of one or more parts, each part a GGUF block kernel of this library (Q4_0 /
// Q4_1 ``q4_gemv``, Q8_0 ``q8_gemv``, Q4_K / Q5_K / Q6_K ``kquant_gemv``; a Q4_K_M qkv is Q4_K q and k beside a Q6_K
// v, outputs joined), or their int8-activation kernels (``q8act_gemv``, ``kquant_q8k_gemv``) for calls of as few rows
// as the eager path sends there. Which layers it takes, and when a step may use it, is ``decode_layers.py``'s decision.
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "kernels.h"

#include <optional>
#include <string>
#include <vector>

namespace {

namespace K = pagedllm_cpu::kernels;

enum Kind : int64_t { kQ4 = 0, kQ8 = 1, kKQuant = 2, kKQuantR16 = 3 };

struct Part {
  int64_t kind;
  at::Tensor weight;  // the kernel's state: Q4 repacked groups, Q8_0 / K-quant blocks as stored or in 16-row groups
  int64_t n;          // Q4: output rows
  bool has_min;       // Q4: Q4_1
  std::string type;   // K-quant: its GGUF type
  int64_t isa;        // K-quant: the fp32 kernel's SIMD level (-1 best)
  int64_t int8_isa;   // K-quant: the int8 kernel's
  int64_t int8_rows;  // calls of up to this many rows of x take int8 activations, as the eager path's (0: none)
  std::optional<at::Tensor> bias;
};

struct Linear {
  std::vector<Part> parts;
  bool split = false;               // a linear of parts whose outputs are joined (SplitQuantizedLinear)
  std::optional<at::Tensor> bias;   // a split linear's bias, added to the joined output
};

// Sites of a layer's linears, as ``add_part`` numbers them.
enum Site : int64_t { kQKV = 0, kO = 1, kGateUp = 2, kDown = 3 };

struct Layer {
  at::Tensor input_norm, post_attention_norm;
  double input_eps, post_attention_eps;
  int64_t num_heads, num_kv_heads, head_size, window;
  double scale;
  Linear linears[4];
};

// Whether a call of x's rows takes int8 activations, as the eager linear decides it for a part of ``int8_rows``.
bool int8_call(int64_t int8_rows, const at::Tensor& x) { return x.numel() <= int8_rows * x.size(-1); }

at::Tensor run_part(const Part& p, const at::Tensor& x) {
  at::Tensor y;
  const bool int8 = int8_call(p.int8_rows, x);
  switch (p.kind) {
    case kQ4:
      y = int8 ? K::q8act_gemv(x, p.weight, p.has_min ? "Q4_1" : "Q4_0", p.n, -1)
               : K::q4_gemv(x, p.weight, p.n, p.has_min);
      break;
    case kQ8: y = int8 ? K::q8act_gemv(x, p.weight, "Q8_0", 0, -1) : K::q8_gemv(x, p.weight); break;
    case kKQuantR16: y = K::kquant_r16_gemv(x, p.weight, p.type, int8 ? 1 : 2); break;
    default:
      y = int8 ? K::kquant_q8k_gemv(x, p.weight, p.type, p.int8_isa) : K::kquant_gemv(x, p.weight, p.type, p.isa);
  }
  if (p.bias) y.add_(*p.bias);
  return y;
}

// A split linear's parts all on the 16-row K-quant kernel with the same activations (a Q4_K_M's q, k and v) run as
// one call, outputs joined in place: the same bits as one call per part.
std::optional<at::Tensor> run_joined_r16(const Linear& l, const at::Tensor& x) {
  std::vector<at::Tensor> weights;
  std::vector<std::string> types;
  const int64_t int8_rows = l.parts[0].int8_rows;
  for (const Part& p : l.parts) {
    if (p.kind != kKQuantR16 || p.bias || p.int8_rows != int8_rows) return std::nullopt;
    weights.push_back(p.weight);
    types.push_back(p.type);
  }
  return K::kquant_r16_gemv_joined(x, weights, types, int8_call(int8_rows, x) ? 1 : 2);
}

at::Tensor run_linear(const Linear& l, const at::Tensor& x) {
  if (!l.split) return run_part(l.parts[0], x);
  if (std::optional<at::Tensor> y = run_joined_r16(l, x)) {
    if (l.bias) y->add_(*l.bias);
    return *y;
  }
  std::vector<at::Tensor> ys;
  ys.reserve(l.parts.size());
  for (const Part& p : l.parts) ys.push_back(run_part(p, x));
  at::Tensor y = at::cat(ys, -1);
  if (l.bias) y.add_(*l.bias);
  return y;
}

class DecodeLayers : public torch::CustomClassHolder {
 public:
  void add_layer(at::Tensor input_norm, double input_eps, at::Tensor post_attention_norm, double post_attention_eps,
                 int64_t num_heads, int64_t num_kv_heads, int64_t head_size, double scale, int64_t window) {
    Layer l;
    l.input_norm = std::move(input_norm);
    l.post_attention_norm = std::move(post_attention_norm);
    l.input_eps = input_eps;
    l.post_attention_eps = post_attention_eps;
    l.num_heads = num_heads;
    l.num_kv_heads = num_kv_heads;
    l.head_size = head_size;
    l.scale = scale;
    l.window = window;
    layers_.push_back(std::move(l));
  }

  // One part of the last layer's linear at ``site``; ``split`` marks the linear as joined parts.
  void add_part(int64_t site, int64_t kind, at::Tensor weight, int64_t n, bool has_min, std::string type,
                int64_t isa, int64_t int8_isa, int64_t int8_rows, std::optional<at::Tensor> bias, bool split) {
    TORCH_CHECK(!layers_.empty(), "DecodeLayers.add_part: add_layer first");
    TORCH_CHECK(site >= kQKV && site <= kDown, "DecodeLayers.add_part: site ", site, " is not 0-3");
    TORCH_CHECK(kind >= kQ4 && kind <= kKQuantR16, "DecodeLayers.add_part: kind ", kind, " is not 0-3");
    Linear& l = layers_.back().linears[site];
    l.parts.push_back(
        Part{kind, std::move(weight), n, has_min, std::move(type), isa, int8_isa, int8_rows, std::move(bias)});
    l.split = l.split || split;
  }

  void set_bias(int64_t site, at::Tensor bias) {
    TORCH_CHECK(!layers_.empty() && site >= kQKV && site <= kDown, "DecodeLayers.set_bias: no such site");
    layers_.back().linears[site].bias = std::move(bias);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // h [T, hidden] (the embeddings of T decodes) -> the last layer's output, before the final norm.
  at::Tensor forward(at::Tensor h, at::Tensor positions, at::Tensor slot_mapping, at::Tensor block_tables,
                     at::Tensor seq_lens, std::vector<at::Tensor> kv_caches, at::Tensor cos_sin_cache) {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "DecodeLayers.forward: ", kv_caches.size(), " KV caches for ",
                layers_.size(), " layers");
    for (const Layer& l : layers_)
      for (const Linear& lin : l.linears) TORCH_CHECK(!lin.parts.empty(), "DecodeLayers.forward: a linear has no part");
    const int64_t t = h.size(0);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      const at::Tensor& cache = kv_caches[i];
      at::Tensor qkv = run_linear(l.linears[kQKV], K::rms_norm(h, l.input_norm, l.input_eps));
      std::vector<at::Tensor> heads =
          qkv.view({t, -1, l.head_size}).split_with_sizes({l.num_heads, l.num_kv_heads, l.num_kv_heads}, 1);
      auto [q, k] = K::rotary(positions, heads[0], heads[1], cos_sin_cache);
      K::write_kv(cache, k, heads[2], slot_mapping);
      at::Tensor attn = at::empty_like(q);
      K::paged_decode_attention(attn, q, cache, block_tables, seq_lens, l.scale, l.window, 0.0);
      at::Tensor a = run_linear(l.linears[kO], attn.reshape({t, l.num_heads * l.head_size}));
      at::Tensor x = K::fused_add_rms_norm(a, h, l.post_attention_norm, l.post_attention_eps);  // a += h
      h = run_linear(l.linears[kDown], K::silu_and_mul(run_linear(l.linears[kGateUp], x))).add_(a);
    }
    return h;
  }

 private:
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<>())
      .def("add_layer", &DecodeLayers::add_layer)
      .def("add_part", &DecodeLayers::add_part)
      .def("set_bias", &DecodeLayers::set_bias)
      .def("num_layers", &DecodeLayers::num_layers)
      .def("forward", &DecodeLayers::forward);
}
