// The expert computation of one MoE layer for inference on CPU, one call, with fp32, bf16 or int8 (weight-only)
// expert weights: hf_moe::moe_experts_infer. Same maths as the whole-layer op moe_experts_forward
// (whole_layer_cpu.cpp), without autograd:
//
//   a_r = act(x_t W1_e^T + b1_e) * w_r              (GLU: act(gate) * up)      for each (token t, expert e) pair r
//   out_t = sum over t's pairs of  a_r W2_e^T + w_r b2_e
//
// Compute precision follows the weights: fp32 weights compute in fp32; bf16 weights in bf16 with fp32 accumulation
// (vdpbf16ps); int8 weights are dequantized (q * scale, fp32) without the dequantized matrix ever reaching memory:
// for an expert's few rows (decoding) in registers, multiplied in fp32 (bf16 activations are exact in fp32); for
// many rows (prefill) a few weight rows at a time into L1, in the activations' precision (fp32, or rounded to bf16
// for bf16 activations, then vdpbf16ps; in fp32 where the CPU has no bf16 instructions: `run`'s caller). Either way
// the result is dequantize-then-matmul. Scales are fp32, one per output row ([E, out]) or per group of `K / G` inputs
// ([E, out, G]).
//
// Work is split by output columns, never by expert, so every thread streams its share of every active expert's
// weights once: a one-token decode reads each active weight once, with both threads busy, and a long prefill reuses
// each few weight rows (in L1) for all the rows routed to that expert. An expert with few rows (decoding) runs the
// dot-product kernels on its rows as they are; one with kGemmRows or more (prefill) has its rows packed k-major
// once (when they are gathered, and when its activations are written) for the GEMM kernels (infer_kernels.h).
//   phase 1: blocks of intermediate columns j (gate rows j and up rows I + j together, so the activation follows
//            at once): a [M, I], the M = N k pairs grouped by expert;
//   phase 2: blocks of hidden columns: out[:, block] summed over every expert's pairs.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "../hf_moe.h"
#include "decode_ops.h"
#include "infer_kernels.h"

namespace hf_moe {
namespace {

using infer::Kernels;
using infer::kTile;

constexpr int64_t kUpBlock = 64;    // intermediate columns per phase-1 task
constexpr int64_t kDownBlock = 32;  // hidden columns per phase-2 task

// Rows [r0, r0 + cols) of expert e of one weight (its view, checked once: `weight_view`), in the compute type T
// (float, or bf16 bits as uint16_t).
template <typename T>
struct WeightRows {
  const char* data;
  at::ScalarType dtype;
  int64_t rows, k;  // per expert: [rows, k]
  const float* scale = nullptr;
  int64_t ld_scale = 1, group = 1;

  explicit WeightRows(const WeightView& v)
      : data(v.data), dtype(v.dtype), rows(v.out), k(v.k), scale(v.scale), ld_scale(v.ld_scale), group(v.group) {}

  // A pointer to the rows and their stride: into the weight itself, or (int8) into `scratch`, dequantized.
  const T* get(const Kernels& kn, int64_t e, int64_t r0, int cols, T* scratch, int64_t& ld) const {
    const int64_t first = e * rows + r0;
    if (dtype != at::kChar) {
      ld = k;
      return reinterpret_cast<const T*>(data) + first * k;
    }
    const auto* q = reinterpret_cast<const int8_t*>(data) + first * k;
    const float* s = scale + first * ld_scale;
    ld = k;
    if constexpr (std::is_same_v<T, float>) kn.dequant_f32(q, k, s, ld_scale, group, cols, k, scratch);
    else kn.dequant_bf16(q, k, s, ld_scale, group, cols, k, scratch);
    return scratch;
  }

  // int8 rows against fp32 activation rows, dequantized in registers (the decode path of int8 experts).
  void dot_q8(const Kernels& kn, int64_t e, int64_t r0, int cols, const float* x, int64_t ldx, int64_t n, float* out,
              int64_t ldo) const {
    const int64_t first = e * rows + r0;
    kn.dot_q8(x, ldx, n, reinterpret_cast<const int8_t*>(data) + first * k, k, scale + first * ld_scale, ld_scale,
              group, cols, k, out, ldo);
  }
};

// rows x width values of type T as fp32: `src` itself for fp32, else converted into `scratch`.
template <typename T>
const float* as_f32(const T* src, int64_t n, float* scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
      std::memcpy(scratch + i, &bits, sizeof bits);
    }
    return scratch;
  }
}

template <typename T>
void dot(const Kernels& kn, const T* x, int64_t ldx, int64_t rows, const T* w, int64_t ldw, int cols, int64_t k,
         float* out, int64_t ldo) {
  if constexpr (std::is_same_v<T, float>) kn.dot_f32(x, ldx, rows, w, ldw, cols, k, out, ldo);
  else kn.dot_bf16(x, ldx, rows, w, ldw, cols, k, out, ldo);
}

inline float load_float(const void* p, at::ScalarType t, int64_t i) {
  if (t == at::kFloat) return static_cast<const float*>(p)[i];
  if (t == at::kBFloat16) return static_cast<float>(static_cast<const at::BFloat16*>(p)[i]);
  return static_cast<float>(static_cast<const at::Half*>(p)[i]);
}

// Per-thread scratch, grown on demand and kept: a decode step then allocates nothing.
float* thread_scratch(size_t floats) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < floats) buffer.resize(floats);
  return buffer.data();
}

template <typename T>
void gemm(const Kernels& kn, const T* w, int64_t ldw, int cols, const T* packed, int64_t ld, int64_t rows, int64_t k,
          float* out, int64_t ldo) {
  if constexpr (std::is_same_v<T, float>) kn.gemm_f32(w, ldw, cols, packed, ld, rows, k, out, ldo);
  else kn.gemm_bf16(w, ldw, cols, packed, ld, rows, k, out, ldo);
}

template <typename T>
int64_t packed_index(int64_t c, int64_t m, int64_t ld) {
  return std::is_same_v<T, float> ? infer::packed_index_f32(c, m, ld) : infer::packed_index_bf16(c, m, ld);
}

// One expert's rows of activations, the left operand of its products with a weight: `rows` rows of k values in the
// compute type, packed k-major for the GEMM kernels (`ld` rows) or row-major for the dot kernels; for int8 weights
// on the dot path, also as fp32 (`f32`, else null).
template <typename T>
struct ExpertInput {
  const T* data;
  const float* f32;
  bool packed;
  int64_t ld, rows, k;

  int64_t step(const Kernels& kn) const { return packed ? kn.gemm_cols : kTile; }  // weight rows per kernel call
};

// out[r * ldo + j] = x_r . w_e[r0 + j] for r < x.rows, j < cols <= x.step(kn): int8 weight rows dequantized in
// registers against x.f32 where it is set, else the weight rows (int8 ones dequantized into `scratch`) against x.data.
template <typename T>
void multiply(const Kernels& kn, const ExpertInput<T>& x, const WeightRows<T>& w, int64_t e, int64_t r0, int cols,
              T* scratch, float* out, int64_t ldo) {
  if (x.f32) {
    w.dot_q8(kn, e, r0, cols, x.f32, x.k, x.rows, out, ldo);
    return;
  }
  int64_t ld;
  const T* wr = w.get(kn, e, r0, cols, scratch, ld);
  if (x.packed) gemm(kn, wr, ld, cols, x.data, x.ld, x.rows, x.k, out, ldo);
  else dot(kn, x.data, x.k, x.rows, wr, ld, cols, x.k, out, ldo);
}

// Where each expert's rows live in a buffer of `width` values per row: row-major (few rows: the dot kernels), or
// packed k-major for the GEMM kernels (infer_kernels.h), with `ld` rows (a multiple of 16, zero-padded).
struct ExpertRows {
  std::vector<int64_t> start, ld;
  std::vector<char> packed;
  int64_t size = 0;

  // Lays out the rows of `offsets` (rebuilt in place: the vectors keep their memory from call to call).
  void lay_out(const std::vector<int64_t>& offsets, int64_t width) {
    const int64_t experts = static_cast<int64_t>(offsets.size()) - 1;
    start.clear();
    ld.clear();
    packed.clear();
    size = 0;
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t rows = offsets[e + 1] - offsets[e];
      const bool gemm = rows >= infer::kGemmRows;
      start.push_back(size);
      ld.push_back(gemm ? (rows + 15) / 16 * 16 : rows);
      packed.push_back(gemm);
      size += gemm ? ld.back() * (width + width % 2) : rows * width;
    }
  }

  // Expert e's `rows` rows of `buffer` (laid out here, `width` values per row), and as fp32 in `f32_scratch` when
  // `int8` weights take them on the dot path.
  template <typename T>
  ExpertInput<T> input(const T* buffer, int64_t e, int64_t rows, int64_t width, bool int8, float* f32_scratch) const {
    const T* data = buffer + start[e];
    const float* f32 = int8 && !packed[e] ? as_f32(data, rows * width, f32_scratch) : nullptr;
    return {data, f32, static_cast<bool>(packed[e]), ld[e], rows, width};
  }
};

}  // namespace

// The host-side buffers of one moe_experts_infer call, kept by a caller that calls it again (the decode plan): they
// grow to the largest call and are then reused, so a decode step allocates nothing here.
struct ExpertsWorkspace {
  std::vector<int64_t> offsets, next, row_token, experts, row_expert;
  std::vector<float> row_weight, acc, xs_f32, a_f32;
  std::vector<uint16_t> xs_bf16, a_bf16;
  ExpertRows x_rows, a_rows;
};

ExpertsWorkspacePtr make_experts_workspace() { return std::make_shared<ExpertsWorkspace>(); }

namespace {

template <typename T>
std::vector<T>& buffer_of(std::vector<float>& f32, std::vector<uint16_t>& bf16) {
  if constexpr (std::is_same_v<T, float>) return f32;
  else return bf16;
}

// `bias1` and `bias2`: fp32 and contiguous, or undefined.
template <typename T>
void run(const Kernels& kn, const at::Tensor& x, ExpertsWorkspace& ws, const WeightView& w1, const at::Tensor& bias1,
         const WeightView& w2, const at::Tensor& bias2, Activation act, bool glu, at::Tensor& out) {
  const std::vector<int64_t>& offsets = ws.offsets;
  const std::vector<int64_t>& row_token = ws.row_token;
  const std::vector<float>& row_weight = ws.row_weight;
  const int64_t n_tokens = x.size(0), hid = x.size(1), num_experts = w1.count;
  const int64_t inter = glu ? w1.out / 2 : w1.out, m = offsets.back();
  const WeightRows<T> up(w1), down(w2);
  const float* bias1_p = bias1.defined() ? bias1.data_ptr<float>() : nullptr;
  const float* bias2_p = bias2.defined() ? bias2.data_ptr<float>() : nullptr;
  const bool out_f32 = out.scalar_type() == at::kFloat;
  const bool int8 = w1.dtype == at::kChar;

  ExpertRows& x_rows = ws.x_rows;
  ExpertRows& a_rows = ws.a_rows;
  x_rows.lay_out(offsets, hid);
  a_rows.lay_out(offsets, inter);
  // the pairs' rows of x, grouped by expert, in the compute type (zero-padded), and their activations
  std::vector<T>& xs = buffer_of<T>(ws.xs_f32, ws.xs_bf16);
  std::vector<T>& a = buffer_of<T>(ws.a_f32, ws.a_bf16);
  xs.assign(x_rows.size, T(0));
  a.assign(a_rows.size, T(0));
  ws.acc.resize(out_f32 ? 0 : n_tokens * hid);  // fp32 sums for a bf16 output
  float* sum = out_f32 ? out.data_ptr<float>() : ws.acc.data();
  std::vector<int64_t>& experts = ws.experts;
  std::vector<int64_t>& row_expert = ws.row_expert;
  experts.clear();
  row_expert.resize(m);
  int64_t largest = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    if (offsets[e + 1] > offsets[e]) experts.push_back(e);
    largest = std::max(largest, offsets[e + 1] - offsets[e]);
    std::fill(row_expert.begin() + offsets[e], row_expert.begin() + offsets[e + 1], e);
  }
  const int64_t up_blocks = (inter + kUpBlock - 1) / kUpBlock;
  const int64_t up_tasks = static_cast<int64_t>(experts.size()) * up_blocks;
  const int64_t down_tasks = (hid + kDownBlock - 1) / kDownBlock;
  const void* x_p = x.data_ptr();
  const at::ScalarType x_t = x.scalar_type();
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(),
                                                                              std::max(up_tasks, down_tasks))));

  // Stores value v of row r (of expert e, its local row i), input c, into a buffer laid out by `rows`.
  auto put = [](T* buffer, const ExpertRows& rows, int64_t e, int64_t i, int64_t width, int64_t c, T v) {
    buffer[rows.start[e] + (rows.packed[e] ? packed_index<T>(c, i, rows.ld[e]) : i * width + c)] = v;
  };
  auto gather = [&](int64_t r) {  // row r of xs: the pair's token row of x, in the compute type
    const int64_t t = row_token[r], e = row_expert[r], i = r - offsets[e];
    if (!x_rows.packed[e]) {
      T* dst = xs.data() + x_rows.start[e] + i * hid;
      if (std::is_same_v<T, float> && x_t == at::kFloat) {
        std::memcpy(dst, static_cast<const float*>(x_p) + t * hid, hid * sizeof(float));
        return;
      }
      if (!std::is_same_v<T, float> && x_t == at::kBFloat16) {
        std::memcpy(dst, static_cast<const at::BFloat16*>(x_p) + t * hid, hid * sizeof(uint16_t));
        return;
      }
    }
    for (int64_t c = 0; c < hid; ++c) {
      T v;
      if (std::is_same_v<T, float> == (x_t == at::kFloat)) {
        std::memcpy(&v, static_cast<const char*>(x_p) + (t * hid + c) * sizeof(T), sizeof(T));
      } else {
        const float f = load_float(x_p, x_t, t * hid + c);
        if constexpr (std::is_same_v<T, float>) v = f;
        else kn.to_bf16(&f, 1, &v);
      }
      put(xs.data(), x_rows, e, i, hid, c, v);
    }
  };
  // Decode-sized batches gather on this thread: one barrier fewer, where a barrier costs as much as the copy.
  const bool serial_gather = m * hid <= (1 << 16);
  if (serial_gather)
    for (int64_t r = 0; r < m; ++r) gather(r);

#pragma omp parallel num_threads(threads)
  {
    // Scratch: two blocks of dequantized weight rows (int8), the gate and up sums of phase 1, one row of
    // activations (fp32, and in the compute type), the output sums of phase 2.
    constexpr int64_t kRows = std::max<int64_t>(kTile, infer::kGemmColsMax);
    const int64_t kmax = std::max(hid, inter), most = std::max<int64_t>(largest, 1);
    float* scratch = thread_scratch(2 * kRows * kmax + 2 * kUpBlock * most + 2 * kUpBlock + kDownBlock * most +
                                    (int8 ? kmax * std::min<int64_t>(most, infer::kGemmRows) : 0));
    T* wbuf = reinterpret_cast<T*>(scratch);
    float* gate = scratch + 2 * kRows * kmax;
    float* upv = gate + kUpBlock * most;
    float* tmp = upv + kUpBlock * most;
    T* tmp_t = reinterpret_cast<T*>(tmp + kUpBlock);
    float* ybuf = tmp + 2 * kUpBlock;
    float* x_f32 = ybuf + kDownBlock * most;  // (int8 decode) an expert's few rows as fp32

    if (!serial_gather) {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < m; ++r) gather(r);
    }

    // Phase 1: a = act(x W1^T + b1) * w, block by block of intermediate columns.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < up_tasks; ++task) {
      const int64_t e = experts[task / up_blocks];
      const int64_t j0 = (task % up_blocks) * kUpBlock, width = std::min(kUpBlock, inter - j0);
      const int64_t r0 = offsets[e], rows = offsets[e + 1] - r0;
      const ExpertInput<T> xe = x_rows.input(xs.data(), e, rows, hid, int8, x_f32);
      for (int64_t j = 0; j < width; j += xe.step(kn)) {
        const int cols = static_cast<int>(std::min<int64_t>(xe.step(kn), width - j));
        for (int half = 0; half < (glu ? 2 : 1); ++half)
          multiply(kn, xe, up, e, half * inter + j0 + j, cols, wbuf + half * kRows * kmax, (half ? upv : gate) + j,
                   kUpBlock);
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* g = gate + r * kUpBlock;
        float* u = upv + r * kUpBlock;
        if (bias1_p) {
          const float* b = bias1_p + e * w1.out;
          for (int64_t j = 0; j < width; ++j) g[j] += b[j0 + j];
          if (glu)
            for (int64_t j = 0; j < width; ++j) u[j] += b[inter + j0 + j];
        }
        kn.activate(g, glu ? u : nullptr, row_weight[r0 + r], width, act, tmp);
        T* values;
        if constexpr (std::is_same_v<T, float>) {
          values = tmp;
        } else {
          kn.to_bf16(tmp, width, tmp_t);
          values = tmp_t;
        }
        if (a_rows.packed[e]) {
          for (int64_t j = 0; j < width; ++j) put(a.data(), a_rows, e, r, inter, j0 + j, values[j]);
        } else {
          std::memcpy(a.data() + a_rows.start[e] + r * inter + j0, values, width * sizeof(T));
        }
      }
    }

    // Phase 2: out[:, block] = sum over pairs of a W2^T + w b2 (fp32 sums).
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < down_tasks; ++task) {
      const int64_t n0 = task * kDownBlock, width = std::min(kDownBlock, hid - n0);
      for (int64_t t = 0; t < n_tokens; ++t) std::fill_n(sum + t * hid + n0, width, 0.0f);
      for (int64_t e : experts) {
        const int64_t r0 = offsets[e], rows = offsets[e + 1] - r0;
        const ExpertInput<T> ae = a_rows.input(a.data(), e, rows, inter, int8, x_f32);
        for (int64_t j = 0; j < width; j += ae.step(kn)) {
          const int cols = static_cast<int>(std::min<int64_t>(ae.step(kn), width - j));
          multiply(kn, ae, down, e, n0 + j, cols, wbuf, ybuf + j, kDownBlock);
        }
        const float* b = bias2_p ? bias2_p + e * hid + n0 : nullptr;
        for (int64_t r = 0; r < rows; ++r) {
          float* dst = sum + row_token[r0 + r] * hid + n0;
          const float* y = ybuf + r * kDownBlock;
          const float rw = row_weight[r0 + r];
          if (b) {
            for (int64_t j = 0; j < width; ++j) dst[j] += y[j] + rw * b[j];
          } else {
            for (int64_t j = 0; j < width; ++j) dst[j] += y[j];
          }
        }
      }
      if (!out_f32) {
        auto* o = static_cast<uint16_t*>(out.data_ptr());
        for (int64_t t = 0; t < n_tokens; ++t) kn.to_bf16(sum + t * hid + n0, width, o + t * hid + n0);
      }
    }
  }
}

}  // namespace

std::pair<WeightView, WeightView> check_experts(const at::Tensor& w1, const c10::optional<at::Tensor>& w1_scale,
                                                const c10::optional<at::Tensor>& b1, const at::Tensor& w2,
                                                const c10::optional<at::Tensor>& w2_scale,
                                                const c10::optional<at::Tensor>& b2, int64_t hid, bool glu) {
  TORCH_CHECK(w1.dim() == 3 && w2.dim() == 3, "moe_experts_infer: w1 [E, W, H] and w2 [E, H, I] must be contiguous "
              "3-D tensors, got ", w1.sizes(), " and ", w2.sizes());
  const WeightView up = weight_view(w1, w1_scale, "moe_experts_infer: w1");
  const WeightView down = weight_view(w2, w2_scale, "moe_experts_infer: w2");
  TORCH_CHECK(down.dtype == up.dtype, "moe_experts_infer: w1 is ", up.dtype, " but w2 is ", down.dtype);
  const int64_t num_experts = up.count;
  const int64_t inter = glu ? up.out / 2 : up.out;
  TORCH_CHECK(up.k == hid && down.count == num_experts && down.out == hid && down.k == inter &&
              (!glu || up.out % 2 == 0), "moe_experts_infer: shapes do not match: hidden size ", hid,
              ", w1 ", w1.sizes(), ", w2 ", w2.sizes(), glu ? " (GLU)" : "");
  TORCH_CHECK(!b1.has_value() || (b1->dim() == 2 && b1->size(0) == num_experts && b1->size(1) == up.out),
              "moe_experts_infer: b1 must be [E, W]");
  TORCH_CHECK(!b2.has_value() || (b2->dim() == 2 && b2->size(0) == num_experts && b2->size(1) == hid),
              "moe_experts_infer: b2 must be [E, H]");
  return {up, down};
}

void moe_experts_infer_into(const at::Tensor& x, const int64_t* id, const float* wp, int64_t top_k,
                            const WeightView& w1, const at::Tensor& bias1, const WeightView& w2,
                            const at::Tensor& bias2, c10::string_view activation, bool glu, c10::string_view kernels,
                            ExpertsWorkspace& ws, at::Tensor& out) {
  const Kernels& kn = infer::infer_kernels(std::string(kernels));
  const Activation act = parse_activation(std::string(activation));
  const int64_t n_tokens = x.size(0), num_experts = w1.count, pairs = n_tokens * top_k;
  if (n_tokens == 0) return;
  // Group the pairs by expert (a stable counting sort on the host: N k numbers, nothing next to the GEMMs).
  // Pairs with an id outside [0, E) are dropped: they contribute nothing.
  std::vector<int64_t>& offsets = ws.offsets;
  offsets.assign(num_experts + 1, 0);
  for (int64_t s = 0; s < pairs; ++s)
    if (id[s] >= 0 && id[s] < num_experts) ++offsets[id[s] + 1];
  for (int64_t e = 0; e < num_experts; ++e) offsets[e + 1] += offsets[e];
  ws.next.assign(offsets.begin(), offsets.end() - 1);
  ws.row_token.resize(offsets.back());
  ws.row_weight.resize(offsets.back());
  for (int64_t s = 0; s < pairs; ++s) {
    if (id[s] < 0 || id[s] >= num_experts) continue;
    const int64_t r = ws.next[id[s]]++;
    ws.row_token[r] = s / top_k;
    ws.row_weight[r] = wp[s];
  }
  if (offsets.back() == 0) {
    out.zero_();
    return;
  }
  const auto wt = w1.dtype;
  // int8 weights and bf16 activations compute in bf16 (vdpbf16ps), except for a prefill on a CPU without bf16
  // instructions, where the fp32 GEMM tile runs faster than the bf16 one's widening of every pair (docs/serving-cpu.md,
  // "CPUs without AVX-512"): its weights are then dequantized in fp32, not rounded to bf16.
  int64_t largest = 0;
  for (int64_t e = 0; e < num_experts; ++e) largest = std::max(largest, offsets[e + 1] - offsets[e]);
  const bool fp32_prefill =
      wt == at::kChar && largest >= infer::kGemmRows && !infer::avx512_kernels(std::string(kernels));
  const bool bf16 = wt == at::kBFloat16 || (wt == at::kChar && x.scalar_type() == at::kBFloat16 && !fp32_prefill);
  if (bf16) run<uint16_t>(kn, x, ws, w1, bias1, w2, bias2, act, glu, out);
  else run<float>(kn, x, ws, w1, bias1, w2, bias2, act, glu, out);
}

at::Tensor moe_experts_infer_cpu(const at::Tensor& hidden_states, const at::Tensor& top_k_index,
                                 const at::Tensor& top_k_weights, const at::Tensor& w1,
                                 const c10::optional<at::Tensor>& w1_scale, const c10::optional<at::Tensor>& b1,
                                 const at::Tensor& w2, const c10::optional<at::Tensor>& w2_scale,
                                 const c10::optional<at::Tensor>& b2, c10::string_view activation, bool glu,
                                 c10::string_view kernels) {
  infer::infer_kernels(std::string(kernels));  // an unknown kernel set is refused before the shapes
  parse_activation(std::string(activation));
  TORCH_CHECK(hidden_states.dim() == 2, "moe_experts_infer: hidden_states must be [N, H], got ", hidden_states.sizes());
  TORCH_CHECK(hidden_states.scalar_type() == at::kFloat || hidden_states.scalar_type() == at::kBFloat16,
              "moe_experts_infer: hidden_states must be fp32 or bf16, got ", hidden_states.scalar_type());
  const int64_t n_tokens = hidden_states.size(0), hid = hidden_states.size(1);
  const auto views = check_experts(w1, w1_scale, b1, w2, w2_scale, b2, hid, glu);
  TORCH_CHECK(top_k_index.dim() == 2 && top_k_index.size(0) == n_tokens && top_k_weights.sizes() == top_k_index.sizes(),
              "moe_experts_infer: top_k_index and top_k_weights must be [N, k] for N = ", n_tokens);

  auto out = at::empty({n_tokens, hid}, hidden_states.options());
  if (n_tokens == 0) return out;
  const auto x = hidden_states.contiguous();
  const auto ids = top_k_index.to(at::kLong).contiguous();
  const auto weights = top_k_weights.to(at::kFloat).contiguous();
  const at::Tensor bias1 = b1.has_value() ? b1->to(at::kFloat).contiguous() : at::Tensor();
  const at::Tensor bias2 = b2.has_value() ? b2->to(at::kFloat).contiguous() : at::Tensor();
  ExpertsWorkspace ws;
  moe_experts_infer_into(x, ids.data_ptr<int64_t>(), weights.data_ptr<float>(), ids.size(1), views.first, bias1,
                         views.second, bias2, activation, glu, kernels, ws, out);
  return out;
}

namespace {

std::string infer_isa_cpu() { return infer::infer_kernels("auto").isa; }

}  // namespace

// moe_experts_infer's schema is defined in Python with the other ops (hf_moe/ops/library.py), so saved programs
// that call it load after `import hf_moe`; this file registers its CPU kernel. Inference only (no autograd).
TORCH_LIBRARY_FRAGMENT(hf_moe, m) {
  m.def("infer_isa() -> str", &infer_isa_cpu);  // the kernel set "auto" picks on this CPU
  m.def("serve_isa() -> str", &infer_isa_cpu);  // its former name, kept for scripts that call it (deprecated)
}

TORCH_LIBRARY_IMPL(hf_moe, CPU, m) { m.impl("moe_experts_infer", &moe_experts_infer_cpu); }

}  // namespace hf_moe
