// The decode step's own kernels, inference only (the ops are defined in hf_moe/ops/library.py; pure-torch
// references in hf_moe/ops/decode.py, which the tests compare them with):
//
//   hf_moe::linear_infer(x [N, K], weight [O, K], weight_scale?, bias?) -> [N, O]
//       a linear layer with fp32, bf16 or int8 weights (weight-only: fp32 scales per output row [O] or per group of
//       inputs [O, G]). A few rows (decoding): every weight row is read once, the rows split over all threads, on the
//       dot-product kernels of the experts op (infer_kernels.h); more rows: ATen's GEMM on the (dequantized) weight.
//
//   hf_moe::decode_attention_block(...) -> (hidden [B, H], normed [B, H])
//       one token's attention sub-block of a Llama-style decoder layer over a static KV cache, in one call and one
//       parallel region: RMSNorm of the layer input, the q/k/v projections (+ biases), per-head RMSNorm of q and k
//       (Qwen3), the rotary embedding, the write of k and v into the cache at `position`, attention over the cache
//       positions the mask allows (grouped-query heads, split over positions and merged as flash-decoding does),
//       the o projection, the residual add, and the RMSNorm of the MLP's input.
//
// Roundings: with bf16 activations every intermediate the eager model rounds to bf16 (the normalised input, each
// projection, each product and the sum of the rotary embedding, the cache entries, the attention output, the
// residual sum) is rounded here at the same point, so the decode follows the eager model's greedy tokens;
// everything else is computed in fp32, as ATen's kernels do. With fp32 activations nothing is rounded.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../hf_moe.h"
#include "decode_kernels.h"
#include "decode_ops.h"
#include "decode_values.h"
#include "infer_kernels.h"

namespace hf_moe {
namespace {

using infer::AttentionKernels;
using infer::Kernels;
using infer::kTile;

constexpr int64_t kMaxDecodeRows = 16;  // activation rows up to which linear_infer runs the dot kernels
constexpr int64_t kRowBlock = 16;       // weight rows per parallel task
constexpr int64_t kMinChunk = 16;       // cache positions per attention task, at least

}  // namespace

WeightView weight_view(const at::Tensor& w, const c10::optional<at::Tensor>& scale, const std::string& name) {
  const bool experts = w.dim() == 3;
  const char* lead = experts ? "E, " : "";
  TORCH_CHECK((w.dim() == 2 || experts) && w.is_contiguous(), name, " must be a contiguous [", lead,
              "out, in] tensor, got ", w.sizes());
  const auto t = w.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kChar, name,
              " must be fp32, bf16 or int8 (with scales), got ", t);
  WeightView v;
  v.data = static_cast<const char*>(w.data_ptr());
  v.dtype = t;
  v.count = experts ? w.size(0) : 1;
  v.out = w.size(-2);
  v.k = w.size(-1);
  v.group = v.k;
  v.weight = w;
  if (t != at::kChar) {
    TORCH_CHECK(!scale.has_value(), name, "'s scales are given but it is ", t, ", not int8");
    return v;
  }
  TORCH_CHECK(scale.has_value(), name, " is int8 and needs its fp32 scales ([", lead, "out] or [", lead,
              "out, groups])");
  const auto& s = *scale;
  const int64_t rows_dims = w.dim() - 1;  // the dims of [(E,) out]
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() &&
                  (s.dim() == rows_dims || s.dim() == rows_dims + 1) &&
                  s.sizes().slice(0, rows_dims) == w.sizes().slice(0, rows_dims),
              name, "'s scales must be a contiguous fp32 [", lead, v.out, "] or [", lead, v.out,
              ", groups] tensor, got ", s.scalar_type(), " ", s.sizes());
  if (s.dim() == rows_dims + 1) {
    const int64_t groups = s.size(-1);
    TORCH_CHECK(groups > 0 && v.k % groups == 0 && (v.k / groups) % 32 == 0, name, "'s scales have ", groups,
                " groups over ", v.k, " inputs; each group must span a multiple of 32 inputs");
    v.ld_scale = groups;
    v.group = v.k / groups;
  }
  v.scale = s.data_ptr<float>();
  v.scale_tensor = s;
  return v;
}

LinearWeight linear_weight(const at::Tensor& w, const c10::optional<at::Tensor>& scale,
                           const c10::optional<at::Tensor>& bias, const char* name) {
  TORCH_CHECK(w.dim() == 2, name, ": the weight must be a contiguous [out, in] tensor, got ", w.sizes());
  LinearWeight lw;
  static_cast<WeightView&>(lw) = weight_view(w, scale, std::string(name) + ": the weight");
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == lw.out, name, ": the bias must have ", lw.out, " values, got ", bias->sizes());
    lw.bias = bias->to(at::kFloat).contiguous();
  }
  return lw;
}

namespace {

// out[m * ldo + j] = x_m . w_(r0 + j) for j < cols <= kTile and the n activation rows: fp32 rows `xf` for fp32 and
// int8 weights, bf16 rows `xb` (bits) for bf16 weights, both with row stride w.k.
void linear_tile(const Kernels& kn, const LinearWeight& w, const float* xf, const uint16_t* xb, int64_t n, int64_t r0,
                 int cols, float* out, int64_t ldo) {
  const int64_t k = w.k;
  if (w.dtype == at::kFloat) {
    kn.dot_f32(xf, k, n, reinterpret_cast<const float*>(w.data) + r0 * k, k, cols, k, out, ldo);
  } else if (w.dtype == at::kBFloat16) {
    kn.dot_bf16(xb, k, n, reinterpret_cast<const uint16_t*>(w.data) + r0 * k, k, cols, k, out, ldo);
  } else {
    kn.dot_q8(xf, k, n, reinterpret_cast<const int8_t*>(w.data) + r0 * k, k, w.scale + r0 * w.ld_scale, w.ld_scale,
              w.group, cols, k, out, ldo);
  }
}

// Rows [r0, r0 + rows) of the layer for the n activation rows into out[m * ldo + r - r0] (fp32, bias added).
void linear_block(const Kernels& kn, const LinearWeight& w, const float* xf, const uint16_t* xb, int64_t n,
                  int64_t r0, int64_t rows, float* out, int64_t ldo) {
  for (int64_t j = 0; j < rows; j += kTile) {
    const int cols = static_cast<int>(std::min<int64_t>(kTile, rows - j));
    linear_tile(kn, w, xf, xb, n, r0 + j, cols, out + j, ldo);
  }
  if (w.bias.defined()) {
    const float* b = w.bias.data_ptr<float>() + r0;
    for (int64_t m = 0; m < n; ++m)
      for (int64_t j = 0; j < rows; ++j) out[m * ldo + j] += b[j];
  }
}

at::Tensor dequantized(const at::Tensor& q, const at::Tensor& scale, at::ScalarType dtype) {
  if (scale.dim() == 1) return (q.to(at::kFloat) * scale.unsqueeze(1)).to(dtype);
  const int64_t groups = scale.size(1);
  return (q.to(at::kFloat).view({q.size(0), groups, q.size(1) / groups}) * scale.unsqueeze(2))
      .view(q.sizes())
      .to(dtype);
}

int threads_for(int64_t tasks) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks)));
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// hf_moe::linear_infer
// ---------------------------------------------------------------------------------------------------------------
at::Tensor linear_infer_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scale,
                            const c10::optional<at::Tensor>& bias, c10::string_view kernels) {
  TORCH_CHECK(x.dim() == 2, "linear_infer: x must be [N, in], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "linear_infer: x must be fp32 or bf16, got ", x.scalar_type());
  const LinearWeight w = linear_weight(weight, scale, bias, "linear_infer");
  TORCH_CHECK(w.k == x.size(1), "linear_infer: x has ", x.size(1), " inputs, the weight ", w.k);
  TORCH_CHECK(w.dtype == at::kChar || w.dtype == x.scalar_type(), "linear_infer: x is ", x.scalar_type(),
              " but the weight is ", w.dtype, " (they must match, or the weight be int8)");
  const int64_t n = x.size(0);
  if (n > kMaxDecodeRows) {  // many rows: ATen's GEMM, after dequantizing an int8 weight (the reference's numbers)
    const at::ScalarType t = x.scalar_type();
    const at::Tensor wt = w.dtype == at::kChar ? dequantized(weight, *scale, t) : weight;
    const c10::optional<at::Tensor> bt = bias.has_value() ? c10::optional<at::Tensor>(bias->to(t)) : c10::nullopt;
    if (t == at::kBFloat16 && !infer::avx512_kernels(std::string(kernels))) {
      // Without bf16 instructions ATen's bf16 GEMM runs at a tenth of its fp32 one (docs/serving-cpu.md, "CPUs
      // without AVX-512"): the same bf16 values, exact in fp32, multiplied in fp32 and rounded to bf16 once, as a
      // bf16 GEMM accumulates in fp32 and rounds its result.
      const c10::optional<at::Tensor> b32 =
          bt.has_value() ? c10::optional<at::Tensor>(bt->to(at::kFloat)) : c10::nullopt;
      return at::linear(x.to(at::kFloat), wt.to(at::kFloat), b32).to(t);
    }
    return at::linear(x, wt, bt);
  }
  auto out = at::empty({n, w.out}, x.options());
  if (n == 0) return out;
  std::vector<float> widened;
  linear_into(w, x.contiguous(), kernels, widened, out);
  return out;
}

void linear_into(const LinearWeight& w, const at::Tensor& xc, c10::string_view kernels, std::vector<float>& widened,
                 at::Tensor& out) {
  const int64_t n = xc.size(0);
  if (n == 0) return;
  const Kernels& kn = infer::infer_kernels(std::string(kernels));
  const Values val{xc.scalar_type() == at::kBFloat16};
  // The activations as the kernels read them: fp32 (fp32 and int8 weights) or bf16 bits (bf16 weights).
  const float* xf = val.bf16 ? nullptr : xc.data_ptr<float>();
  if (val.bf16 && w.dtype == at::kChar) {
    widened.resize(n * w.k);
    for (int64_t i = 0; i < n * w.k; ++i) widened[i] = val.load(xc.data_ptr(), i);
    xf = widened.data();
  }
  const auto* xb = w.dtype == at::kBFloat16 ? static_cast<const uint16_t*>(xc.data_ptr()) : nullptr;
  const int64_t blocks = (w.out + kRowBlock - 1) / kRowBlock;
  void* o = out.data_ptr();
#pragma omp parallel num_threads(threads_for(blocks))
  {
    thread_local std::vector<float> tile;  // kept per thread: a decode step allocates nothing here
    if (static_cast<int64_t>(tile.size()) < n * kRowBlock) tile.resize(n * kRowBlock);
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t r0 = blk * kRowBlock, rows = std::min(kRowBlock, w.out - r0);
      linear_block(kn, w, xf, xb, n, r0, rows, tile.data(), kRowBlock);
      for (int64_t m = 0; m < n; ++m)
        for (int64_t j = 0; j < rows; ++j) val.store(o, m * w.out + r0 + j, tile[m * kRowBlock + j]);
    }
  }
}

void linear_rows(const LinearWeight& w, const float* xf, const uint16_t* xb, int64_t n, c10::string_view kernels,
                 float* out) {
  const Kernels& kn = infer::infer_kernels(std::string(kernels));
  const int64_t blocks = (w.out + kRowBlock - 1) / kRowBlock;
  if (blocks < 2) {  // a router's few experts: no parallel region to open
    linear_block(kn, w, xf, xb, n, 0, w.out, out, w.out);
    return;
  }
#pragma omp parallel for num_threads(threads_for(blocks)) schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t r0 = blk * kRowBlock;
    linear_block(kn, w, xf, xb, n, r0, std::min(kRowBlock, w.out - r0), out + r0, w.out);
  }
}

namespace {

// ---------------------------------------------------------------------------------------------------------------
// hf_moe::decode_attention_block
// ---------------------------------------------------------------------------------------------------------------
struct AttentionShape {
  int64_t batch, hidden, q_heads, kv_heads, head_dim, cache_len;
};

// One token's attention of the n_rep query heads sharing a kv head, over cache positions [j0, j1): the flash-
// decoding partial (running max m, sum l of exp(s - m), and sum of exp(s - m) v) of each query head.
void attend_chunk(const Kernels& kn, const AttentionKernels& ak, bool bf16, const void* q, const void* keys,
                  const void* values, const bool* valid, int64_t n_rep, int64_t d, int64_t j0, int64_t j1,
                  float scaling, float* scores, float* m_out, float* l_out, float* acc_out) {
  const int64_t len = j1 - j0;
  for (int64_t j = 0; j < len; j += kTile) {
    const int cols = static_cast<int>(std::min<int64_t>(kTile, len - j));
    if (bf16) {
      kn.dot_bf16(static_cast<const uint16_t*>(q), d, n_rep, static_cast<const uint16_t*>(keys) + (j0 + j) * d, d,
                  cols, d, scores + j, len);
    } else {
      kn.dot_f32(static_cast<const float*>(q), d, n_rep, static_cast<const float*>(keys) + (j0 + j) * d, d, cols,
                 d, scores + j, len);
    }
  }
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < n_rep; ++r) {
    float* s = scores + r * len;
    float m = kMinusInf;
    for (int64_t j = 0; j < len; ++j) {
      s[j] = valid[j0 + j] ? s[j] * scaling : kMinusInf;
      m = std::max(m, s[j]);
    }
    float* acc = acc_out + r * d;
    std::fill_n(acc, d, 0.0f);
    m_out[r] = m;
    l_out[r] = 0.0f;
    if (m == kMinusInf) continue;  // nothing to attend to in this chunk
    l_out[r] = ak.exp_sum(s, len, m);
    if (bf16) ak.accumulate_bf16(s, len, static_cast<const uint16_t*>(values) + j0 * d, d, d, acc);
    else ak.accumulate_f32(s, len, static_cast<const float*>(values) + j0 * d, d, d, acc);
  }
}

}  // namespace

AttentionWeights attention_weights(at::ScalarType dt, int64_t head_dim, const at::Tensor& input_norm, double eps,
                                   const at::Tensor& wq, const c10::optional<at::Tensor>& wq_scale,
                                   const c10::optional<at::Tensor>& bq, const at::Tensor& wk,
                                   const c10::optional<at::Tensor>& wk_scale, const c10::optional<at::Tensor>& bk,
                                   const at::Tensor& wv, const c10::optional<at::Tensor>& wv_scale,
                                   const c10::optional<at::Tensor>& bv, const at::Tensor& wo,
                                   const c10::optional<at::Tensor>& wo_scale, const c10::optional<at::Tensor>& bo,
                                   const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                                   double qk_eps, double scaling, const at::Tensor& post_norm, double post_eps) {
  const char* op = "decode_attention_block";
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, op, ": activations must be fp32 or bf16, got ", dt);
  AttentionWeights w;
  w.dtype = dt;
  w.q = linear_weight(wq, wq_scale, bq, "decode_attention_block (q)");
  w.k = linear_weight(wk, wk_scale, bk, "decode_attention_block (k)");
  w.v = linear_weight(wv, wv_scale, bv, "decode_attention_block (v)");
  w.o = linear_weight(wo, wo_scale, bo, "decode_attention_block (o)");
  const int64_t d = head_dim;
  TORCH_CHECK(d > 0 && d % 2 == 0 && w.q.out % d == 0 && w.k.out % d == 0, op, ": head_dim ", d,
              " must be even and divide the q and k projections' outputs (", w.q.out, ", ", w.k.out, ")");
  w.head_dim = d;
  w.hidden = w.q.k;
  w.q_heads = w.q.out / d;
  w.kv_heads = w.k.out / d;
  TORCH_CHECK(w.kv_heads > 0 && w.q_heads % w.kv_heads == 0 && w.v.out == w.kv_heads * d && w.k.k == w.hidden &&
                  w.v.k == w.hidden && w.o.k == w.q_heads * d && w.o.out == w.hidden,
              op, ": projection shapes do not fit hidden ", w.hidden, ", ", w.kv_heads, " kv heads of ", d, ": q ",
              wq.sizes(), ", k ", wk.sizes(), ", v ", wv.sizes(), ", o ", wo.sizes());
  for (const auto* lw : {&w.q, &w.k, &w.v, &w.o})
    TORCH_CHECK(lw->dtype == at::kChar || lw->dtype == dt, op, ": weights must be ", dt, " or int8, got ", lw->dtype);
  for (const auto* n : {&input_norm, &post_norm})
    TORCH_CHECK(n->numel() == w.hidden && n->is_contiguous() && n->scalar_type() == dt, op,
                ": norm weights must be contiguous [H] tensors of the activations' dtype");
  for (const auto* n : {&q_norm, &k_norm})
    TORCH_CHECK(!n->has_value() || !(*n)->defined() ||
                    ((*n)->numel() == d && (*n)->is_contiguous() && (*n)->scalar_type() == dt),
                op, ": q/k norm weights must be contiguous [head_dim] tensors of the activations' dtype");
  w.input_norm = input_norm;
  w.post_norm = post_norm;
  if (q_norm.has_value()) w.q_norm = *q_norm;
  if (k_norm.has_value()) w.k_norm = *k_norm;
  w.eps = eps;
  w.qk_eps = qk_eps;
  w.scaling = scaling;
  w.post_eps = post_eps;
  return w;
}

namespace {
template <typename T>
T* grown(std::vector<T>& v, int64_t n) {  // the buffer, grown to n values if smaller (never shrunk: reused)
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}
}  // namespace

void attention_block(const AttentionWeights& w, const at::Tensor& hidden, const at::Tensor& cos,
                     const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, int64_t pos,
                     const c10::optional<at::Tensor>& mask, c10::string_view kernels, AttentionWorkspace& ws,
                     at::Tensor& out_hidden, at::Tensor& out_normed) {
  const char* op = "decode_attention_block";
  const auto dt = w.dtype;
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && hidden.size(1) == w.hidden && hidden.scalar_type() == dt,
              op, ": hidden must be a contiguous [B, ", w.hidden, "] tensor of ", dt, ", got ", hidden.sizes(), " ",
              hidden.scalar_type());
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == dt && v_cache.scalar_type() == dt &&
                  k_cache.size(0) == hidden.size(0) && k_cache.size(1) == w.kv_heads && k_cache.size(3) == w.head_dim,
              op, ": the caches must be contiguous [B, ", w.kv_heads, ", L, ", w.head_dim,
              "] tensors of the activations' dtype for a batch of ", hidden.size(0), ", got ", k_cache.sizes(), " ",
              k_cache.scalar_type());
  AttentionShape sh{hidden.size(0), w.hidden, w.q_heads, w.kv_heads, w.head_dim, k_cache.size(2)};
  const int64_t d = sh.head_dim;
  TORCH_CHECK(cos.sizes() == at::IntArrayRef({sh.batch, d}) && sin.sizes() == cos.sizes() && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.scalar_type() == dt && sin.scalar_type() == dt,
              op, ": cos and sin must be contiguous [B, head_dim] tensors of the activations' dtype, got ",
              cos.sizes());
  TORCH_CHECK(pos >= 0 && pos < sh.cache_len, op, ": position ", pos, " is outside the cache of ", sh.cache_len,
              " positions (the static cache is full: generate with a larger max_cache_len)");
  const LinearWeight &lq = w.q, &lk = w.k, &lv = w.v, &lo = w.o;
  const at::Tensor &input_norm = w.input_norm, &post_norm = w.post_norm;
  const c10::optional<at::Tensor> q_norm = w.q_norm.defined() ? c10::optional<at::Tensor>(w.q_norm) : c10::nullopt;
  const c10::optional<at::Tensor> k_norm = w.k_norm.defined() ? c10::optional<at::Tensor>(w.k_norm) : c10::nullopt;
  const double eps = w.eps, qk_eps = w.qk_eps, scaling = w.scaling, post_eps = w.post_eps;
  const int64_t b_rows = sh.batch, len = sh.cache_len;
  // valid[b * len + j]: row b attends to cache position j (the mask; without one, the causal positions <= pos).
  auto* valid = reinterpret_cast<bool*>(grown(ws.valid, b_rows * len));
  int64_t* end = grown(ws.end, b_rows);  // one past the last position row b attends to
  std::fill_n(end, b_rows, pos + 1);
  if (mask.has_value()) {
    const auto& mk = *mask;
    TORCH_CHECK(mk.scalar_type() == at::kBool && mk.dim() == 2 && mk.size(0) == b_rows && mk.size(1) == len, op,
                ": the mask must be a bool [B, L] tensor, got ", mk.scalar_type(), " ", mk.sizes());
    const auto acc = mk.accessor<bool, 2>();
    for (int64_t b = 0; b < b_rows; ++b) {
      end[b] = 0;
      for (int64_t j = 0; j < len; ++j)
        if ((valid[b * len + j] = acc[b][j])) end[b] = j + 1;
    }
  } else {
    for (int64_t b = 0; b < b_rows; ++b) {
      std::fill_n(valid + b * len, pos + 1, true);
      std::fill_n(valid + b * len + pos + 1, len - pos - 1, false);
    }
  }

  const Kernels& kn = infer::infer_kernels(std::string(kernels));
  const AttentionKernels& ak = infer::attention_kernels(std::string(kernels));
  const Values val{dt == at::kBFloat16};
  const int64_t hq = sh.q_heads, hk = sh.kv_heads, n_rep = hq / hk, h = sh.hidden;
  TORCH_CHECK(out_hidden.sizes() == hidden.sizes() && out_normed.sizes() == hidden.sizes() &&
                  out_hidden.scalar_type() == dt && out_normed.scalar_type() == dt && out_hidden.is_contiguous() &&
                  out_normed.is_contiguous() && out_hidden.data_ptr() != hidden.data_ptr(),
              op, ": the outputs must be contiguous tensors like hidden, apart from it");

  // Buffers (the workspace's, grown on first use), fp32 values of the activations' dtype (and bf16 bits where a
  // bf16 kernel reads them).
  float* x = grown(ws.x, b_rows * h);
  float* qkv = grown(ws.qkv, b_rows * (hq + 2 * hk) * d);
  float* attn = grown(ws.attn, b_rows * hq * d);
  uint16_t* x_bits = grown(ws.x_bits, val.bf16 ? b_rows * h : 1);
  uint16_t* q_bits = grown(ws.q_bits, val.bf16 ? b_rows * hq * d : 1);
  uint16_t* attn_bits = grown(ws.attn_bits, val.bf16 ? b_rows * hq * d : 1);
  const int64_t qkv_ld = (hq + 2 * hk) * d, k_off = hq * d, v_off = (hq + hk) * d;
  // Parallel tasks: q, k, v row blocks; attention chunks of each (row, kv head); o row blocks.
  const int64_t q_blocks = (lq.out + kRowBlock - 1) / kRowBlock, k_blocks = (lk.out + kRowBlock - 1) / kRowBlock;
  const int64_t qkv_blocks = q_blocks + 2 * k_blocks, o_blocks = (h + kRowBlock - 1) / kRowBlock;
  const int threads = threads_for(std::max(qkv_blocks, o_blocks));
  const int64_t longest = *std::max_element(end, end + b_rows);
  const int64_t per_head = std::max<int64_t>(1, std::min<int64_t>((2 * threads + b_rows * hk - 1) / (b_rows * hk),
                                                                  (longest + kMinChunk - 1) / kMinChunk));
  const int64_t chunk = std::max<int64_t>(1, (longest + per_head - 1) / per_head);
  const int64_t attn_tasks = b_rows * hk * per_head;
  float* part_m = grown(ws.part_m, attn_tasks * n_rep);
  float* part_l = grown(ws.part_l, attn_tasks * n_rep);
  float* part_acc = grown(ws.part_acc, attn_tasks * n_rep * d);
  // Per thread: a tile of outputs or scores, one row, and (fp32) the query heads of one kv head.
  const int64_t scratch_n = std::max<int64_t>(b_rows * kRowBlock, n_rep * chunk), row_n = std::max(h, d);
  float* scratch_all = grown(ws.scratch, threads * scratch_n);
  float* row_all = grown(ws.row, threads * row_n);
  float* q_all = grown(ws.q_f32, threads * n_rep * d);
  const void* hid = hidden.data_ptr();
  const void* cos_p = cos.data_ptr();
  const void* sin_p = sin.data_ptr();
  void* kc = k_cache.data_ptr();
  void* vc = v_cache.data_ptr();
  void* out_h = out_hidden.data_ptr();
  void* out_n = out_normed.data_ptr();
  const size_t elt = val.bf16 ? 2 : 4;

#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num();
    float* scratch = scratch_all + tid * scratch_n;
    float* row = row_all + tid * row_n;
    float* q_f32 = q_all + tid * n_rep * d;

    // 1. The normalised layer input (a few rows: each thread its share).
#pragma omp for schedule(static)
    for (int64_t b = 0; b < b_rows; ++b) {
      for (int64_t i = 0; i < h; ++i) row[i] = val.load(hid, b * h + i);
      rms_norm(val, row, h, input_norm.data_ptr(), static_cast<float>(eps), x + b * h);
      if (val.bf16)
        for (int64_t i = 0; i < h; ++i) x_bits[b * h + i] = bf16_bits(x[b * h + i]);
    }
    // 2. q, k, v: blocks of output rows of the three projections.
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < qkv_blocks; ++blk) {
      const bool is_q = blk < q_blocks, is_k = !is_q && blk < q_blocks + k_blocks;
      const LinearWeight& w = is_q ? lq : (is_k ? lk : lv);
      const int64_t r0 = (is_q ? blk : blk - q_blocks - (is_k ? 0 : k_blocks)) * kRowBlock;
      const int64_t rows = std::min(kRowBlock, w.out - r0), off = (is_q ? 0 : (is_k ? k_off : v_off)) + r0;
      linear_block(kn, w, x, x_bits, b_rows, r0, rows, scratch, kRowBlock);
      for (int64_t b = 0; b < b_rows; ++b)
        for (int64_t j = 0; j < rows; ++j) qkv[b * qkv_ld + off + j] = val.round(scratch[b * kRowBlock + j]);
    }
    // 3. Per head: the q/k norm, the rotary embedding (q, k), and the cache write (k, v).
#pragma omp for schedule(static)
    for (int64_t task = 0; task < b_rows * (hq + 2 * hk); ++task) {
      const int64_t b = task / (hq + 2 * hk), head = task % (hq + 2 * hk);
      float* v = qkv + b * qkv_ld + head * d;  // this head's d values (q heads, then k, then v)
      const bool is_v = head >= hq + hk, is_k = !is_v && head >= hq;
      if (!is_v) {
        const auto& norm = is_k ? k_norm : q_norm;
        if (norm.has_value()) {
          std::copy_n(v, d, row);
          rms_norm(val, row, d, norm->data_ptr(), static_cast<float>(qk_eps), v);
        }
        // rotate_half: (-x2, x1); x * cos + rotate_half(x) * sin, each product and the sum rounded
        std::copy_n(v, d, row);
        const int64_t half = d / 2;
        for (int64_t i = 0; i < d; ++i) {
          const float rot = i < half ? -row[i + half] : row[i - half];
          const float c = val.load(cos_p, b * d + i), s = val.load(sin_p, b * d + i);
          v[i] = val.round(val.round(row[i] * c) + val.round(rot * s));
        }
      }
      if (is_k || is_v) {
        const int64_t g = head - (is_k ? hq : hq + hk);
        void* cache = is_k ? kc : vc;
        for (int64_t i = 0; i < d; ++i) val.store(cache, ((b * hk + g) * len + pos) * d + i, v[i]);
      } else if (val.bf16) {
        for (int64_t i = 0; i < d; ++i) q_bits[(b * hq + head) * d + i] = bf16_bits(v[i]);
      }
    }
    // 4. Attention: chunks of cache positions of each (row, kv head), its n_rep query heads together.
#pragma omp for schedule(static)
    for (int64_t task = 0; task < attn_tasks; ++task) {
      const int64_t b = task / (hk * per_head), g = (task / per_head) % hk, c = task % per_head;
      const int64_t j0 = std::min(c * chunk, end[b]), j1 = std::min(j0 + chunk, end[b]);
      const int64_t first_q = b * hq + g * n_rep;
      const void* q;
      if (val.bf16) {
        q = q_bits + first_q * d;
      } else {
        for (int64_t r = 0; r < n_rep; ++r)
          std::copy_n(qkv + b * qkv_ld + (g * n_rep + r) * d, d, q_f32 + r * d);
        q = q_f32;
      }
      const size_t head_off = static_cast<size_t>((b * hk + g) * len * d) * elt;
      attend_chunk(kn, ak, val.bf16, q, static_cast<char*>(kc) + head_off, static_cast<char*>(vc) + head_off,
                   valid + b * len, n_rep, d, j0, j1, static_cast<float>(scaling), scratch,
                   part_m + task * n_rep, part_l + task * n_rep, part_acc + task * n_rep * d);
    }
    // 5. Merge the chunks of every query head.
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < b_rows * hq; ++bh) {
      const int64_t b = bh / hq, head = bh % hq, g = head / n_rep, r = head % n_rep;
      const int64_t first = (b * hk + g) * per_head;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < per_head; ++c) m = std::max(m, part_m[(first + c) * n_rep + r]);
      float* o = row;
      std::fill_n(o, d, 0.0f);
      float l = 0.0f;
      if (m != -std::numeric_limits<float>::infinity()) {
        for (int64_t c = 0; c < per_head; ++c) {
          const int64_t at = (first + c) * n_rep + r;
          if (part_l[at] == 0.0f) continue;
          const float f = std::exp(part_m[at] - m);
          l += f * part_l[at];
          const float* pa = part_acc + at * d;
          for (int64_t i = 0; i < d; ++i) o[i] += f * pa[i];
        }
      }
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      for (int64_t i = 0; i < d; ++i) {
        const float v = val.round(o[i] * inv);
        attn[bh * d + i] = v;
        if (val.bf16) attn_bits[bh * d + i] = bf16_bits(v);
      }
    }
    // 6. o projection and the residual add.
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < o_blocks; ++blk) {
      const int64_t r0 = blk * kRowBlock, rows = std::min(kRowBlock, h - r0);
      linear_block(kn, lo, attn, attn_bits, b_rows, r0, rows, scratch, kRowBlock);
      for (int64_t b = 0; b < b_rows; ++b)
        for (int64_t j = 0; j < rows; ++j) {
          const int64_t i = b * h + r0 + j;
          val.store(out_h, i, val.load(hid, i) + val.round(scratch[b * kRowBlock + j]));
        }
    }
    // 7. The MLP's input: RMSNorm of the new hidden state.
#pragma omp for schedule(static)
    for (int64_t b = 0; b < b_rows; ++b)
      rms_norm_row(val, out_h, b, h, post_norm.data_ptr(), static_cast<float>(post_eps), row, out_n);
  }
}

std::tuple<at::Tensor, at::Tensor> decode_attention_block_cpu(
    const at::Tensor& hidden, const at::Tensor& input_norm, double eps, const at::Tensor& wq,
    const c10::optional<at::Tensor>& wq_scale, const c10::optional<at::Tensor>& bq, const at::Tensor& wk,
    const c10::optional<at::Tensor>& wk_scale, const c10::optional<at::Tensor>& bk, const at::Tensor& wv,
    const c10::optional<at::Tensor>& wv_scale, const c10::optional<at::Tensor>& bv, const at::Tensor& wo,
    const c10::optional<at::Tensor>& wo_scale, const c10::optional<at::Tensor>& bo,
    const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double qk_eps,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& position,
    const c10::optional<at::Tensor>& mask, double scaling, const at::Tensor& post_norm, double post_eps,
    c10::string_view kernels) {
  // The op alone (the compiled step calls it per layer): its weights checked and its workspace made on each call.
  TORCH_CHECK(hidden.dim() == 2 && k_cache.dim() == 4, "decode_attention_block: hidden must be [B, H] and the caches "
              "[B, kv_heads, L, head_dim], got ", hidden.sizes(), " and ", k_cache.sizes());
  const AttentionWeights w = attention_weights(hidden.scalar_type(), k_cache.size(3), input_norm, eps, wq, wq_scale,
                                               bq, wk, wk_scale, bk, wv, wv_scale, bv, wo, wo_scale, bo, q_norm,
                                               k_norm, qk_eps, scaling, post_norm, post_eps);
  TORCH_CHECK(position.numel() == 1 && position.scalar_type() == at::kLong,
              "decode_attention_block: position must be one int64 value");
  AttentionWorkspace ws;
  auto out_hidden = at::empty_like(hidden), out_normed = at::empty_like(hidden);
  attention_block(w, hidden, cos, sin, k_cache, v_cache, position.data_ptr<int64_t>()[0], mask, kernels, ws,
                  out_hidden, out_normed);
  return {out_hidden, out_normed};
}


TORCH_LIBRARY_IMPL(hf_moe, CPU, m) {
  m.impl("linear_infer", &linear_infer_cpu);
  m.impl("decode_attention_block", &decode_attention_block_cpu);
}

}  // namespace hf_moe
