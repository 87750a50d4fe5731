// The CPU kernels of the inference ops that the whole decode step (decode_step_cpu.cpp) calls directly, without the
// dispatcher, and the attention sub-block's planned form (weights checked once, a reused workspace): defined in
// decode_cpu.cpp (linear_infer, decode_attention_block) and infer_cpu.cpp (moe_experts_infer); their schemas and
// contracts are there and in hf_moe/ops/library.py, hf_moe/ops/decode.py.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace hf_moe {

// A weight as the kernels read it, checked once in one place (`weight_view`): `count` matrices of [out, k] (a linear
// layer's [O, K]: one; experts' [E, O, K]: E), fp32, bf16, or int8 with fp32 scales: [(E,) O] one per output row, or
// [(E,) O, G] one per group of K / G inputs (each group a multiple of 32 inputs). `weight` and `scale_tensor` keep the
// memory `data` and `scale` point into.
struct WeightView {
  const char* data = nullptr;
  at::ScalarType dtype = at::kFloat;
  int64_t count = 1, out = 0, k = 0;
  const float* scale = nullptr;
  int64_t ld_scale = 1, group = 1;
  at::Tensor weight, scale_tensor;
};

// The view of `w` (2-D or 3-D, contiguous) and its scales, or an error naming `name` and what is wrong.
WeightView weight_view(const at::Tensor& w, const c10::optional<at::Tensor>& scale, const std::string& name);

// A linear layer's weight [O, K] and optional bias [O] (fp32, contiguous, or undefined), checked once
// (`linear_weight`).
struct LinearWeight : WeightView {
  at::Tensor bias;
};

LinearWeight linear_weight(const at::Tensor& w, const c10::optional<at::Tensor>& scale,
                           const c10::optional<at::Tensor>& bias, const char* name);

// One decoder layer's attention sub-block (decode_cpu.cpp): its weights, checked once against each other
// (`attention_weights`), and its shape; q_norm and k_norm are undefined where the layer has none (Qwen3 has them).
struct AttentionWeights {
  at::ScalarType dtype = at::kFloat;  // of the activations, the norms and the caches
  int64_t hidden = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  at::Tensor input_norm, post_norm, q_norm, k_norm;
  LinearWeight q, k, v, o;
  double eps = 1e-6, qk_eps = 1e-6, scaling = 1.0, post_eps = 1e-6;
};

AttentionWeights attention_weights(at::ScalarType dt, int64_t head_dim, const at::Tensor& input_norm, double eps,
                                   const at::Tensor& wq, const c10::optional<at::Tensor>& wq_scale,
                                   const c10::optional<at::Tensor>& bq, const at::Tensor& wk,
                                   const c10::optional<at::Tensor>& wk_scale, const c10::optional<at::Tensor>& bk,
                                   const at::Tensor& wv, const c10::optional<at::Tensor>& wv_scale,
                                   const c10::optional<at::Tensor>& bv, const at::Tensor& wo,
                                   const c10::optional<at::Tensor>& wo_scale, const c10::optional<at::Tensor>& bo,
                                   const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                                   double qk_eps, double scaling, const at::Tensor& post_norm, double post_eps);

// The attention sub-block's buffers, grown to the largest call seen and reused: a step allocates nothing once they
// fit. One workspace serves one call at a time.
struct AttentionWorkspace {
  std::vector<float> x, qkv, attn, part_m, part_l, part_acc, scratch, row, q_f32;
  std::vector<uint16_t> x_bits, q_bits, attn_bits;
  std::vector<char> valid;
  std::vector<int64_t> end;
};

// One token's attention sub-block of `w` (what hf_moe::decode_attention_block computes) for hidden [B, H], with
// cos/sin [B, head_dim], the caches [B, kv_heads, L, head_dim] written at `pos`, into out_hidden and out_normed
// ([B, H] each, allocated by the caller, apart from hidden). Checks only what depends on the call.
void attention_block(const AttentionWeights& w, const at::Tensor& hidden, const at::Tensor& cos,
                     const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, int64_t pos,
                     const c10::optional<at::Tensor>& mask, c10::string_view kernels, AttentionWorkspace& ws,
                     at::Tensor& out_hidden, at::Tensor& out_normed);

at::Tensor linear_infer_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scale,
                            const c10::optional<at::Tensor>& bias, c10::string_view kernels);

std::tuple<at::Tensor, at::Tensor> decode_attention_block_cpu(
    const at::Tensor& hidden, const at::Tensor& input_norm, double eps, const at::Tensor& wq,
    const c10::optional<at::Tensor>& wq_scale, const c10::optional<at::Tensor>& bq, const at::Tensor& wk,
    const c10::optional<at::Tensor>& wk_scale, const c10::optional<at::Tensor>& bk, const at::Tensor& wv,
    const c10::optional<at::Tensor>& wv_scale, const c10::optional<at::Tensor>& bv, const at::Tensor& wo,
    const c10::optional<at::Tensor>& wo_scale, const c10::optional<at::Tensor>& bo,
    const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double qk_eps,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& position,
    const c10::optional<at::Tensor>& mask, double scaling, const at::Tensor& post_norm, double post_eps,
    c10::string_view kernels);

// The host-side buffers of moe_experts_infer (infer_cpu.cpp), kept across calls by the decode plan.
struct ExpertsWorkspace;
using ExpertsWorkspacePtr = std::shared_ptr<ExpertsWorkspace>;
ExpertsWorkspacePtr make_experts_workspace();

// The experts' weights checked against each other and hidden size `hid` (what moe_experts_infer checks each call):
// the views of w1 [E, W, H] and w2 [E, H, I].
std::pair<WeightView, WeightView> check_experts(const at::Tensor& w1, const c10::optional<at::Tensor>& w1_scale,
                   const c10::optional<at::Tensor>& b1, const at::Tensor& w2,
                   const c10::optional<at::Tensor>& w2_scale, const c10::optional<at::Tensor>& b2, int64_t hid,
                   bool glu);

// moe_experts_infer on checked weights (`check_experts`'s views) into `out` [N, H] (x's dtype): x [N, H]
// contiguous, the pairs' expert ids `id` and fp32 weights `wp` ([N, top_k] each, row-major), fp32 biases or
// undefined tensors; its host buffers are `ws`'s. Checks nothing.
void moe_experts_infer_into(const at::Tensor& x, const int64_t* id, const float* wp, int64_t top_k,
                            const WeightView& w1, const at::Tensor& bias1, const WeightView& w2,
                            const at::Tensor& bias2, c10::string_view activation, bool glu, c10::string_view kernels,
                            ExpertsWorkspace& ws, at::Tensor& out);

// linear_infer of a checked weight (`linear_weight`) for x [N, K] contiguous, N <= 16 (the decode kernels), into
// out [N, O] (x's dtype); `widened` holds bf16 activations widened to fp32 for an int8 weight.
void linear_into(const LinearWeight& w, const at::Tensor& x, c10::string_view kernels, std::vector<float>& widened,
                 at::Tensor& out);
constexpr int64_t kLinearIntoRows = 16;

// The fp32 outputs x . w_o (+ bias) of a checked weight (`linear_weight`) for n activation rows, into out [n, O] (fp32,
// row-major), on the dot kernels (each weight row read once for all n: made for a decode's few rows): x as fp32 rows
// `xf` [n, K] for fp32 and int8 weights, as bf16 bits `xb` [n, K] for bf16 weights (the other may be null). A weight
// of at most 16 rows (a router's experts) runs on the calling thread.
void linear_rows(const LinearWeight& w, const float* xf, const uint16_t* xb, int64_t n, c10::string_view kernels,
                 float* out);

at::Tensor moe_experts_infer_cpu(const at::Tensor& hidden_states, const at::Tensor& top_k_index,
                                 const at::Tensor& top_k_weights, const at::Tensor& w1,
                                 const c10::optional<at::Tensor>& w1_scale, const c10::optional<at::Tensor>& b1,
                                 const at::Tensor& w2, const c10::optional<at::Tensor>& w2_scale,
                                 const c10::optional<at::Tensor>& b2, c10::string_view activation, bool glu,
                                 c10::string_view kernels);

}  // namespace hf_moe
