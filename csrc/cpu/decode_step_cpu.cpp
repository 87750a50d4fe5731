// The whole decode step of a Llama-layer MoE model in one call from Python, for one token per row over a static KV
// cache (hf_moe/decode_native.py builds its arguments and says which models it serves):
//
//   hf_moe::decode_step(input_ids [B, 1], position_ids [B, 1], mask [B, L]?, embed [V, H], cos [P, D], sin [P, D],
//                       layers, layer_floats, keys, values, lengths, final_norm, final_eps, lm_head, ...)
//       -> logits [B, 1, V]
//
// It runs what hf_moe.decode.FusedDecodeStep.forward runs, layer by layer, with no Python and no dispatch between
// the kernels: the embedding row; per layer the attention sub-block (decode_attention_block_cpu), the router (the
// eager router's fp32 logits, softmax, top-k, renormalisation and cast: moe_block), the experts
// (moe_experts_infer_cpu) and the residual add; then the final norm and the LM head (linear_infer_cpu). `cos` and
// `sin` are the rotary embedding's values for every position the cache holds (the model's own rotary module
// computes them once per cache); a row's values are those of its position id.
//
// `layers` holds kSlots tensors per layer, None where the model has none (see kSlots' names below), and
// `layer_floats` kFloats numbers per layer. Every kernel checks its own inputs. The caches are written at each
// layer's length, which grows by one (as the compiled step's `length.add_(1)`).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "decode_ops.h"

namespace hf_moe {
namespace {

// Per layer, in `layers`: the attention sub-block's tensors, then the MoE block's.
enum Slot {
  kInputNorm, kWq, kWqScale, kBq, kWk, kWkScale, kBk, kWv, kWvScale, kBv, kWo, kWoScale, kBo, kQNorm, kKNorm,
  kPostNorm, kRouter, kW1, kW1Scale, kB1, kW2, kW2Scale, kB2, kSlots
};
// Per layer, in `layer_floats`: the input norm's eps, the q/k norms' eps, the attention scaling, the post norm's eps.
enum FloatSlot { kEps, kQkEps, kScaling, kPostEps, kFloats };

at::Tensor need(const c10::optional<at::Tensor>& t, int64_t layer, const char* name) {
  TORCH_CHECK(t.has_value() && t->defined(), "decode_step: layer ", layer, " has no ", name);
  return *t;
}

// The routed experts' output [B, H] for the MLP input x [B, H], routed as the eager TopKRouter routes: fp32 logits
// and their softmax by ATen's kernels (the eager router's own calls, so the same bits), the top k (the larger value
// first, the lower expert first among equal ones), divided by their sum where `norm_topk_prob`, cast to x's dtype.
at::Tensor moe_block(const at::Tensor& x, const c10::List<c10::optional<at::Tensor>>& layers, int64_t base,
                     int64_t layer, int64_t top_k, bool norm_topk_prob, c10::string_view activation, bool glu,
                     c10::string_view kernels) {
  const at::Tensor router = need(layers.get(base + kRouter), layer, "router weight");
  TORCH_CHECK(router.scalar_type() == at::kFloat && router.dim() == 2 && router.size(0) >= top_k,
              "decode_step: layer ", layer, "'s router weight must be fp32 [E, H] with E >= top_k = ", top_k);
  const at::Tensor softmax = at::softmax(at::linear(x.to(at::kFloat), router), -1).contiguous();  // [B, E] fp32
  const int64_t rows = softmax.size(0), experts = softmax.size(1);
  auto index = at::empty({rows, top_k}, x.options().dtype(at::kLong));
  auto weights = at::empty({rows, top_k}, x.options());
  int64_t* idx = index.data_ptr<int64_t>();
  std::vector<float> probs(experts), top(top_k);
  for (int64_t b = 0; b < rows; ++b) {
    std::copy_n(softmax.data_ptr<float>() + b * experts, experts, probs.data());
    float total = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < experts; ++e)
        if (probs[e] >= 0.0f && (best < 0 || probs[e] > probs[best])) best = e;
      idx[b * top_k + j] = best;  // -1 (no expert: dropped by the experts op) only where every value is NaN
      top[j] = best < 0 ? 0.0f : probs[best];
      total += top[j];
      if (best >= 0) probs[best] = -1.0f;  // taken
    }
    for (int64_t j = 0; j < top_k; ++j) {
      const float w = norm_topk_prob ? top[j] / total : top[j];
      if (x.scalar_type() == at::kBFloat16) weights.data_ptr<at::BFloat16>()[b * top_k + j] = at::BFloat16(w);
      else weights.data_ptr<float>()[b * top_k + j] = w;
    }
  }
  return moe_experts_infer_cpu(x, index, weights, need(layers.get(base + kW1), layer, "w1"),
                               layers.get(base + kW1Scale), layers.get(base + kB1),
                               need(layers.get(base + kW2), layer, "w2"), layers.get(base + kW2Scale),
                               layers.get(base + kB2), activation, glu, kernels);
}

at::Tensor decode_step_cpu(const at::Tensor& input_ids, const at::Tensor& position_ids,
                           const c10::optional<at::Tensor>& mask, const at::Tensor& embed, const at::Tensor& cos,
                           const at::Tensor& sin, const c10::List<c10::optional<at::Tensor>>& layers,
                           at::ArrayRef<double> layer_floats, at::TensorList keys, at::TensorList values,
                           at::TensorList lengths, const at::Tensor& final_norm, double final_eps,
                           const at::Tensor& lm_head, const c10::optional<at::Tensor>& lm_head_scale,
                           const c10::optional<at::Tensor>& lm_head_bias, int64_t top_k, bool norm_topk_prob,
                           c10::string_view activation, bool glu, c10::string_view kernels) {
  const int64_t n_layers = static_cast<int64_t>(keys.size());
  TORCH_CHECK(static_cast<int64_t>(layers.size()) == n_layers * kSlots &&
                  static_cast<int64_t>(layer_floats.size()) == n_layers * kFloats &&
                  static_cast<int64_t>(values.size()) == n_layers && static_cast<int64_t>(lengths.size()) == n_layers,
              "decode_step: ", n_layers, " layers' caches need ", n_layers * kSlots, " layer tensors, ",
              n_layers * kFloats, " layer floats and ", n_layers, " values and lengths; got ", layers.size(), ", ",
              layer_floats.size(), ", ", values.size(), ", ", lengths.size());
  TORCH_CHECK(input_ids.dim() == 2 && input_ids.size(1) == 1 && position_ids.sizes() == input_ids.sizes() &&
                  input_ids.scalar_type() == at::kLong && position_ids.scalar_type() == at::kLong,
              "decode_step: input_ids and position_ids must be int64 [B, 1] (one token per row), got ",
              input_ids.sizes(), " and ", position_ids.sizes());
  TORCH_CHECK(top_k > 0, "decode_step: top_k must be positive, got ", top_k);
  const auto dt = embed.scalar_type();
  at::Tensor hidden = embed.index_select(0, input_ids.reshape(-1)).contiguous();  // [B, H]
  const at::Tensor positions = position_ids.reshape(-1);
  const at::Tensor cos_rows = cos.index_select(0, positions).contiguous();  // [B, D]
  const at::Tensor sin_rows = sin.index_select(0, positions).contiguous();
  const bool bf16 = dt == at::kBFloat16;
  for (int64_t i = 0; i < n_layers; ++i) {
    const int64_t base = i * kSlots;
    const double* f = layer_floats.data() + i * kFloats;
    at::Tensor k_cache = keys[i], v_cache = values[i];
    const at::Tensor& length = lengths[i];
    auto [attended, x] = decode_attention_block_cpu(
        hidden, need(layers.get(base + kInputNorm), i, "input norm"), f[kEps], need(layers.get(base + kWq), i, "q"),
        layers.get(base + kWqScale), layers.get(base + kBq), need(layers.get(base + kWk), i, "k"),
        layers.get(base + kWkScale), layers.get(base + kBk), need(layers.get(base + kWv), i, "v"),
        layers.get(base + kWvScale), layers.get(base + kBv), need(layers.get(base + kWo), i, "o"),
        layers.get(base + kWoScale), layers.get(base + kBo), layers.get(base + kQNorm), layers.get(base + kKNorm),
        f[kQkEps], cos_rows, sin_rows, k_cache, v_cache, length, mask, f[kScaling],
        need(layers.get(base + kPostNorm), i, "post-attention norm"), f[kPostEps], kernels);
    TORCH_CHECK(length.scalar_type() == at::kLong && length.numel() == 1 && length.is_contiguous(),
                "decode_step: layer ", i, "'s cache length must be one int64 value");
    length.data_ptr<int64_t>()[0] += 1;
    const at::Tensor out = moe_block(x, layers, base, i, top_k, norm_topk_prob, activation, glu, kernels);
    // hidden = attended + out, in the activations' dtype (the eager residual add: fp32 sum, rounded once)
    hidden = at::empty_like(attended);
    const int64_t n = hidden.numel();
    if (bf16) {
      const auto* a = attended.data_ptr<at::BFloat16>();
      const auto* o = out.data_ptr<at::BFloat16>();
      auto* h = hidden.data_ptr<at::BFloat16>();
      for (int64_t j = 0; j < n; ++j) h[j] = at::BFloat16(static_cast<float>(a[j]) + static_cast<float>(o[j]));
    } else {
      const float* a = attended.data_ptr<float>();
      const float* o = out.data_ptr<float>();
      float* h = hidden.data_ptr<float>();
      for (int64_t j = 0; j < n; ++j) h[j] = a[j] + o[j];
    }
  }
  // The final norm as transformers' LlamaRMSNorm computes it, with ATen's kernels (the same bits as the eager model's)
  const at::Tensor h = hidden.to(at::kFloat);
  const at::Tensor normed = final_norm * (h * at::rsqrt(h.pow(2).mean(-1, true) + final_eps)).to(dt);
  return linear_infer_cpu(normed, lm_head, lm_head_scale, lm_head_bias, kernels).unsqueeze(1);  // [B, 1, V]
}

}  // namespace

// Defined here, not with the other ops in Python: it is called from Python by the fused step alone (never traced,
// exported or differentiated), and exists where this extension is loaded.
TORCH_LIBRARY_FRAGMENT(hf_moe, m) {
  m.def(
      "decode_step(Tensor input_ids, Tensor position_ids, Tensor? mask, Tensor embed, Tensor cos, Tensor sin, "
      "Tensor?[] layers, float[] layer_floats, Tensor(a!)[] keys, Tensor(b!)[] values, Tensor(c!)[] lengths, "
      "Tensor final_norm, float final_eps, Tensor lm_head, Tensor? lm_head_scale, Tensor? lm_head_bias, int top_k, "
      "bool norm_topk_prob, str activation, bool glu, str kernels=\"auto\") -> Tensor");
}

TORCH_LIBRARY_IMPL(hf_moe, CPU, m) { m.impl("decode_step", &decode_step_cpu); }

}  // namespace hf_moe
