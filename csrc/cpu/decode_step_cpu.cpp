// The whole decode step of a Llama-layer MoE model, planned once: a registered class, torch.classes.hf_moe.DecodePlan
// (hf_moe/decode_one_op.py builds it and says which models it serves):
//
//   plan = DecodePlan(model_tensors, model_numbers, top_k, norm_topk_prob, activation, glu)
//   plan.add_layer(layer_tensors, layer_numbers, layer_names)   once per decoder layer, in order
//   plan.step(input_ids [B, 1], position_ids [B, 1], mask [B, L]?, cos [P, D], sin [P, D], keys, values, lengths)
//       -> logits [B, 1, V]
//
// Every field is passed by name (a dict of tensors, a dict of numbers; a tensor the layer does not have is left
// out), read in one place (`LayerPlan`, `DecodePlan`'s constructor) and checked there, once: the weights against
// each other, the router cast to fp32 (hf_moe's routers; transformers' compute their logits in the activations'
// dtype: `router_in_dtype`), the biases to the activations' dtype. A step only computes: the embedding row; per
// layer the attention sub-block (attention_block, on the plan's workspace), then an MoE block (the router's logits
// on hf_moe's dot kernels and their fp32 softmax into the workspace, top-k, renormalisation and cast: moe_block; the
// experts, moe_experts_infer_into on the plan's experts workspace; the shared experts, optionally gated, by the
// kernels their eager modules call) or a dense MLP (DenseMLP, ATen's kernels: they allocate their results), and the
// residual add; then the final norm (rms_norm_rows, into the workspace) and the LM head (linear_into). Per call it
// checks only what the call brings (ids, caches, mask). The plan's buffers are made for the largest batch seen and
// reused, and allocate nothing once made; the logits a step returns are its one new tensor (the caller keeps them,
// and threads may share the plan). One step runs at a time (a mutex). `cos` and `sin` are the rotary
// embedding's values for every position the cache holds; a row's values are those of its position id. The caches
// are written at each layer's length, which grows by one (as the compiled step's `length.add_(1)`).

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "decode_ops.h"
#include "decode_values.h"

namespace hf_moe {
namespace {

using Tensors = c10::Dict<std::string, at::Tensor>;
using Numbers = c10::Dict<std::string, double>;
using Names = c10::Dict<std::string, std::string>;

std::string where(int64_t layer) { return layer < 0 ? "the model" : "layer " + std::to_string(layer); }

c10::optional<at::Tensor> maybe(const Tensors& t, const std::string& name) {
  const auto it = t.find(name);
  if (it == t.end()) return c10::nullopt;
  return it->value();
}

at::Tensor need(const Tensors& t, const std::string& name, int64_t layer) {
  const auto it = t.find(name);
  TORCH_CHECK(it != t.end() && it->value().defined(), "DecodePlan: ", where(layer), " has no tensor ", name);
  return it->value();
}

double number(const Numbers& n, const std::string& name, int64_t layer) {
  const auto it = n.find(name);
  TORCH_CHECK(it != n.end(), "DecodePlan: ", where(layer), " has no number ", name);
  return it->value();
}

c10::optional<at::Tensor> cast(const c10::optional<at::Tensor>& t, at::ScalarType dt) {
  if (!t.has_value()) return c10::nullopt;
  return t->to(dt).contiguous();
}

// RMSNorm of each row of x [B, H] with weight [H] (both of the model's dtype, contiguous) into out [B, H], as the
// attention sub-block normalises: Llama's roundings, the sum of squares in fp32 in input order. `row`: scratch.
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, std::vector<float>& row,
                   at::Tensor& out) {
  const Values val{x.scalar_type() == at::kBFloat16};
  const int64_t h = x.size(1);
  row.resize(h);
  for (int64_t b = 0; b < x.size(0); ++b)
    rms_norm_row(val, x.data_ptr(), b, h, weight.data_ptr(), static_cast<float>(eps), row.data(), out.data_ptr());
}

std::string name_of(const Names& n, const std::string& name, int64_t layer) {
  const auto it = n.find(name);
  TORCH_CHECK(it != n.end(), "DecodePlan: ", where(layer), " has no setting ", name);
  return it->value();
}

// A dense MLP (a dense layer's, or an MoE block's shared experts, under `prefix`: "mlp" or "shared"), computed with
// the ATen and hf_moe kernels its eager modules call (nn.Linear: at::linear; int8 QuantizedLinear: linear_infer),
// so with the eager model's bits: down(act(gate(x)) * up(x)), or down(act(up(x))) without a gate.
struct DenseMLP {
  bool glu = false;
  std::string activation;
  at::Tensor gate, up, down;
  c10::optional<at::Tensor> gate_scale, up_scale, down_scale, gate_bias, up_bias, down_bias;

  DenseMLP() = default;
  DenseMLP(const Tensors& t, const Numbers& n, const Names& names, const std::string& prefix, at::ScalarType dt,
           int64_t i, int64_t hidden) {
    glu = number(n, prefix + ".glu", i) != 0.0;
    activation = name_of(names, prefix + ".activation", i);
    TORCH_CHECK(activation == "silu" || activation == "gelu" || activation == "gelu_pytorch_tanh" ||
                    activation == "relu",
                "DecodePlan: ", where(i), "'s ", prefix, " activation ", activation,
                " is not one of silu, gelu, gelu_pytorch_tanh, relu");
    read(t, prefix + ".up", dt, i, up, up_scale, up_bias);
    read(t, prefix + ".down", dt, i, down, down_scale, down_bias);
    if (glu) read(t, prefix + ".gate", dt, i, gate, gate_scale, gate_bias);
    const int64_t inter = up.size(0);
    TORCH_CHECK(up.size(1) == hidden && down.size(0) == hidden && down.size(1) == inter &&
                    (!glu || gate.sizes() == up.sizes()),
                "DecodePlan: ", where(i), "'s ", prefix, " projections do not fit hidden ", hidden, ": up ",
                up.sizes(), ", down ", down.sizes());
  }

  static void read(const Tensors& t, const std::string& name, at::ScalarType dt, int64_t i, at::Tensor& w,
                   c10::optional<at::Tensor>& scale, c10::optional<at::Tensor>& bias) {
    w = need(t, name + ".weight", i);
    scale = maybe(t, name + ".scale");
    bias = maybe(t, name + ".bias");
    TORCH_CHECK(w.dim() == 2, "DecodePlan: ", where(i), "'s ", name, " must be an [out, in] weight, got ", w.sizes());
    weight_view(w, scale, "DecodePlan: " + where(i) + "'s " + name);  // contiguous, int8 with its scales checked
    TORCH_CHECK(w.scalar_type() == dt || w.scalar_type() == at::kChar, "DecodePlan: ", where(i), "'s ", name,
                " must be ", dt, " or int8, got ", w.scalar_type());
    if (scale.has_value()) bias = cast(bias, dt);  // as QuantizedLinear casts it
  }

  static at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& scale,
                           const c10::optional<at::Tensor>& bias) {
    if (scale.has_value()) return linear_infer_cpu(x, w, scale, bias, "auto");
    return at::linear(x, w, bias);
  }

  at::Tensor act(const at::Tensor& x) const {
    if (activation == "silu") return at::silu(x);
    if (activation == "relu") return at::relu(x);
    return at::gelu(x, activation == "gelu" ? "none" : "tanh");
  }

  at::Tensor operator()(const at::Tensor& x) const {
    const at::Tensor h = glu ? at::mul(act(linear(x, gate, gate_scale, gate_bias)), linear(x, up, up_scale, up_bias))
                             : act(linear(x, up, up_scale, up_bias));
    return linear(h, down, down_scale, down_bias);
  }
};

// One decoder layer, read by name from its dicts (hf_moe.decode_one_op.layer_fields names them): adding a tensor
// to a layer is one field and one read here.
struct LayerPlan {
  AttentionWeights attention;
  bool moe = false;  // an MoE block (router, experts, optional shared experts), else a dense MLP (`mlp`)
  LinearWeight router;  // [E, H]: fp32, or the activations' dtype where `router_in_dtype`; checked once
  bool router_in_dtype = false;  // logits in the activations' dtype (transformers' routers), else fp32 (hf_moe's)
  WeightView w1, w2;  // checked once (check_experts)
  at::Tensor b1, b2;  // fp32 (the activations' dtype's values, as the eager experts cast them), or undefined
  c10::optional<DenseMLP> mlp, shared;  // the dense layer's MLP; the MoE block's shared experts
  at::Tensor shared_gate;               // [1, H]: the shared experts' output scaled by sigmoid(x . gate), or undefined

  LayerPlan(const Tensors& t, const Numbers& n, const Names& names, at::ScalarType dt, int64_t i, int64_t top_k,
            bool glu) {
    attention = attention_weights(
        dt, static_cast<int64_t>(number(n, "head_dim", i)), need(t, "input_norm", i), number(n, "eps", i),
        need(t, "q.weight", i), maybe(t, "q.scale"), maybe(t, "q.bias"), need(t, "k.weight", i), maybe(t, "k.scale"),
        maybe(t, "k.bias"), need(t, "v.weight", i), maybe(t, "v.scale"), maybe(t, "v.bias"), need(t, "o.weight", i),
        maybe(t, "o.scale"), maybe(t, "o.bias"), maybe(t, "q_norm"), maybe(t, "k_norm"), number(n, "qk_eps", i),
        number(n, "scaling", i), need(t, "post_norm", i), number(n, "post_eps", i));
    moe = t.contains("router");
    if (!moe) {
      mlp = DenseMLP(t, n, names, "mlp", dt, i, attention.hidden);
      return;
    }
    if (t.contains("shared.up.weight")) shared = DenseMLP(t, n, names, "shared", dt, i, attention.hidden);
    if (t.contains("shared_gate")) {
      shared_gate = need(t, "shared_gate", i);
      TORCH_CHECK(shared.has_value() && shared_gate.dim() == 2 && shared_gate.size(0) == 1 &&
                      shared_gate.size(1) == attention.hidden && shared_gate.scalar_type() == dt,
                  "DecodePlan: layer ", i, "'s shared expert gate must be a [1, ", attention.hidden, "] ", dt,
                  " weight of a layer with shared experts");
    }
    const auto in_dtype = n.find("router_in_dtype");
    router_in_dtype = in_dtype != n.end() && in_dtype->value() != 0.0;
    const at::Tensor gate = need(t, "router", i).to(router_in_dtype ? dt : at::kFloat).contiguous();
    TORCH_CHECK(gate.dim() == 2 && gate.size(1) == attention.hidden && gate.size(0) >= top_k,
                "DecodePlan: layer ", i, "'s router weight must be [E, ", attention.hidden, "] with E >= top_k = ",
                top_k, ", got ", gate.sizes());
    router = linear_weight(gate, c10::nullopt, c10::nullopt, "DecodePlan (router)");
    const at::Tensor weight1 = need(t, "w1", i).contiguous(), weight2 = need(t, "w2", i).contiguous();
    const auto bias1 = cast(maybe(t, "b1"), dt), bias2 = cast(maybe(t, "b2"), dt);
    TORCH_CHECK(weight1.dim() == 3 && weight2.dim() == 3 && weight1.size(0) == router.out &&
                    weight2.size(0) == router.out,
                "DecodePlan: layer ", i, "'s experts must be w1 [E, W, ", attention.hidden, "] and w2 [E, ",
                attention.hidden, ", I] for its ", router.out, " experts, got ", weight1.sizes(), " and ",
                weight2.sizes());
    std::tie(w1, w2) = check_experts(weight1, maybe(t, "w1_scale"), bias1, weight2, maybe(t, "w2_scale"), bias2,
                                     attention.hidden, glu);
    if (bias1.has_value()) b1 = bias1->to(at::kFloat).contiguous();
    if (bias2.has_value()) b2 = bias2->to(at::kFloat).contiguous();
  }
};

class DecodePlan : public torch::CustomClassHolder {
 public:
  DecodePlan(Tensors tensors, Numbers numbers, int64_t top_k, bool norm_topk_prob, std::string activation, bool glu)
      : embed_(need(tensors, "embed", -1)),
        final_norm_(need(tensors, "final_norm", -1)),
        final_eps_(number(numbers, "final_eps", -1)),
        top_k_(top_k),
        norm_topk_prob_(norm_topk_prob),
        activation_(std::move(activation)),
        glu_(glu) {
    dtype_ = embed_.scalar_type();
    TORCH_CHECK(dtype_ == at::kFloat || dtype_ == at::kBFloat16, "DecodePlan: the model must be fp32 or bf16, got ",
                dtype_);
    TORCH_CHECK(top_k > 0, "DecodePlan: top_k must be positive, got ", top_k);
    TORCH_CHECK(embed_.dim() == 2 && final_norm_.numel() == embed_.size(1) && final_norm_.scalar_type() == dtype_,
                "DecodePlan: the embedding [V, H] and the final norm [H] do not fit: ", embed_.sizes(), ", ",
                final_norm_.sizes());
    head_scale_ = maybe(tensors, "lm_head.scale");
    head_bias_ = maybe(tensors, "lm_head.bias");
    head_ = linear_weight(need(tensors, "lm_head.weight", -1), head_scale_, head_bias_, "DecodePlan (lm_head)");
    TORCH_CHECK(head_.k == embed_.size(1), "DecodePlan: the LM head takes ", head_.k, " inputs, the model's hidden "
                "size is ", embed_.size(1));
  }

  void add_layer(Tensors tensors, Numbers numbers, Names names) {
    const int64_t i = static_cast<int64_t>(layers_.size());
    layers_.emplace_back(tensors, numbers, names, dtype_, i, top_k_, glu_);
    if (layers_.back().moe) experts_ = std::max<int64_t>(experts_, layers_.back().router.out);
    TORCH_CHECK(layers_.back().attention.hidden == embed_.size(1), "DecodePlan: layer ", i, " works on hidden size ",
                layers_.back().attention.hidden, ", the embedding gives ", embed_.size(1));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // The data addresses of the workspace's tensors (what a test checks stays put from step to step).
  std::vector<int64_t> workspace_addresses() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<int64_t> out;
    for (const at::Tensor* t : {&hidden_, &attended_, &normed_, &cos_rows_, &sin_rows_, &index_, &weights_,
                                &router_x_, &logits_, &experts_out_, &final_out_})
      out.push_back(t->defined() ? reinterpret_cast<int64_t>(t->data_ptr()) : 0);
    return out;
  }

  at::Tensor step(at::Tensor input_ids, at::Tensor position_ids, c10::optional<at::Tensor> mask, at::Tensor cos,
                  at::Tensor sin, std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                  std::vector<at::Tensor> lengths) {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t n_layers = num_layers();
    TORCH_CHECK(n_layers > 0 && static_cast<int64_t>(keys.size()) == n_layers &&
                    static_cast<int64_t>(values.size()) == n_layers && static_cast<int64_t>(lengths.size()) == n_layers,
                "DecodePlan: the plan has ", n_layers, " layers; got caches of ", keys.size(), " keys, ",
                values.size(), " values and ", lengths.size(), " lengths");
    TORCH_CHECK(input_ids.dim() == 2 && input_ids.size(1) == 1 && position_ids.sizes() == input_ids.sizes() &&
                    input_ids.scalar_type() == at::kLong && position_ids.scalar_type() == at::kLong,
                "DecodePlan: input_ids and position_ids must be int64 [B, 1] (one token per row), got ",
                input_ids.sizes(), " and ", position_ids.sizes());
    const int64_t batch = input_ids.size(0);
    buffers(batch);
    at::index_select_out(hidden_, embed_, 0, input_ids.reshape(-1));  // [B, H]
    const at::Tensor positions = position_ids.reshape(-1);
    at::index_select_out(cos_rows_, cos, 0, positions);  // [B, D]
    at::index_select_out(sin_rows_, sin, 0, positions);
    for (int64_t i = 0; i < n_layers; ++i) {
      const LayerPlan& layer = layers_[i];
      at::Tensor& length = lengths[i];
      TORCH_CHECK(length.scalar_type() == at::kLong && length.numel() == 1 && length.is_contiguous(),
                  "DecodePlan: layer ", i, "'s cache length must be one int64 value");
      attention_block(layer.attention, hidden_, cos_rows_, sin_rows_, keys[i], values[i],
                      length.data_ptr<int64_t>()[0], mask, "auto", workspace_, attended_, normed_);
      length.data_ptr<int64_t>()[0] += 1;
      const at::Tensor out = layer.moe ? moe_block(layer, i) : (*layer.mlp)(normed_);
      add(attended_, out, hidden_);  // the next layer's input
    }
    rms_norm_rows(hidden_, final_norm_, final_eps_, row_, final_out_);  // the final norm, as the layers' norms
    if (batch > kLinearIntoRows)  // more rows than the decode kernels take: linear_infer's GEMM (it allocates)
      return linear_infer_cpu(final_out_, head_.weight, head_scale_, head_bias_, "auto").unsqueeze(1);
    at::Tensor logits = at::empty({batch, head_.out}, embed_.options());  // the step's result, the caller's to keep
    linear_into(head_, final_out_, "auto", widened_, logits);
    return logits.unsqueeze(1);  // [B, 1, V]
  }

 private:
  // The step's tensors for a batch of `batch` rows: views of buffers made for the largest batch seen (made again
  // only when a larger batch comes), taken again only when the batch changes.
  void buffers(int64_t batch) {
    if (batch_ == batch) return;
    const auto options = embed_.options();
    const auto f32 = options.dtype(at::kFloat);
    const int64_t h = embed_.size(1), d = layers_[0].attention.head_dim, e = std::max<int64_t>(experts_, 1);
    if (batch > capacity_) {
      store_ = {at::empty({batch, h}, options),  at::empty({batch, h}, options),
                at::empty({batch, h}, options),  at::empty({batch, d}, options),
                at::empty({batch, d}, options),  at::empty({batch, top_k_}, options.dtype(at::kLong)),
                at::empty({batch, top_k_}, f32), at::empty({batch, h}, f32),
                at::empty({batch * e}, f32),     at::empty({batch, h}, options),
                at::empty({batch, h}, options)};
      capacity_ = batch;
    }
    at::Tensor* views[] = {&hidden_,  &attended_, &normed_, &cos_rows_,   &sin_rows_,  &index_,
                           &weights_, &router_x_, &logits_, &experts_out_, &final_out_};
    for (size_t j = 0; j < store_.size(); ++j) {
      const at::Tensor& full = store_[j];
      *views[j] = full.dim() == 1 ? full : full.narrow(0, 0, batch);  // (flat ones: viewed per layer's experts)
    }
    probs_.resize(experts_);
    top_.resize(top_k_);
    batch_ = batch;
  }

  // The routed experts' output [B, H] for the MLP input normed_ [B, H], routed as the eager TopKRouter routes: the
  // router's logits (fp32 products of fp32 inputs: hf_moe's routers; of the activations' dtype, rounded to it:
  // transformers'), their fp32 softmax, the top k (the larger value first, the lower expert first among equal ones),
  // divided by their sum where `norm_topk_prob`, cast to the activations' dtype. The same values as the eager
  // router's but for the order of the sums (hf_moe's dot kernels and a loop here, not ATen's GEMM and softmax, whose
  // code a step's weights evict from the caches: calling them cost several times their work).
  at::Tensor moe_block(const LayerPlan& layer, int64_t i) {
    const int64_t rows = normed_.size(0), experts = layer.router.out, hid = normed_.size(1);
    TORCH_CHECK(experts <= static_cast<int64_t>(probs_.size()), "DecodePlan: layer ", i, " has ", experts,
                " experts, more than the plan's ", probs_.size());
    const bool bf16 = dtype_ == at::kBFloat16;
    float* logits = logits_.data_ptr<float>();  // [rows, experts]
    if (layer.router.dtype == at::kBFloat16) {  // transformers' router on bf16 activations: logits rounded to bf16
      linear_rows(layer.router, nullptr, static_cast<const uint16_t*>(normed_.data_ptr()), rows, "auto", logits);
      for (int64_t j = 0; j < rows * experts; ++j) logits[j] = static_cast<float>(at::BFloat16(logits[j]));
    } else {  // fp32 products of fp32 inputs (bf16 activations widened exactly)
      float* x = bf16 ? router_x_.data_ptr<float>() : normed_.data_ptr<float>();
      if (bf16) {
        const auto* in = static_cast<const at::BFloat16*>(normed_.data_ptr());
        for (int64_t j = 0; j < rows * hid; ++j) x[j] = static_cast<float>(in[j]);
      }
      linear_rows(layer.router, x, nullptr, rows, "auto", logits);
    }
    int64_t* idx = index_.data_ptr<int64_t>();
    float* routing = weights_.data_ptr<float>();
    for (int64_t b = 0; b < rows; ++b) {
      const float* row = logits + b * experts;  // softmax: exp(l - max) / sum, in fp32
      const float top = *std::max_element(row, row + experts);
      float sum = 0.0f;
      for (int64_t e = 0; e < experts; ++e) sum += (probs_[e] = std::exp(row[e] - top));
      for (int64_t e = 0; e < experts; ++e) probs_[e] /= sum;
      float total = 0.0f;
      for (int64_t j = 0; j < top_k_; ++j) {
        int64_t best = -1;
        for (int64_t e = 0; e < experts; ++e)
          if (probs_[e] >= 0.0f && (best < 0 || probs_[e] > probs_[best])) best = e;
        idx[b * top_k_ + j] = best;  // -1 (no expert: dropped by the experts op) only where every value is NaN
        top_[j] = best < 0 ? 0.0f : probs_[best];
        total += top_[j];
        if (best >= 0) probs_[best] = -1.0f;  // taken
      }
      for (int64_t j = 0; j < top_k_; ++j) {  // rounded to the activations' dtype, as the eager experts get them
        const float w = norm_topk_prob_ ? top_[j] / total : top_[j];
        routing[b * top_k_ + j] = bf16 ? static_cast<float>(at::BFloat16(w)) : w;
      }
    }
    at::Tensor& out = experts_out_;
    moe_experts_infer_into(normed_, idx, routing, top_k_, layer.w1, layer.b1, layer.w2, layer.b2,
                           activation_, glu_, "auto", *experts_ws_, out);
    if (!layer.shared.has_value()) return out;
    // The shared experts as the eager block adds them: out + sigmoid(gate(x)) * shared(x), ATen's kernels
    at::Tensor shared = (*layer.shared)(normed_);
    if (layer.shared_gate.defined()) shared = at::mul(at::sigmoid(at::linear(normed_, layer.shared_gate)), shared);
    return at::add(out, shared);
  }

  // out = a + b in the activations' dtype (the eager residual add: fp32 sum, rounded once).
  void add(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) const {
    const int64_t n = out.numel();
    if (dtype_ == at::kBFloat16) {
      const auto* x = a.data_ptr<at::BFloat16>();
      const auto* y = b.data_ptr<at::BFloat16>();
      auto* z = out.data_ptr<at::BFloat16>();
      for (int64_t j = 0; j < n; ++j) z[j] = at::BFloat16(static_cast<float>(x[j]) + static_cast<float>(y[j]));
    } else {
      const float* x = a.data_ptr<float>();
      const float* y = b.data_ptr<float>();
      float* z = out.data_ptr<float>();
      for (int64_t j = 0; j < n; ++j) z[j] = x[j] + y[j];
    }
  }

  at::Tensor embed_, final_norm_;
  double final_eps_;
  LinearWeight head_;  // checked once; the kernel takes the tensors themselves
  c10::optional<at::Tensor> head_scale_, head_bias_;
  int64_t top_k_;
  bool norm_topk_prob_;
  std::string activation_;
  bool glu_;
  at::ScalarType dtype_ = at::kFloat;
  std::vector<LayerPlan> layers_;
  int64_t experts_ = 0;  // the most experts of any MoE layer
  std::mutex mutex_;
  // The workspace: buffers for the largest batch seen (store_), viewed for the last step's batch.
  int64_t batch_ = -1, capacity_ = 0;
  std::vector<at::Tensor> store_;
  at::Tensor hidden_, attended_, normed_, cos_rows_, sin_rows_, index_, weights_, router_x_, logits_, experts_out_,
      final_out_;
  std::vector<float> probs_, top_, widened_, row_;
  AttentionWorkspace workspace_;
  ExpertsWorkspacePtr experts_ws_ = make_experts_workspace();
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_moe, m) {
  m.class_<DecodePlan>("DecodePlan")
      .def(torch::init<Tensors, Numbers, int64_t, bool, std::string, bool>())
      .def("add_layer", &DecodePlan::add_layer)
      .def("num_layers", &DecodePlan::num_layers)
      .def("workspace_addresses", &DecodePlan::workspace_addresses)
      .def("step", &DecodePlan::step);
}

}  // namespace hf_moe
