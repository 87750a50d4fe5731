// Dispatch ops on CUDA. Counts and offsets stay on the device: no host synchronisation.
//
// sort_by_expert is a three-kernel stable counting sort:
//   1. count:  one block per chunk of ids counts them per bucket (E experts + 1 for dropped ids) in shared memory;
//   2. scan:   one block turns the [chunk][bucket] counts into each chunk's first row in each bucket
//              (bucket-major order) and writes tokens_per_expert;
//   3. assign: one warp per chunk walks its ids in order, 32 at a time; lanes with the same bucket find each
//              other with __match_any_sync, so ranks inside a step keep the slot order (stable).

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../hf_moe.h"

namespace hf_moe {
namespace {

constexpr int kChunk = 2048;          // ids per chunk
constexpr int kMaxBuckets = 8192;     // shared-memory counters per block (E + 1)

__device__ __forceinline__ int bucket_of(int64_t e, int64_t num_experts) {
  return (e >= 0 && e < num_experts) ? static_cast<int>(e) : static_cast<int>(num_experts);
}

__global__ void count_kernel(const int64_t* __restrict__ ids, int64_t m, int64_t num_experts, int* __restrict__ table) {
  extern __shared__ int counts[];
  const int buckets = static_cast<int>(num_experts) + 1;
  for (int b = threadIdx.x; b < buckets; b += blockDim.x) counts[b] = 0;
  __syncthreads();
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t end = min(m, begin + kChunk);
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) atomicAdd(&counts[bucket_of(ids[i], num_experts)], 1);
  __syncthreads();
  for (int b = threadIdx.x; b < buckets; b += blockDim.x) table[blockIdx.x * buckets + b] = counts[b];
}

// table[c][b] <- first row of chunk c in bucket b; tokens_per_expert[b] <- total of bucket b (b < E).
__global__ void scan_kernel(int* __restrict__ table, int chunks, int64_t num_experts,
                            int64_t* __restrict__ tokens_per_expert, int* __restrict__ totals) {
  const int buckets = static_cast<int>(num_experts) + 1;
  for (int b = threadIdx.x; b < buckets; b += blockDim.x) {
    int sum = 0;
    for (int c = 0; c < chunks; ++c) {
      const int n = table[c * buckets + b];
      table[c * buckets + b] = sum;  // offset inside the bucket, for now
      sum += n;
    }
    totals[b] = sum;
    if (b < num_experts) tokens_per_expert[b] = sum;
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // exclusive scan of the bucket totals (at most kMaxBuckets, once per layer)
    int run = 0;
    for (int b = 0; b < buckets; ++b) {
      const int n = totals[b];
      totals[b] = run;
      run += n;
    }
  }
  __syncthreads();
  for (int b = threadIdx.x; b < buckets; b += blockDim.x)
    for (int c = 0; c < chunks; ++c) table[c * buckets + b] += totals[b];
}

__global__ void assign_kernel(const int64_t* __restrict__ ids, int64_t m, int64_t num_experts,
                              const int* __restrict__ table, int64_t* __restrict__ sorted_slots,
                              int64_t* __restrict__ slot_to_row) {
  extern __shared__ int next_row[];
  const int buckets = static_cast<int>(num_experts) + 1;
  const int lane = threadIdx.x;  // one warp per block
  for (int b = lane; b < buckets; b += 32) next_row[b] = table[blockIdx.x * buckets + b];
  __syncwarp();
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t end = min(m, begin + kChunk);
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t i = base + lane;
    const bool active = i < end;
    const unsigned mask = __ballot_sync(0xffffffffu, active);
    if (active) {
      const int b = bucket_of(ids[i], num_experts);
      const unsigned peers = __match_any_sync(mask, b);
      const int rank = __popc(peers & ((1u << lane) - 1u));
      const int row = next_row[b] + rank;
      sorted_slots[row] = i;
      slot_to_row[i] = row;
      __syncwarp(mask);
      if (rank == 0) next_row[b] += __popc(peers);
    }
    __syncwarp();
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sort_by_expert_cuda(const at::Tensor& top_k_index,
                                                                   int64_t num_experts) {
  TORCH_CHECK(num_experts > 0, "num_experts must be positive");
  const c10::cuda::CUDAGuard guard(top_k_index.device());
  auto ids = top_k_index.contiguous().view(-1).to(at::kLong);
  const int64_t m = ids.numel();
  auto sorted_slots = at::empty({m}, ids.options());
  auto slot_to_row = at::empty({m}, ids.options());
  auto counts = at::zeros({num_experts}, ids.options());
  if (m == 0) return {sorted_slots, slot_to_row, counts};
  if (num_experts + 1 > kMaxBuckets) {  // too many experts for shared-memory counters: a stable radix sort
    auto bucket = at::where((ids >= 0) & (ids < num_experts), ids, at::full_like(ids, num_experts));
    sorted_slots = std::get<1>(at::sort(bucket, /*stable=*/true, /*dim=*/0, /*descending=*/false));
    slot_to_row.index_put_({sorted_slots}, at::arange(m, ids.options()));
    auto all = at::zeros({num_experts + 1}, ids.options()).scatter_add_(0, bucket, at::ones_like(bucket));
    return {sorted_slots, slot_to_row, all.narrow(0, 0, num_experts)};
  }
  TORCH_CHECK(m < (int64_t{1} << 31), "sort_by_expert: more than 2^31 (token, slot) pairs");
  const int chunks = static_cast<int>((m + kChunk - 1) / kChunk);
  const int buckets = static_cast<int>(num_experts) + 1;
  auto table = at::empty({chunks, buckets}, ids.options().dtype(at::kInt));
  auto totals = at::empty({buckets}, ids.options().dtype(at::kInt));
  auto stream = c10::cuda::getCurrentCUDAStream();
  const size_t shared = buckets * sizeof(int);
  count_kernel<<<chunks, 256, shared, stream>>>(ids.data_ptr<int64_t>(), m, num_experts, table.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  scan_kernel<<<1, 1024, 0, stream>>>(table.data_ptr<int>(), chunks, num_experts, counts.data_ptr<int64_t>(),
                                      totals.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  assign_kernel<<<chunks, 32, shared, stream>>>(ids.data_ptr<int64_t>(), m, num_experts, table.data_ptr<int>(),
                                                sorted_slots.data_ptr<int64_t>(), slot_to_row.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {sorted_slots, slot_to_row, counts};
}

template <typename scalar_t>
__global__ void permute_kernel(const scalar_t* __restrict__ x, const int64_t* __restrict__ sorted_slots,
                               int64_t top_k, int64_t h, scalar_t* __restrict__ out) {
  const int64_t r = blockIdx.x;
  const scalar_t* src = x + (sorted_slots[r] / top_k) * h;
  scalar_t* dst = out + r * h;
  for (int64_t c = threadIdx.x; c < h; c += blockDim.x) dst[c] = src[c];
}

at::Tensor permute_cuda(const at::Tensor& hidden_states, const at::Tensor& sorted_slots, int64_t top_k) {
  TORCH_CHECK(hidden_states.dim() == 2, "permute: hidden_states must be [N, H]");
  const c10::cuda::CUDAGuard guard(hidden_states.device());
  auto x = hidden_states.contiguous();
  auto slots = sorted_slots.contiguous().to(at::kLong);
  const int64_t m = slots.numel(), h = x.size(1);
  auto out = at::empty({m, h}, x.options());
  if (m == 0 || h == 0) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t row_bytes = h * x.element_size();
  if (row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0) {
    const int64_t vecs = row_bytes / 16;
    const int threads = static_cast<int>(std::min<int64_t>(256, ((vecs + 31) / 32) * 32));
    // 16-byte copies when every row starts on a 16-byte boundary: the same kernel over uint4 "elements".
    permute_kernel<uint4><<<m, threads, 0, stream>>>(static_cast<const uint4*>(x.data_ptr()),
                                                     slots.data_ptr<int64_t>(), top_k, vecs,
                                                     static_cast<uint4*>(out.data_ptr()));
  } else {
    AT_DISPATCH_ALL_TYPES_AND3(at::kBFloat16, at::kHalf, at::kBool, x.scalar_type(), "permute_cuda", [&] {
      permute_kernel<scalar_t><<<m, 256, 0, stream>>>(x.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(), top_k, h,
                                                      out.data_ptr<scalar_t>());
    });
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

template <typename scalar_t, typename acc_t>
__global__ void unpermute_kernel(const scalar_t* __restrict__ rows, const int64_t* __restrict__ slot_to_row,
                                 const acc_t* __restrict__ weights, int64_t top_k, int64_t h,
                                 scalar_t* __restrict__ out) {
  const int64_t t = blockIdx.x;
  for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
    acc_t acc = 0;
    for (int64_t j = 0; j < top_k; ++j) {
      const acc_t w = weights ? weights[t * top_k + j] : acc_t(1);
      acc += w * static_cast<acc_t>(rows[slot_to_row[t * top_k + j] * h + c]);
    }
    out[t * h + c] = static_cast<scalar_t>(acc);
  }
}

at::Tensor unpermute_cuda(const at::Tensor& rows, const at::Tensor& slot_to_row,
                          const c10::optional<at::Tensor>& top_k_weights, int64_t top_k) {
  TORCH_CHECK(rows.dim() == 2, "unpermute: rows must be [M, H]");
  const c10::cuda::CUDAGuard guard(rows.device());
  auto y = rows.contiguous();
  auto rows_of = slot_to_row.contiguous().to(at::kLong);
  const int64_t m = rows_of.numel(), h = y.size(1), n = m / top_k;
  TORCH_CHECK(n * top_k == m, "unpermute: slot_to_row has ", m, " entries, not a multiple of top_k=", top_k);
  auto out = at::empty({n, h}, y.options());
  if (n == 0 || h == 0) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "unpermute_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    at::Tensor w;
    if (top_k_weights.has_value())
      w = top_k_weights->contiguous().view(-1).to(c10::CppTypeToScalarType<acc_t>::value);
    const int threads = static_cast<int>(std::min<int64_t>(256, ((h + 31) / 32) * 32));
    unpermute_kernel<scalar_t, acc_t><<<n, threads, 0, stream>>>(
        y.data_ptr<scalar_t>(), rows_of.data_ptr<int64_t>(), w.defined() ? w.data_ptr<acc_t>() : nullptr, top_k,
        h, out.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(hf_moe, CUDA, m) {
  m.impl("sort_by_expert", &sort_by_expert_cuda);
  m.impl("permute", &permute_cuda);
  m.impl("unpermute", &unpermute_cuda);
}

}  // namespace hf_moe
