// Expert computation on CUDA: grouped GEMMs and the fused expert activation.
//
// Grouped GEMMs use torch's `_grouped_mm` (CUTLASS; bf16 on sm80+) with device-side offsets, so nothing is read
// on the host. Other dtypes fall back to one GEMM per expert, which reads the group sizes on the host once per
// call. The activation kernels fuse GLU gating and the per-row routing weight; the backward also reduces the
// gradient of that weight per row.

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../hf_moe.h"

namespace hf_moe {
namespace {

// The grouped GEMM kernels need bf16 and sm80+. (Device attributes via the runtime API: ATen's CUDAContext.h
// would pull in cuBLAS/cuSPARSE headers, which a bare CUDA toolkit may not have.)
bool use_grouped_mm(const at::Tensor& a, const at::Tensor& b) {
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, a.get_device()));
  return a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16 && major >= 8;
}

// For each row: its expert (rows past the last group get E - 1) and whether it is inside a group.
std::pair<at::Tensor, at::Tensor> expert_of_row(const at::Tensor& tokens_per_expert, int64_t rows) {
  auto ends = at::cumsum(tokens_per_expert, 0);
  auto index = at::arange(rows, tokens_per_expert.options());
  auto expert = at::searchsorted(ends, index, /*out_int32=*/false, /*right=*/true);
  auto inside = expert.lt(tokens_per_expert.size(0));
  return {expert.clamp_max_(tokens_per_expert.size(0) - 1), inside};
}

at::Tensor grouped_mm_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& tokens_per_expert,
                           const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& bias_scale,
                           bool transpose_weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 3, "grouped_mm: x must be [M, K] and weight [E, A, B]");
  const c10::cuda::CUDAGuard guard(x.device());
  auto w = transpose_weight ? weight.transpose(-2, -1) : weight;  // [E, K, out]
  const int64_t m = x.size(0);
  at::Tensor out;
  if (use_grouped_mm(x, weight)) {
    auto offsets = at::cumsum(tokens_per_expert, 0, at::kInt);
    out = at::_grouped_mm(x, w, offsets);
    auto [expert, inside] = expert_of_row(tokens_per_expert, m);
    out.masked_fill_(inside.logical_not().unsqueeze(1), 0);  // _grouped_mm leaves rows past the groups undefined
    if (bias.has_value()) {
      auto b = bias->index_select(0, expert);
      auto keep = inside.to(b.scalar_type()).unsqueeze(1);
      if (bias_scale.has_value()) keep = keep * bias_scale->to(b.scalar_type()).unsqueeze(1);
      out.add_(b * keep);
    }
    return out;
  }
  const auto offsets = group_offsets_host(tokens_per_expert);  // one device-to-host copy
  out = at::zeros({m, w.size(2)}, x.options());
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(offsets.size()); ++e) {
    const int64_t n = offsets[e + 1] - offsets[e];
    if (n == 0) continue;
    auto out_e = out.narrow(0, offsets[e], n);
    at::mm_out(out_e, x.narrow(0, offsets[e], n), w[e]);
    if (bias.has_value()) {
      if (bias_scale.has_value()) out_e.addr_(bias_scale->narrow(0, offsets[e], n).to(out.scalar_type()), (*bias)[e]);
      else out_e.add_((*bias)[e]);
    }
  }
  return out;
}

at::Tensor grouped_mm_weight_grad_cuda(const at::Tensor& grad_out, const at::Tensor& x,
                                       const at::Tensor& tokens_per_expert) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t num_experts = tokens_per_expert.numel();
  if (use_grouped_mm(grad_out, x)) {
    auto offsets = at::cumsum(tokens_per_expert, 0, at::kInt);
    return at::_grouped_mm(grad_out.t(), x, offsets);  // 2-D x 2-D: groups along the contraction
  }
  const auto offsets = group_offsets_host(tokens_per_expert);
  auto out = at::zeros({num_experts, grad_out.size(1), x.size(1)}, x.options());
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t n = offsets[e + 1] - offsets[e];
    if (n == 0) continue;
    auto out_e = out[e];
    at::mm_out(out_e, grad_out.narrow(0, offsets[e], n).t(), x.narrow(0, offsets[e], n));
  }
  return out;
}

// ---- activation ----------------------------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ T act_value(T x, int act) {
  switch (act) {
    case 0: return x / (T(1) + exp(-x));                                                // silu
    case 1: return T(0.5) * x * (T(1) + erf(x * T(0.70710678118654752)));               // gelu
    case 2: return T(0.5) * x * (T(1) + tanh(T(0.79788456080286536) * (x + T(0.044715) * x * x * x)));
    case 3: return x > T(0) ? x : T(0);                                                  // relu
    default: { const T r = x > T(0) ? x : T(0); return r * r; }                         // relu2
  }
}

template <typename T>
__device__ __forceinline__ T act_grad(T x, int act) {
  switch (act) {
    case 0: { const T s = T(1) / (T(1) + exp(-x)); return s * (T(1) + x * (T(1) - s)); }
    case 1: return T(0.5) * (T(1) + erf(x * T(0.70710678118654752))) + x * T(0.39894228040143268) * exp(T(-0.5) * x * x);
    case 2: {
      const T k = T(0.79788456080286536), c = T(0.044715);
      const T t = tanh(k * (x + c * x * x * x));
      return T(0.5) * (T(1) + t) + T(0.5) * x * (T(1) - t * t) * k * (T(1) + T(3) * c * x * x);
    }
    case 3: return x > T(0) ? T(1) : T(0);
    default: return x > T(0) ? T(2) * x : T(0);
  }
}

int act_code(Activation act) {
  switch (act) {
    case Activation::Silu: return 0;
    case Activation::Gelu: return 1;
    case Activation::GeluTanh: return 2;
    case Activation::Relu: return 3;
    case Activation::Relu2: return 4;
  }
  return 0;
}

template <typename scalar_t, typename acc_t>
__global__ void act_kernel(const scalar_t* __restrict__ h, const scalar_t* __restrict__ scale, int64_t rows,
                           int64_t width, bool glu, int act, scalar_t* __restrict__ out) {
  const int64_t stride = glu ? 2 * width : width;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < rows * width;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = idx / width, c = idx % width;
    acc_t v = act_value<acc_t>(static_cast<acc_t>(h[r * stride + c]), act);
    if (glu) v *= static_cast<acc_t>(h[r * stride + width + c]);
    if (scale) v *= static_cast<acc_t>(scale[r]);
    out[idx] = static_cast<scalar_t>(v);
  }
}

// One block per row: grad_h for the row, and grad_scale[row] = sum_c grad * (unscaled output).
template <typename scalar_t, typename acc_t>
__global__ void act_backward_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ h,
                                    const scalar_t* __restrict__ scale, int64_t width, bool glu, int act,
                                    scalar_t* __restrict__ grad_h, acc_t* __restrict__ grad_scale,
                                    scalar_t* __restrict__ output) {
  const int64_t r = blockIdx.x;
  const int64_t stride = glu ? 2 * width : width;
  const acc_t s = scale ? static_cast<acc_t>(scale[r]) : acc_t(1);
  acc_t partial = 0;
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
    const acc_t x = static_cast<acc_t>(h[r * stride + c]);
    const acc_t g = static_cast<acc_t>(grad[r * width + c]);
    const acc_t a = act_value<acc_t>(x, act);
    const acc_t up = glu ? static_cast<acc_t>(h[r * stride + width + c]) : acc_t(1);
    partial += g * a * up;
    grad_h[r * stride + c] = static_cast<scalar_t>(g * s * up * act_grad<acc_t>(x, act));
    if (glu) grad_h[r * stride + width + c] = static_cast<scalar_t>(g * s * a);
    if (output) output[r * width + c] = static_cast<scalar_t>(a * up * s);
  }
  if (grad_scale == nullptr) return;
  __shared__ acc_t warp_sums[32];
  for (int offset = 16; offset > 0; offset >>= 1) partial += __shfl_down_sync(0xffffffffu, partial, offset);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = partial;
  __syncthreads();
  if (threadIdx.x < 32) {
    partial = threadIdx.x < (blockDim.x + 31) / 32 ? warp_sums[threadIdx.x] : acc_t(0);
    for (int offset = 16; offset > 0; offset >>= 1) partial += __shfl_down_sync(0xffffffffu, partial, offset);
    if (threadIdx.x == 0) grad_scale[r] = partial;
  }
}

at::Tensor expert_act_cuda(const at::Tensor& h, const c10::optional<at::Tensor>& row_scale,
                           c10::string_view activation, bool glu) {
  const c10::cuda::CUDAGuard guard(h.device());
  const int act = act_code(parse_activation(std::string(activation)));
  auto hc = h.contiguous();
  const int64_t rows = hc.size(0), width = glu ? hc.size(1) / 2 : hc.size(1);
  auto out = at::empty({rows, width}, hc.options());
  if (rows * width == 0) return out;
  at::Tensor scale = row_scale.has_value() ? row_scale->to(hc.scalar_type()).contiguous() : at::Tensor();
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((rows * width + threads - 1) / threads, 65535));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hc.scalar_type(), "expert_act_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    act_kernel<scalar_t, acc_t><<<blocks, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        hc.data_ptr<scalar_t>(), scale.defined() ? scale.data_ptr<scalar_t>() : nullptr, rows, width, glu, act,
        out.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> expert_act_backward_cuda(const at::Tensor& grad, const at::Tensor& h,
                                                                        const c10::optional<at::Tensor>& row_scale,
                                                                        c10::string_view activation, bool glu,
                                                                        bool return_output) {
  const c10::cuda::CUDAGuard guard(h.device());
  const int act = act_code(parse_activation(std::string(activation)));
  auto hc = h.contiguous();
  auto g = grad.contiguous();
  const int64_t rows = hc.size(0), width = glu ? hc.size(1) / 2 : hc.size(1);
  auto grad_h = at::empty_like(hc);
  at::Tensor scale = row_scale.has_value() ? row_scale->to(hc.scalar_type()).contiguous() : at::Tensor();
  const auto acc = hc.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto grad_scale = at::empty({scale.defined() ? rows : 0}, hc.options().dtype(acc));
  auto output = at::empty({return_output ? rows : 0, width}, hc.options());
  if (rows > 0 && width > 0) {
    const int threads = static_cast<int>(std::min<int64_t>(256, ((width + 31) / 32) * 32));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hc.scalar_type(), "expert_act_backward_cuda", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      act_backward_kernel<scalar_t, acc_t><<<rows, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          g.data_ptr<scalar_t>(), hc.data_ptr<scalar_t>(), scale.defined() ? scale.data_ptr<scalar_t>() : nullptr,
          width, glu, act, grad_h.data_ptr<scalar_t>(), scale.defined() ? grad_scale.data_ptr<acc_t>() : nullptr,
          return_output ? output.data_ptr<scalar_t>() : nullptr);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {grad_h, grad_scale.to(scale.defined() ? row_scale->scalar_type() : hc.scalar_type()), output};
}

}  // namespace

TORCH_LIBRARY_IMPL(hf_moe, CUDA, m) {
  m.impl("grouped_mm", &grouped_mm_cuda);
  m.impl("grouped_mm_weight_grad", &grouped_mm_weight_grad_cuda);
  m.impl("expert_act", &expert_act_cuda);
  m.impl("expert_act_backward", &expert_act_backward_cuda);
}

}  // namespace hf_moe
