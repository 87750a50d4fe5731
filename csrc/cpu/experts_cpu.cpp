// Expert computation on CPU: grouped matrix products over contiguous row groups (one call for all experts) and
// the expert activation (expert_act: GLU or plain, scaled by the routing weight of each row) with its backward.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../hf_moe.h"
#include "activation_cpu.h"

namespace hf_moe {
namespace {

void check_groups(const at::Tensor& x, const at::Tensor& tokens_per_expert, int64_t num_experts, const char* op) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D [M, K], got ", x.sizes());
  TORCH_CHECK(tokens_per_expert.dim() == 1 && tokens_per_expert.numel() == num_experts, op,
              ": tokens_per_expert must be [E] with E = ", num_experts, ", got ", tokens_per_expert.sizes());
}

// y[g] = x[g] @ weight[e]^T (transpose_weight) or x[g] @ weight[e], for each expert e and its row group g.
// bias [E, out] is added to each row, times bias_scale[row] when given. Rows past the last group are zero.
at::Tensor grouped_mm_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& tokens_per_expert,
                          const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& bias_scale,
                          bool transpose_weight) {
  check_groups(x, tokens_per_expert, weight.size(0), "grouped_mm");
  TORCH_CHECK(weight.dim() == 3, "grouped_mm: weight must be [E, A, B], got ", weight.sizes());
  const int64_t k_in = transpose_weight ? weight.size(2) : weight.size(1);
  const int64_t cols = transpose_weight ? weight.size(1) : weight.size(2);
  TORCH_CHECK(x.size(1) == k_in, "grouped_mm: x has ", x.size(1), " columns, weight expects ", k_in);
  const auto offsets = group_offsets_host(tokens_per_expert);
  TORCH_CHECK(offsets.back() <= x.size(0), "grouped_mm: groups cover ", offsets.back(), " rows, x has ", x.size(0));
  auto out = at::empty({x.size(0), cols}, x.options());
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(offsets.size()); ++e) {
    const int64_t n = offsets[e + 1] - offsets[e];
    if (n == 0) continue;
    auto out_e = out.narrow(0, offsets[e], n);
    auto x_e = x.narrow(0, offsets[e], n);
    auto w_e = transpose_weight ? weight[e].t() : weight[e];
    if (bias.has_value() && !bias_scale.has_value()) {
      at::addmm_out(out_e, (*bias)[e], x_e, w_e);
    } else {
      at::mm_out(out_e, x_e, w_e);
      if (bias.has_value()) out_e.addr_(bias_scale->narrow(0, offsets[e], n).to(out.scalar_type()), (*bias)[e]);
    }
  }
  out.narrow(0, offsets.back(), x.size(0) - offsets.back()).zero_();
  return out;
}

// grad_weight[e] = grad_out[g]^T @ x[g]: [E, A, B] for grad_out [M, A], x [M, B]. Experts without rows get zero.
at::Tensor grouped_mm_weight_grad_cpu(const at::Tensor& grad_out, const at::Tensor& x,
                                      const at::Tensor& tokens_per_expert) {
  const int64_t num_experts = tokens_per_expert.numel();
  check_groups(x, tokens_per_expert, num_experts, "grouped_mm_weight_grad");
  const auto offsets = group_offsets_host(tokens_per_expert);
  auto out = at::empty({num_experts, grad_out.size(1), x.size(1)}, x.options());
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t n = offsets[e + 1] - offsets[e];
    if (n == 0) {
      out[e].zero_();
    } else {
      auto out_e = out[e];
      at::mm_out(out_e, grad_out.narrow(0, offsets[e], n).t(), x.narrow(0, offsets[e], n));
    }
  }
  return out;
}

int64_t row_grain(int64_t rows, int64_t width) {
  // Enough rows per task to amortise ATen's per-call overhead, enough tasks to keep every thread busy.
  const int64_t by_threads = rows / (4 * at::get_num_threads()) + 1;
  return std::max<int64_t>(by_threads, std::max<int64_t>(8, 4096 / std::max<int64_t>(width, 1)));
}

// out[r] = act(gate[r]) * up[r] * row_scale[r] (GLU: h = [gate | up]) or act(h[r]) * row_scale[r].
at::Tensor expert_act_cpu(const at::Tensor& h, const c10::optional<at::Tensor>& row_scale,
                          c10::string_view activation, bool glu) {
  TORCH_CHECK(h.dim() == 2, "expert_act: h must be [M, W]");
  const Activation act = parse_activation(std::string(activation));
  const int64_t m = h.size(0), width = glu ? h.size(1) / 2 : h.size(1);
  auto out = at::empty({m, width}, h.options());
  at::Tensor scale = row_scale.has_value() ? row_scale->to(h.scalar_type()) : at::Tensor();
  at::parallel_for(0, m, row_grain(m, width), [&](int64_t r0, int64_t r1) {
    auto h_c = h.narrow(0, r0, r1 - r0);
    auto out_c = out.narrow(0, r0, r1 - r0);
    activation_out(out_c, h_c.narrow(1, 0, width), act);
    if (glu) out_c.mul_(h_c.narrow(1, width, width));
    if (scale.defined()) out_c.mul_(scale.narrow(0, r0, r1 - r0).unsqueeze(1));
  });
  return out;
}

// Backward of expert_act: (grad_h [M, W], grad_row_scale [M] or [0] without row_scale, and the forward output
// [M, I] when return_output (it is computed on the way; the caller needs it for the next weight gradient)).
std::tuple<at::Tensor, at::Tensor, at::Tensor> expert_act_backward_cpu(const at::Tensor& grad, const at::Tensor& h,
                                                                       const c10::optional<at::Tensor>& row_scale,
                                                                       c10::string_view activation, bool glu,
                                                                       bool return_output) {
  const Activation act = parse_activation(std::string(activation));
  const int64_t m = h.size(0), width = glu ? h.size(1) / 2 : h.size(1);
  auto grad_h = at::empty_like(h);
  at::Tensor scale = row_scale.has_value() ? row_scale->to(h.scalar_type()) : at::Tensor();
  const auto acc = h.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;  // reduce in fp32 at least
  auto grad_scale = at::empty({scale.defined() ? m : 0}, h.options().dtype(acc));
  auto output = at::empty({return_output ? m : 0, width}, h.options());
  auto g_all = grad.contiguous();
  at::parallel_for(0, m, row_grain(m, width), [&](int64_t r0, int64_t r1) {
    const int64_t n = r1 - r0;
    auto h_c = h.narrow(0, r0, n);
    auto gate = h_c.narrow(1, 0, width);
    auto g = g_all.narrow(0, r0, n);
    auto grad_gate = grad_h.narrow(0, r0, n).narrow(1, 0, width);
    at::Tensor value;  // act(gate): for grad_row_scale, the GLU's up branch and the returned output
    if (glu || scale.defined() || return_output) {
      value = at::empty_like(gate);
      activation_out(value, gate, act);
    }
    if (scale.defined() || return_output) {
      auto out_value = glu ? value * h_c.narrow(1, width, width) : value;  // the unscaled output
      if (scale.defined()) {
        auto gs = grad_scale.narrow(0, r0, n);
        at::sum_out(gs, at::mul(g.to(acc), out_value.to(acc)), {1});  // not in place: g may alias the input
      }
      if (return_output) {
        auto o = output.narrow(0, r0, n);
        if (scale.defined()) at::mul_out(o, out_value, scale.narrow(0, r0, n).unsqueeze(1));
        else o.copy_(out_value);
      }
    }
    if (scale.defined()) g = g * scale.narrow(0, r0, n).unsqueeze(1);
    if (glu) {
      auto grad_up = grad_h.narrow(0, r0, n).narrow(1, width, width);
      at::mul_out(grad_up, g, value);
      activation_backward_out(grad_gate, g * h_c.narrow(1, width, width), gate, act);
    } else {
      activation_backward_out(grad_gate, g, gate, act);
    }
  });
  grad_scale = grad_scale.to(scale.defined() ? row_scale->scalar_type() : h.scalar_type());
  return {grad_h, grad_scale, output};
}

}  // namespace

TORCH_LIBRARY_IMPL(hf_moe, CPU, m) {
  m.impl("grouped_mm", &grouped_mm_cpu);
  m.impl("grouped_mm_weight_grad", &grouped_mm_weight_grad_cpu);
  m.impl("expert_act", &expert_act_cpu);
  m.impl("expert_act_backward", &expert_act_backward_cpu);
}

}  // namespace hf_moe
