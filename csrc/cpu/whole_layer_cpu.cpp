// The whole-layer op on CPU (hf_moe::moe_experts_forward / moe_experts_backward, the compiled backend's
// `whole_forward` / `whole_backward`): the expert computation of one MoE layer, forward and backward, one call each.
//
// Same maths as hf_moe/ops/experts.py (ExpertsFunction), but expert by expert: each expert's rows are gathered,
// multiplied, activated and multiplied again while they sit in cache, instead of one pass over memory per op.
// Experts run in parallel, one thread each with single-threaded GEMMs, when there are enough of them of similar
// size; otherwise one after the other with multi-threaded GEMMs (few experts, or skewed routing).
//
// Forward:   h_e = x[rows_e] W1_e^T + b1_e;  a_e = act(h_e) * w;  y_e = a_e W2_e^T + w b2_e;  out = sum over k of y
// Saved:     x, h [M, W], the sort, the routing weight of each row. No [M, H] tensor is kept.

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "../hf_moe.h"
#include "activation_cpu.h"

namespace hf_moe {
namespace {

// Runs body(e) for every expert with rows: in parallel across experts (single-threaded GEMMs) when there are
// several small experts per thread and none dominates, or, for decode-sized batches (a few rows per expert, where
// each GEMM is a matrix-vector product bound by reading the expert's weights), at least one expert per thread;
// else in order, each GEMM using all threads. The thresholds below come from benchmarks/moe_layer.py (small experts
// go faster in parallel, large ones in order; a 1-token top-2 decode is faster with the two experts' weights
// streamed by one thread each than with each GEMV split over all threads in turn): docs/benchmarks.md.
template <typename F>
void for_each_expert(const std::vector<int64_t>& offsets, const F& body) {
  constexpr int64_t kMaxMeanRowsForParallel = 768;
  constexpr int64_t kMaxDecodeRows = 4;
  std::vector<int64_t> experts;
  int64_t largest = 0, total = offsets.back();
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(offsets.size()); ++e) {
    const int64_t n = offsets[e + 1] - offsets[e];
    if (n > 0) experts.push_back(e);
    largest = std::max(largest, n);
  }
  const int64_t threads = at::get_num_threads();
  const int64_t used = static_cast<int64_t>(experts.size());
  const bool decode = largest <= kMaxDecodeRows && used >= threads;
  const bool parallel = threads > 1 && (used >= 2 * threads || decode) && largest * threads <= 2 * total &&
                        total <= kMaxMeanRowsForParallel * used;
  if (!parallel) {
    for (int64_t e : experts) body(e);
    return;
  }
  // Largest first, handed out dynamically: the last experts to finish are the short ones.
  std::sort(experts.begin(), experts.end(), [&](int64_t a, int64_t b) {
    return offsets[a + 1] - offsets[a] > offsets[b + 1] - offsets[b];
  });
  const int64_t count = static_cast<int64_t>(experts.size());
  const at::ThreadLocalState state;  // the caller's grad mode, dispatch keys, ... for the worker threads
  std::exception_ptr error;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t i = 0; i < count; ++i) {
    try {
      at::ThreadLocalStateGuard guard(state);
      body(experts[i]);
    } catch (...) {
#pragma omp critical
      error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

at::Tensor gather_rows(const at::Tensor& src, const at::Tensor& sorted_slots, int64_t begin, int64_t n,
                       int64_t top_k) {
  auto tokens = sorted_slots.narrow(0, begin, n).div(top_k, "floor");
  return src.index_select(0, tokens);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_experts_forward_cpu(
    const at::Tensor& hidden_states, const at::Tensor& top_k_index, const at::Tensor& top_k_weights,
    const at::Tensor& w1, const c10::optional<at::Tensor>& b1, const at::Tensor& w2,
    const c10::optional<at::Tensor>& b2, c10::string_view activation, bool glu, bool save_h) {
  const Activation act = parse_activation(std::string(activation));
  auto x = hidden_states.contiguous();
  const int64_t top_k = top_k_index.size(-1), num_experts = w1.size(0);
  const int64_t m = top_k_index.numel(), width = w1.size(1), inter = glu ? width / 2 : width, hid = x.size(1);
  static auto sort_op = c10::Dispatcher::singleton()
                            .findSchemaOrThrow("hf_moe::sort_by_expert", "")
                            .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, int64_t)>();
  auto [sorted_slots, slot_to_row, counts] = sort_op.call(top_k_index, num_experts);
  auto row_weight = top_k_weights.reshape(-1).index_select(0, sorted_slots).to(x.scalar_type());
  const auto offsets = group_offsets_host(counts);
  auto h = at::empty({save_h ? m : 0, width}, x.options());
  auto y = at::empty({m, hid}, x.options());
  y.narrow(0, offsets.back(), m - offsets.back()).zero_();  // rows of dropped pairs contribute nothing
  if (save_h) h.narrow(0, offsets.back(), m - offsets.back()).zero_();

  for_each_expert(offsets, [&](int64_t e) {
    const int64_t begin = offsets[e], n = offsets[e + 1] - begin;
    auto xe = gather_rows(x, sorted_slots, begin, n, top_k);
    auto he = save_h ? h.narrow(0, begin, n) : at::empty({n, width}, x.options());
    if (b1.has_value()) at::addmm_out(he, (*b1)[e], xe, w1[e].t());
    else at::mm_out(he, xe, w1[e].t());
    auto ae = at::empty({n, inter}, x.options());
    activation_out(ae, he.narrow(1, 0, inter), act);
    if (glu) ae.mul_(he.narrow(1, inter, inter));
    auto we = row_weight.narrow(0, begin, n);
    ae.mul_(we.unsqueeze(1));
    auto ye = y.narrow(0, begin, n);
    at::mm_out(ye, ae, w2[e].t());
    if (b2.has_value()) ye.addr_(we, (*b2)[e]);
  });

  static auto unpermute_op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("hf_moe::unpermute", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, int64_t)>();
  auto out = unpermute_op.call(y, slot_to_row, c10::nullopt, top_k);
  return {out, h, sorted_slots, slot_to_row, counts, row_weight};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_experts_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& hidden_states, const at::Tensor& h, const at::Tensor& sorted_slots,
    const at::Tensor& slot_to_row, const at::Tensor& tokens_per_expert, const at::Tensor& row_weight,
    const at::Tensor& w1, const c10::optional<at::Tensor>& b1, const at::Tensor& w2,
    const c10::optional<at::Tensor>& b2, c10::string_view activation, bool glu, bool need_x, bool need_weights,
    bool need_params) {
  const Activation act = parse_activation(std::string(activation));
  auto x = hidden_states.contiguous();
  auto g_out = grad_out.contiguous();
  const int64_t m = sorted_slots.numel(), width = w1.size(1), inter = glu ? width / 2 : width, hid = x.size(1);
  const int64_t top_k = x.size(0) > 0 ? m / x.size(0) : 1;  // no rows (a rank with idle experts): any k works
  const auto offsets = group_offsets_host(tokens_per_expert);
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto empty = at::empty({0}, x.options());
  // Written expert by expert below; only what no expert writes is zeroed here (dropped rows, idle experts).
  auto grad_rows = need_x ? at::empty({m, hid}, x.options()) : empty;
  auto grad_rw = need_weights ? at::empty({m}, x.options().dtype(acc)) : empty;
  auto grad_w1 = need_params ? at::empty_like(w1) : empty;
  auto grad_w2 = need_params ? at::empty_like(w2) : empty;
  auto grad_b1 = need_params && b1.has_value() ? at::empty_like(*b1) : empty;
  auto grad_b2 = need_params && b2.has_value() ? at::empty_like(*b2) : empty;
  if (need_x) grad_rows.narrow(0, offsets.back(), m - offsets.back()).zero_();
  if (need_weights) grad_rw.narrow(0, offsets.back(), m - offsets.back()).zero_();
  for (int64_t e = 0; need_params && e < w1.size(0); ++e) {
    if (offsets[e + 1] > offsets[e]) continue;
    grad_w1[e].zero_();
    grad_w2[e].zero_();
    if (grad_b1.numel()) grad_b1[e].zero_();
    if (grad_b2.numel()) grad_b2[e].zero_();
  }

  for_each_expert(offsets, [&](int64_t e) {
    const int64_t begin = offsets[e], n = offsets[e + 1] - begin;
    auto ge = gather_rows(g_out, sorted_slots, begin, n, top_k);  // [n, H]: gradient of each row of y
    auto he = h.narrow(0, begin, n);
    auto gate = he.narrow(1, 0, inter);
    auto we = row_weight.narrow(0, begin, n);
    auto act_gate = at::empty({n, inter}, x.options());
    activation_out(act_gate, gate, act);
    auto value = glu ? act_gate * he.narrow(1, inter, inter) : act_gate;  // unscaled expert activation
    if (need_params) {
      auto gw2 = grad_w2[e];
      at::mm_out(gw2, ge.t(), value * we.unsqueeze(1));
      if (b2.has_value()) {
        auto gb2 = grad_b2[e];
        at::mv_out(gb2, ge.t(), we);
      }
    }
    auto grad_a = at::mm(ge, w2[e]);  // [n, I]
    if (need_weights) {
      auto gr = grad_rw.narrow(0, begin, n);
      at::sum_out(gr, at::mul(grad_a.to(acc), value.to(acc)), {1});
      if (b2.has_value()) gr.add_(at::mv(ge, (*b2)[e]).to(acc));
    }
    grad_a.mul_(we.unsqueeze(1));
    auto grad_h = at::empty({n, width}, x.options());
    auto grad_gate = grad_h.narrow(1, 0, inter);
    if (glu) {
      auto grad_up = grad_h.narrow(1, inter, inter);
      at::mul_out(grad_up, grad_a, act_gate);
      activation_backward_out(grad_gate, grad_a.mul_(he.narrow(1, inter, inter)), gate, act);
    } else {
      activation_backward_out(grad_gate, grad_a, gate, act);
    }
    if (need_params) {
      auto xe = gather_rows(x, sorted_slots, begin, n, top_k);
      auto gw1 = grad_w1[e];
      at::mm_out(gw1, grad_h.t(), xe);
      if (b1.has_value()) {
        auto gb1 = grad_b1[e];
        at::sum_out(gb1, grad_h, {0});
      }
    }
    if (need_x) {
      auto gr = grad_rows.narrow(0, begin, n);
      at::mm_out(gr, grad_h, w1[e]);
    }
  });

  at::Tensor grad_x = empty, grad_weights = empty;
  if (need_x) {
    static auto unpermute_op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("hf_moe::unpermute", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, int64_t)>();
    grad_x = unpermute_op.call(grad_rows, slot_to_row, c10::nullopt, top_k);
  }
  if (need_weights) grad_weights = grad_rw.index_select(0, slot_to_row).view({-1, top_k}).to(row_weight.scalar_type());
  return {grad_x, grad_weights, grad_w1, grad_b1, grad_w2, grad_b2};
}

}  // namespace

TORCH_LIBRARY_IMPL(hf_moe, CPU, m) {
  m.impl("moe_experts_forward", &moe_experts_forward_cpu);
  m.impl("moe_experts_backward", &moe_experts_backward_cpu);
}

}  // namespace hf_moe
