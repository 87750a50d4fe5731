"""Measuring what a module keeps for its backward pass."""

from __future__ import annotations

import torch


def saved_activation_bytes(module: torch.nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes of the distinct tensors autograd saves for backward during `module(*inputs)`, parameters excluded.

    Tensors are counted once per storage (a view of a saved tensor costs nothing more). Runs a backward to free them.
    """
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    out.sum().backward()
    return sum(seen.values())
