"""`warmup(model, tokens=...)`: run the expert layers once, before training, so what is slow the first time happens
now: the Triton GEMMs' autotuning (which times every config for each new shape, and cannot run inside a CUDA-graph
capture), the kernels' compilation, and on CPU the C++ extension's build.

    model = model.to("cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):   # as the training step will run, if it does
        hf_moe.ops.warmup(model, tokens=batch_size * seq_len)

The autotuner's key is the GEMM's shape with the rows per expert rounded to a power of 2 (grouped_gemm.py), so
`tokens` is the number of tokens one forward gives each MoE layer: batch x sequence length (per rank under expert
parallelism, where every process must call it, as each layer's forward is collective). Give several when the step
sees several (`tokens=[4096, 8192]`). Nothing of the model changes: the gradients are computed with
`torch.autograd.grad`, never accumulated into `.grad`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch

from .backend import dispatch_ops, kernel_activation

logger = logging.getLogger("hf_moe")


def _expert_layers(model: torch.nn.Module) -> dict[tuple, list[str]]:
    """{signature: [module names]} of the modules in transformers' fused-experts layout, grouped by what the kernels
    see (shapes, dtypes, biases, activation, device)."""
    layers: dict[tuple, list[str]] = {}
    for name, module in model.named_modules():
        w1 = getattr(module, "gate_up_proj", None) if getattr(module, "has_gate", False) else getattr(module, "up_proj",
                                                                                                      None)
        w2 = getattr(module, "down_proj", None)
        if not (isinstance(w1, torch.Tensor) and isinstance(w2, torch.Tensor) and w1.dim() == 3 and w2.dim() == 3):
            continue
        biases = tuple(getattr(module, b, None) is not None for b in ("gate_up_proj_bias", "up_proj_bias",
                                                                     "down_proj_bias"))
        act = getattr(module, "activation", None) or type(getattr(module, "act_fn", None)).__name__
        signature = (type(module), tuple(w1.shape), tuple(w2.shape), w1.dtype, w1.device, biases, act)
        layers.setdefault(signature, []).append(name)
    return layers


def warmup(model: torch.nn.Module, tokens: int | Iterable[int], *, top_k: int | None = None) -> list[str]:
    """Run each distinct expert layer of `model` forward and backward on `tokens` random tokens, routed evenly.

    Args:
        model: a converted model, a native MoE model on `experts_implementation="hf_moe"`, or any module holding
            experts modules in transformers' layout; on the device it will train on.
        tokens: tokens per MoE layer call (batch x sequence length), or several such counts.
        top_k: experts per token; default `model.config.num_experts_per_tok`.
    Returns:
        one line per run: the layer, the tokens, the backend that ran, and the seconds it took.
    """
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("hf_moe.ops.warmup runs the layers to autotune them, which cannot happen inside a "
                           "CUDA-graph capture: call it before capturing.")
    counts = [tokens] if isinstance(tokens, int) else list(tokens)
    if not counts or any(int(n) < 1 for n in counts):
        raise ValueError(f"tokens must be a positive token count or a list of them, got {tokens!r}")
    if top_k is None:
        top_k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
        if top_k is None:
            raise ValueError("warmup needs top_k: the model has no config.num_experts_per_tok")
    modules = dict(model.named_modules())
    layers = _expert_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no experts module in transformers' layout (gate_up_proj or "
                         "up_proj, and down_proj, as [E, out, in] tensors): nothing to warm up.")
    done = []
    for names in layers.values():
        experts = modules[names[0]]
        for n in counts:
            start = time.perf_counter()
            backend = _run_once(experts, int(n), int(top_k))
            seconds = time.perf_counter() - start
            alike = f" (and {len(names) - 1} alike)" if len(names) > 1 else ""
            done.append(f"{names[0]}{alike}: {n} tokens x {top_k} experts, {backend}, {seconds:.2f} s")
            logger.info("hf_moe warmup: %s", done[-1])
    return done


def _run_once(experts: torch.nn.Module, tokens: int, top_k: int) -> str:
    """Forward and backward of `experts` at `tokens` tokens; the name of the ops that ran."""
    w2 = experts.down_proj
    num_experts, hidden = w2.shape[0], w2.shape[1]
    device = w2.device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else w2.dtype
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=g).requires_grad_(True)
    index = (torch.arange(tokens * top_k, device=device) % num_experts).view(tokens, top_k)
    weights = torch.full((tokens, top_k), 1.0 / top_k, device=device, dtype=dtype, requires_grad=True)
    with torch.enable_grad():
        out = experts(x, index, weights)  # the module's own forward: what a step runs (expert parallelism included)
        inputs = [x, weights] + [p for p in experts.parameters(recurse=False) if p.requires_grad]
        torch.autograd.grad(out, inputs, torch.randn_like(out))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    activation = getattr(experts, "activation", None) or "silu"
    return dispatch_ops(device, kernel_activation(activation), dtype).name
