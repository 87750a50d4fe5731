// The register tile of the inference kernels (infer_kernels.h), in a header of its own so that the int8 kernels
// (infer_kernels_q8.cpp) compile without ATen's headers.
#pragma once

namespace hf_moe {
namespace infer {

// Output rows per kernel call (`cols` <= kTile) and activation rows per register tile.
constexpr int kTile = 4;

}  // namespace infer
}  // namespace hf_moe
