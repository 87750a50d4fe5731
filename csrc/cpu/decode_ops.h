// The CPU kernels of the inference ops that the whole decode step (decode_step_cpu.cpp) calls directly, without the
// dispatcher: defined in decode_cpu.cpp (linear_infer, decode_attention_block) and serve_cpu.cpp
// (moe_experts_infer); their schemas and contracts are there and in hf_moe/ops/library.py, hf_moe/ops/decode.py.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>

#include <tuple>

namespace hf_moe {

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

at::Tensor moe_experts_infer_cpu(const at::Tensor& hidden_states, const at::Tensor& top_k_index,
                                 const at::Tensor& top_k_weights, const at::Tensor& w1,
                                 const c10::optional<at::Tensor>& w1_scale, const c10::optional<at::Tensor>& b1,
                                 const at::Tensor& w2, const c10::optional<at::Tensor>& w2_scale,
                                 const c10::optional<at::Tensor>& b2, c10::string_view activation, bool glu,
                                 c10::string_view kernels);

}  // namespace hf_moe
