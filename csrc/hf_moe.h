// hf_moe compiled ops: shared declarations.
//
// Notation: N tokens, k experts per token, E experts, H hidden, I intermediate, M = N * k (token, slot) pairs.
// A pair is identified by its slot id s = token * k + slot. Dispatch sorts the pairs by expert (stably), so each
// expert's rows are one contiguous group:
//   sorted_slots [M]       slot id of the pair at each sorted row
//   slot_to_row  [M]       sorted row of each slot id (the inverse permutation)
//   tokens_per_expert [E]  group sizes; pairs whose expert id is outside [0, E) ("dropped") sort after all groups
//
// Every op has a pure-torch twin in hf_moe/ops/reference.py with the same schema; tests compare the two.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>

#include "activation.h"

namespace hf_moe {

// Rows [begin, end) of each group, from tokens_per_expert on the host (CPU tensors only).
std::vector<int64_t> group_offsets_host(const at::Tensor& tokens_per_expert);

}  // namespace hf_moe
