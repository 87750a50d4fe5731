// Stand-in for the header that CUDA builds of PyTorch generate at build time and CPU builds do not ship.
// Used only by tests/test_cuda_compile.py to compile csrc/cuda/*.cu against a CPU-only torch.
#pragma once
#define C10_CUDA_BUILD_SHARED_LIBS
