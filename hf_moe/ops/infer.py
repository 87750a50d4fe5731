"""The compiled inference kernel of one MoE layer, `hf_moe::moe_experts_infer` (csrc/cpu/infer_cpu.cpp): when it
runs, and its shape function.

It computes what `moe_experts_forward` computes, without autograd, for fp32, bf16 and int8 (weight-only, see
int8.py) expert weights: weights are read in their own layout, once per call, and a one-token decode splits every
active expert's rows over all threads. It runs where

  * the compiled extension is loaded (the "compiled" backend), the tensors are on CPU and no gradient is needed;
  * the activations are fp32 or bf16 and the weights fp32, bf16 or int8 (fp64 and fp16 take the other path);
  * for fp32 and bf16 weights, the CPU has AVX-512 with BF16 or AVX2 with FMA (`kernel_isa()`: "avx512_bf16" or
    "avx2") and the layer call has no more tokens than `MAX_TOKENS` allows there: where it was measured faster than
    torch's GEMMs (`serves`, `max_tokens`). int8 weights always take it: it is their only compiled kernel
    (elsewhere they are dequantized, then multiplied).
"""

from __future__ import annotations

import functools

import torch

# Per kernel set, layer calls of at most this many tokens take the inference kernel when the weights are fp32 or
# bf16 (None: any number; a kernel set absent: never, torch's GEMMs). With AVX-512 BF16, ours beats MKL at every
# length in fp32, and oneDNN's bf16 GEMM overtakes ours past a few dozen tokens. With AVX2 alone, torch has no fast
# bf16 GEMM (oneDNN's needs AVX-512) and ours beats both of its GEMMs at every length. The portable kernels are
# slower than torch's (benchmarks/experts_kernels.py; the numbers: docs/serving.md, "Measured", and
# docs/serving-cpu.md, "CPUs without AVX-512").
MAX_TOKENS = {
    "avx512_bf16": {torch.float32: None, torch.bfloat16: 32},
    "avx2": {torch.float32: None, torch.bfloat16: None},
}


@functools.cache
def _isa() -> str:
    return torch.ops.hf_moe.infer_isa()


@torch.compiler.assume_constant_result  # decided on the host once; a trace keeps the answer
def kernel_isa() -> str:
    """The kernel set the inference op uses on this CPU: "avx512_bf16", "avx2" (the dot products and GEMMs in AVX2
    with FMA) or "portable". Needs the extension."""
    return _isa()


def serves(dtype: torch.dtype) -> bool:
    """Whether the inference kernel computes expert weights of `dtype` on this CPU (for some token counts at least:
    `max_tokens`). Needs the extension."""
    return dtype == torch.int8 or dtype in MAX_TOKENS.get(kernel_isa(), {})


def max_tokens(dtype: torch.dtype) -> int | None:
    """The most tokens of a layer call the inference kernel computes with weights of `dtype` that it `serves`
    (None: any number). Needs the extension."""
    return None if dtype == torch.int8 else MAX_TOKENS[kernel_isa()][dtype]


def runs(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, save_h: bool) -> bool:
    """Whether `moe_experts_infer` computes this layer (the compiled backend is already chosen by the caller)."""
    if save_h or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or w1.dtype != w2.dtype:
        return False
    if not serves(w1.dtype):
        return False
    limit = max_tokens(w1.dtype)
    return limit is None or x.shape[0] <= limit


def experts_infer(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w1: torch.Tensor,
    w1_scale: torch.Tensor | None,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None,
    b2: torch.Tensor | None,
    activation: str,
    glu: bool,
) -> torch.Tensor:
    """[N, H] -> [N, H] (see `hf_moe::moe_experts_infer`): w1 [E, W, H], w2 [E, H, I] fp32 / bf16, or int8 with
    fp32 scales [E, out] (per channel) or [E, out, groups]."""
    return torch.ops.hf_moe.moe_experts_infer(
        hidden_states, top_k_index, top_k_weights, w1.contiguous(), w1_scale, b1, w2.contiguous(), w2_scale, b2,
        activation, glu,
    )


def infer_fake(hidden_states, top_k_index, top_k_weights, w1, w1_scale, b1, w2, w2_scale, b2, activation, glu,
               kernels="auto"):
    """Shape function of `moe_experts_infer` (torch.compile, torch.export): [N, H] like hidden_states."""
    return hidden_states.new_empty(hidden_states.shape)
