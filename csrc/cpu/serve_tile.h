// The register tile of the inference kernels (serve_kernels.h), in a header of its own so that the int8 kernels
// (serve_kernels_q8.cpp) compile without ATen's headers.
#pragma once

namespace hf_moe {
namespace serve {

// Output rows per kernel call (`cols` <= kTile) and activation rows per register tile.
constexpr int kTile = 4;

}  // namespace serve
}  // namespace hf_moe
