// Dispatch ops on CPU: histogram + stable position assignment (counting sort), row gather, weighted combine.
// Parallelised with at::parallel_for (OpenMP in PyTorch's CPU builds).

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "../hf_moe.h"

namespace hf_moe {

std::vector<int64_t> group_offsets_host(const at::Tensor& tokens_per_expert) {
  auto counts = tokens_per_expert.to(at::kCPU, at::kLong).contiguous();
  const int64_t* c = counts.data_ptr<int64_t>();
  std::vector<int64_t> offsets(counts.numel() + 1, 0);
  for (int64_t e = 0; e < counts.numel(); ++e) offsets[e + 1] = offsets[e] + c[e];
  return offsets;
}

namespace {

// Counting sort of the M expert ids, stable, in parallel chunks:
//   1. each chunk counts its ids per bucket (E experts + 1 bucket for dropped ids),
//   2. bucket-major prefix over (bucket, chunk) gives every chunk its first row in each bucket,
//   3. each chunk walks its ids in order and hands out rows.
std::tuple<at::Tensor, at::Tensor, at::Tensor> sort_by_expert_cpu(const at::Tensor& top_k_index,
                                                                  int64_t num_experts) {
  TORCH_CHECK(num_experts > 0, "num_experts must be positive");
  auto ids = top_k_index.contiguous().view(-1).to(at::kLong);
  const int64_t m = ids.numel();
  const int64_t buckets = num_experts + 1;
  auto sorted_slots = at::empty({m}, ids.options());
  auto slot_to_row = at::empty({m}, ids.options());
  auto counts = at::zeros({num_experts}, ids.options());
  if (m == 0) return {sorted_slots, slot_to_row, counts};

  const int64_t* id = ids.data_ptr<int64_t>();
  int64_t* sorted = sorted_slots.data_ptr<int64_t>();
  int64_t* row_of = slot_to_row.data_ptr<int64_t>();
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads() * 4, m / 4096));
  const int64_t chunk = (m + chunks - 1) / chunks;
  auto bucket = [num_experts](int64_t e) { return (e >= 0 && e < num_experts) ? e : num_experts; };

  std::vector<int64_t> table(chunks * buckets, 0);  // [chunk][bucket]: counts, then first rows
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* t = table.data() + c * buckets;
      for (int64_t i = c * chunk, end = std::min(m, (c + 1) * chunk); i < end; ++i) ++t[bucket(id[i])];
    }
  });
  int64_t* total = counts.data_ptr<int64_t>();
  int64_t row = 0;
  for (int64_t b = 0; b < buckets; ++b) {
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t n = table[c * buckets + b];
      table[c * buckets + b] = row;
      row += n;
      if (b < num_experts) total[b] += n;
    }
  }
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* next = table.data() + c * buckets;
      for (int64_t i = c * chunk, end = std::min(m, (c + 1) * chunk); i < end; ++i) {
        const int64_t r = next[bucket(id[i])]++;
        sorted[r] = i;
        row_of[i] = r;
      }
    }
  });
  return {sorted_slots, slot_to_row, counts};
}

// rows[r] = hidden_states[sorted_slots[r] / top_k]
at::Tensor permute_cpu(const at::Tensor& hidden_states, const at::Tensor& sorted_slots, int64_t top_k) {
  TORCH_CHECK(hidden_states.dim() == 2, "permute: hidden_states must be [N, H]");
  auto x = hidden_states.contiguous();
  auto slots = sorted_slots.contiguous().to(at::kLong);
  const int64_t m = slots.numel(), h = x.size(1);
  auto out = at::empty({m, h}, x.options());
  const int64_t row_bytes = h * x.element_size();
  const char* src = static_cast<const char*>(x.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const int64_t* s = slots.data_ptr<int64_t>();
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(h, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) std::memcpy(dst + r * row_bytes, src + (s[r] / top_k) * row_bytes, row_bytes);
  });
  return out;
}

// out[n] = sum_j w[n, j] * rows[slot_to_row[n * k + j]]   (w = 1 when top_k_weights is absent)
at::Tensor unpermute_cpu(const at::Tensor& rows, const at::Tensor& slot_to_row,
                         const c10::optional<at::Tensor>& top_k_weights, int64_t top_k) {
  TORCH_CHECK(rows.dim() == 2, "unpermute: rows must be [M, H]");
  auto y = rows.contiguous();
  auto rows_of = slot_to_row.contiguous().to(at::kLong);
  const int64_t m = rows_of.numel(), h = y.size(1), n = m / top_k;
  TORCH_CHECK(n * top_k == m, "unpermute: slot_to_row has ", m, " entries, not a multiple of top_k=", top_k);
  auto out = at::empty({n, h}, y.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "unpermute_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    at::Tensor w;
    if (top_k_weights.has_value())
      w = top_k_weights->contiguous().view(-1).to(c10::CppTypeToScalarType<acc_t>::value);
    const scalar_t* src = y.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    const int64_t* ro = rows_of.data_ptr<int64_t>();
    const acc_t* wp = w.defined() ? w.data_ptr<acc_t>() : nullptr;
    at::parallel_for(0, n, std::max<int64_t>(1, 8192 / std::max<int64_t>(h * top_k, 1)), [&](int64_t t0, int64_t t1) {
      std::vector<acc_t> acc(h);
      for (int64_t t = t0; t < t1; ++t) {
        std::fill(acc.begin(), acc.end(), acc_t(0));
        for (int64_t j = 0; j < top_k; ++j) {
          const acc_t wj = wp ? acc_t(wp[t * top_k + j]) : acc_t(1);
          const scalar_t* r = src + ro[t * top_k + j] * h;
          for (int64_t c = 0; c < h; ++c) acc[c] += wj * acc_t(r[c]);
        }
        for (int64_t c = 0; c < h; ++c) dst[t * h + c] = scalar_t(acc[c]);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(hf_moe, CPU, m) {
  m.impl("sort_by_expert", &sort_by_expert_cpu);
  m.impl("permute", &permute_cpu);
  m.impl("unpermute", &unpermute_cpu);
}

}  // namespace hf_moe
