// The whole decode step of a Llama-layer MoE model, planned once: a registered class, torch.classes.hf_moe.DecodePlan
// (hf_moe/decode_native.py builds it and says which models it serves):
//
//   plan = DecodePlan(model_tensors, model_numbers, top_k, norm_topk_prob, activation, glu)
//   plan.add_layer(layer_tensors, layer_numbers)          once per decoder layer, in order
//   plan.step(input_ids [B, 1], position_ids [B, 1], mask [B, L]?, cos [P, D], sin [P, D], keys, values, lengths)
//       -> logits [B, 1, V]
//
// Every field is passed by name (a dict of tensors, a dict of numbers; a tensor the layer does not have is left
// out), read in one place (`LayerPlan`, `DecodePlan`'s constructor) and checked there, once: the weights against
// each other, the router cast to fp32, the biases to the activations' dtype. A step only computes: the embedding
// row; per layer the attention sub-block (attention_block, on the plan's workspace), the router (the eager
// router's fp32 logits and softmax by ATen's kernels, top-k, renormalisation and cast: moe_block), the experts
// (moe_experts_infer_cpu) and the residual add; then the final norm and the LM head (linear_infer_cpu). Per call it
// checks only what the call brings (ids, caches, mask). The plan's buffers are made for the largest batch seen and
// reused; one step runs at a time (a mutex: two threads may share a plan). `cos` and `sin` are the rotary
// embedding's values for every position the cache holds; a row's values are those of its position id. The caches
// are written at each layer's length, which grows by one (as the compiled step's `length.add_(1)`).

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "decode_ops.h"

namespace hf_moe {
namespace {

using Tensors = c10::Dict<std::string, at::Tensor>;
using Numbers = c10::Dict<std::string, double>;

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

// One decoder layer, read by name from its dicts (hf_moe.decode_native.layer_fields names them): adding a tensor
// to a layer is one field and one read here.
struct LayerPlan {
  AttentionWeights attention;
  at::Tensor router;  // fp32 [E, H]
  at::Tensor w1, w2;
  c10::optional<at::Tensor> w1_scale, w2_scale, b1, b2;

  LayerPlan(const Tensors& t, const Numbers& n, at::ScalarType dt, int64_t i, int64_t top_k) {
    attention = attention_weights(
        dt, static_cast<int64_t>(number(n, "head_dim", i)), need(t, "input_norm", i), number(n, "eps", i),
        need(t, "q.weight", i), maybe(t, "q.scale"), maybe(t, "q.bias"), need(t, "k.weight", i), maybe(t, "k.scale"),
        maybe(t, "k.bias"), need(t, "v.weight", i), maybe(t, "v.scale"), maybe(t, "v.bias"), need(t, "o.weight", i),
        maybe(t, "o.scale"), maybe(t, "o.bias"), maybe(t, "q_norm"), maybe(t, "k_norm"), number(n, "qk_eps", i),
        number(n, "scaling", i), need(t, "post_norm", i), number(n, "post_eps", i));
    router = need(t, "router", i).to(at::kFloat).contiguous();
    TORCH_CHECK(router.dim() == 2 && router.size(1) == attention.hidden && router.size(0) >= top_k,
                "DecodePlan: layer ", i, "'s router weight must be [E, ", attention.hidden, "] with E >= top_k = ",
                top_k, ", got ", router.sizes());
    w1 = need(t, "w1", i).contiguous();
    w2 = need(t, "w2", i).contiguous();
    w1_scale = maybe(t, "w1_scale");
    w2_scale = maybe(t, "w2_scale");
    b1 = cast(maybe(t, "b1"), dt);
    b2 = cast(maybe(t, "b2"), dt);
    TORCH_CHECK(w1.dim() == 3 && w2.dim() == 3 && w1.size(0) == router.size(0) && w2.size(0) == router.size(0) &&
                    w1.size(2) == attention.hidden && w2.size(1) == attention.hidden,
                "DecodePlan: layer ", i, "'s experts must be w1 [E, W, ", attention.hidden, "] and w2 [E, ",
                attention.hidden, ", I] for its ", router.size(0), " experts, got ", w1.sizes(), " and ", w2.sizes());
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

  void add_layer(Tensors tensors, Numbers numbers) {
    const int64_t i = static_cast<int64_t>(layers_.size());
    layers_.emplace_back(tensors, numbers, dtype_, i, top_k_);
    TORCH_CHECK(layers_.back().attention.hidden == embed_.size(1), "DecodePlan: layer ", i, " works on hidden size ",
                layers_.back().attention.hidden, ", the embedding gives ", embed_.size(1));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

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
      const at::Tensor out = moe_block(layer, i);
      add(attended_, out, hidden_);  // the next layer's input
    }
    // The final norm as transformers' LlamaRMSNorm computes it, with ATen's kernels (the eager model's bits)
    const at::Tensor h = hidden_.to(at::kFloat);
    const at::Tensor normed = final_norm_ * (h * at::rsqrt(h.pow(2).mean(-1, true) + final_eps_)).to(dtype_);
    return linear_infer_cpu(normed, head_.weight, head_scale_, head_bias_, "auto").unsqueeze(1);  // [B, 1, V]
  }

 private:
  // The step's tensors for a batch of `batch` rows, made when the batch changes.
  void buffers(int64_t batch) {
    if (batch_ == batch) return;
    const auto options = embed_.options();
    const int64_t h = embed_.size(1), d = layers_[0].attention.head_dim;
    hidden_ = at::empty({batch, h}, options);
    attended_ = at::empty({batch, h}, options);
    normed_ = at::empty({batch, h}, options);
    cos_rows_ = at::empty({batch, d}, options);
    sin_rows_ = at::empty({batch, d}, options);
    index_ = at::empty({batch, top_k_}, options.dtype(at::kLong));
    weights_ = at::empty({batch, top_k_}, options);
    probs_.resize(layers_[0].router.size(0));
    top_.resize(top_k_);
    batch_ = batch;
  }

  // The routed experts' output [B, H] for the MLP input normed_ [B, H], routed as the eager TopKRouter routes: fp32
  // logits and their softmax by ATen's kernels (the eager router's own calls, so the same bits), the top k (the
  // larger value first, the lower expert first among equal ones), divided by their sum where `norm_topk_prob`, cast
  // to the activations' dtype.
  at::Tensor moe_block(const LayerPlan& layer, int64_t i) {
    const at::Tensor softmax = at::softmax(at::linear(normed_.to(at::kFloat), layer.router), -1).contiguous();
    const int64_t rows = softmax.size(0), experts = softmax.size(1);
    TORCH_CHECK(experts == static_cast<int64_t>(probs_.size()), "DecodePlan: layer ", i, " has ", experts,
                " experts, layer 0 ", probs_.size());
    int64_t* idx = index_.data_ptr<int64_t>();
    const bool bf16 = dtype_ == at::kBFloat16;
    for (int64_t b = 0; b < rows; ++b) {
      std::copy_n(softmax.data_ptr<float>() + b * experts, experts, probs_.data());
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
      for (int64_t j = 0; j < top_k_; ++j) {
        const float w = norm_topk_prob_ ? top_[j] / total : top_[j];
        if (bf16) weights_.data_ptr<at::BFloat16>()[b * top_k_ + j] = at::BFloat16(w);
        else weights_.data_ptr<float>()[b * top_k_ + j] = w;
      }
    }
    return moe_experts_infer_cpu(normed_, index_, weights_, layer.w1, layer.w1_scale, layer.b1, layer.w2,
                                 layer.w2_scale, layer.b2, activation_, glu_, "auto");
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
  std::mutex mutex_;
  // The workspace: made for the batch of the last step, reused while it stays.
  int64_t batch_ = -1;
  at::Tensor hidden_, attended_, normed_, cos_rows_, sin_rows_, index_, weights_;
  std::vector<float> probs_, top_;
  AttentionWorkspace workspace_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_moe, m) {
  m.class_<DecodePlan>("DecodePlan")
      .def(torch::init<Tensors, Numbers, int64_t, bool, std::string, bool>())
      .def("add_layer", &DecodePlan::add_layer)
      .def("num_layers", &DecodePlan::num_layers)
      .def("step", &DecodePlan::step);
}

}  // namespace hf_moe
