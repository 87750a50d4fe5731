"""The base an adapter-expert checkpoint refers to, as a fingerprint of the frozen tensors, and what a save of such a
model writes: what was trained, and the frozen tensors that are no longer the base's."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..layers.adapter_experts import adapter_blocks, always_saved, fingerprint_key, trained_state_dict
from .format import CHECKSUM_ALGORITHM, CHECKSUM_ALGORITHMS

# The model attribute holding {state-dict key: digest} of its frozen tensors as they were the base's (set where the
# fingerprint is computed or checked: conversion and load): what a save compares each frozen tensor with.
DIGESTS = "_hf_moe_base_digests"


def base_fingerprint(model: nn.Module, digests: dict[str, str] | None = None) -> dict[str, Any]:
    """{"fingerprint", "structure", "tensors"}: hashes of the frozen tensors (every state-dict entry an adapter
    checkpoint does not save) by name, dtype, shape and bytes ("structure": without the bytes), and their count.
    `digests`, if given, receives each tensor's own digest (`tensor_digest`), from the same read."""
    new = CHECKSUM_ALGORITHMS[CHECKSUM_ALGORITHM]
    values, structure = new(), new()
    paths = list(adapter_blocks(model))
    count = 0
    for key, tensor in sorted(model.state_dict().items()):
        if always_saved(key, paths):
            continue
        meta, data = _meta_and_bytes(key, tensor)
        structure.update(meta)
        values.update(meta)
        values.update(data)
        if digests is not None:
            digests[key] = _digest(meta, data)
        count += 1
    return {"fingerprint": f"{CHECKSUM_ALGORITHM}:{values.hexdigest()}",
            "structure": f"{CHECKSUM_ALGORITHM}:{structure.hexdigest()}", "tensors": count}


def record_digests(model: nn.Module, digests: dict[str, str] | None = None) -> None:
    """Keep on `model` the digest of each of its frozen tensors as they are now, the base's (`DIGESTS`): given, or
    read now."""
    if digests is None:
        digests = {}
        base_fingerprint(model, digests)
    object.__setattr__(model, DIGESTS, digests)  # (a plain attribute: not a parameter, buffer or module)


def saved_state_dict(model: nn.Module, state_dict: dict | None = None) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(What an adapter-expert checkpoint of `model` holds, the keys among them that are frozen): what was trained
    (`trained_state_dict`), and each frozen tensor that is no longer the base's (a PEFT LoRA merged into the
    attention, a weight changed in place, a cast after the load), which the base would not give back; a load keeps
    those frozen. Each frozen tensor is compared with its digest taken at conversion or load (`record_digests`); a
    model without them (built otherwise) is compared whole with the base fingerprint, and saved whole if it differs.
    Hashes every frozen tensor, as a load's fingerprint check does."""
    trained = trained_state_dict(model, state_dict)
    whole = model.state_dict() if state_dict is None else state_dict
    if any(isinstance(t, DTensor) for t in whole.values()):
        return trained, []  # (sharded: the frozen tensors are not hashed across ranks)
    digests = getattr(model, DIGESTS, None)
    if digests is not None:
        changed = sorted(k for k, t in whole.items() if k not in trained and digests.get(k) != tensor_digest(k, t))
        return {**trained, **{k: whole[k] for k in changed}}, changed
    recorded = (model.config.adapter_experts.get("base_model") or {}).get("fingerprint")
    if not recorded or base_fingerprint(model)["fingerprint"] == recorded:
        return trained, []  # (converted on meta: nothing recorded)
    return whole, sorted(k for k in whole if k not in trained)


def tensor_digest(key: str, tensor: torch.Tensor) -> str:
    """The digest of one tensor: its name, dtype, shape and bytes."""
    return _digest(*_meta_and_bytes(key, tensor))


def _meta_and_bytes(key: str, tensor: torch.Tensor):
    meta = f"{fingerprint_key(key)}:{str(tensor.dtype).removeprefix('torch.')}:{list(tensor.shape)};".encode()
    data = tensor.detach().to("cpu").contiguous().reshape(-1)
    return meta, (data.view(torch.uint8).numpy() if data.numel() else b"")


def _digest(meta: bytes, data) -> str:
    digest = CHECKSUM_ALGORITHMS[CHECKSUM_ALGORITHM](meta)
    digest.update(data)
    return digest.hexdigest()
