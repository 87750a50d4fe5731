"""The base an adapter-expert checkpoint refers to, as a fingerprint of the frozen tensors, and what a save of such a
model writes: what was trained, or the whole state dict when the frozen tensors are no longer the base's."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..layers.adapter_experts import adapter_blocks, always_saved, fingerprint_key, trained_state_dict
from .format import CHECKSUM_ALGORITHM, CHECKSUM_ALGORITHMS


def base_fingerprint(model: nn.Module) -> dict[str, Any]:
    """{"fingerprint", "structure", "tensors"}: hashes of the frozen tensors (every state-dict entry an adapter
    checkpoint does not save) by name, dtype, shape and bytes ("structure": without the bytes), and their count."""
    new = CHECKSUM_ALGORITHMS[CHECKSUM_ALGORITHM]
    values, structure = new(), new()
    paths = list(adapter_blocks(model))
    count = 0
    for key, tensor in sorted(model.state_dict().items()):
        if always_saved(key, paths):
            continue
        meta = f"{fingerprint_key(key)}:{str(tensor.dtype).removeprefix('torch.')}:{list(tensor.shape)};".encode()
        structure.update(meta)
        values.update(meta)
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        values.update(data.view(torch.uint8).numpy() if data.numel() else b"")
        count += 1
    return {"fingerprint": f"{CHECKSUM_ALGORITHM}:{values.hexdigest()}",
            "structure": f"{CHECKSUM_ALGORITHM}:{structure.hexdigest()}", "tensors": count}


def saved_state_dict(model: nn.Module, state_dict: dict | None = None) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(What an adapter-expert checkpoint of `model` holds, the keys among them that are frozen). Normally what was
    trained (`trained_state_dict`), the rest being the base's. When the frozen tensors are no longer the base's (their
    fingerprint differs from the one recorded, and from the base as a load cast it to the checkpoint's dtype: a PEFT
    LoRA merged into the attention, a weight edited in place, a cast after the load), the base no longer gives them,
    and the whole state dict is saved; its frozen keys are listed so that a load keeps them frozen. Hashes every
    frozen tensor, as a load's fingerprint check does."""
    trained = trained_state_dict(model, state_dict)
    recorded = (model.config.adapter_experts.get("base_model") or {}).get("fingerprint")
    whole = model.state_dict() if state_dict is None else state_dict
    if not recorded or any(isinstance(t, DTensor) for t in whole.values()):
        return trained, []  # (converted on meta: nothing recorded; sharded: the base is not hashed across ranks)
    if base_fingerprint(model)["fingerprint"] in (recorded, getattr(model, "_cast_base_fingerprint", None)):
        return trained, []  # (the base, or the base as a load cast it: what the checkpoint's dtype gives it again)
    return whole, sorted(k for k in whole if k not in trained)
