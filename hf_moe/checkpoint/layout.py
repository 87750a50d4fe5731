"""Which tensors go into which files: fused expert parameters split per expert, and shards planned by size.

    model parameter     ...mlp.experts.gate_up_proj [E, 2I, H]      (in memory: one fused tensor)
    on-disk keys        ...mlp.experts.{e}.gate_up_proj [2I, H]     (one per expert, in model-expert-{e:05d}*)
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..compat import remove_tied_weights_from_state_dict
from ..layers import Experts
from ..layers.adapter_experts import AdapterExperts
from ..layers.quantized import QuantizedExperts
from .format import EXPERT_FILE_PREFIX, EXPERT_KEY, natural_key


def checkpoint_state_dict(model, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The tensors to save under their on-disk keys: fused expert parameters split per expert (as views), tied
    duplicates and `_keys_to_ignore_on_save` removed."""
    if state_dict is None:
        state_dict = model.state_dict()
    return split_experts(_without_ignored(model, state_dict), model)


def _without_ignored(model, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` without tied duplicates and `_keys_to_ignore_on_save`."""
    state_dict = dict(state_dict)
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state_dict.pop(key, None)
    return remove_tied_weights_from_state_dict(state_dict, model)


def split_experts(state_dict: dict[str, torch.Tensor], module, prefix: str = "") -> dict[str, torch.Tensor]:
    """`state_dict` (of `module`, its keys preceded by `prefix`) with every fused expert tensor [E, ...] of the
    module's `Experts` (and `QuantizedExperts`) split per expert as views: `...experts.up_proj` ->
    `...experts.{e}.up_proj`, e counted from the module's first expert (not 0 for a block of experts held under expert
    parallelism). The adapters of `AdapterExperts` are split the same way (its frozen MLP, a child module, is not per
    expert)."""
    offsets = {  # fused key -> (global id of the first expert of a block, experts in all)
        f"{prefix}{module_name}.{name}": (experts.expert_offset, experts.num_experts)
        for module_name, experts in module.named_modules()
        if isinstance(experts, (Experts, QuantizedExperts, AdapterExperts))
        for name, _ in _expert_tensors(experts)
    }
    out = {}
    for key, tensor in state_dict.items():
        if key in offsets:
            head, _, name = key.rpartition(".")
            first, total = offsets[key]
            first = 0 if tensor.shape[0] == total else first  # all the experts (a gathered state_dict), or a block
            out.update({f"{head}.{first + e}.{name}": tensor[e] for e in range(tensor.shape[0])})
        else:
            out[key] = tensor
    return out


def _expert_tensors(experts):
    """The fused tensors of an experts module: `Experts`' parameters; the int8 weights, scales and biases of
    `QuantizedExperts` (buffers: `hf_moe.quantize`), so that `save_pretrained` writes an int8 model per expert too."""
    if isinstance(experts, QuantizedExperts):
        return [(name, t) for name, t in experts.named_buffers(recurse=False) if t is not None]
    return experts.named_parameters(recurse=False)


def local_state_dict(model, state_dict) -> dict[str, torch.Tensor]:
    """The tensors this process contributes, under on-disk keys: its share of the experts (per expert; see
    `whole_local_experts`) and every non-expert tensor as it is (DTensor or plain; `save.py` gathers)."""
    fused = {
        f"{module_name}.{name}": experts
        for module_name, experts in model.named_modules()
        if isinstance(experts, Experts)
        for name, _ in experts.named_parameters(recurse=False)
    }
    out = {}
    for key, tensor in _without_ignored(model, model.state_dict() if state_dict is None else state_dict).items():
        if key not in fused:
            out[key] = tensor
            continue
        local, ids = whole_local_experts(fused[key], tensor)
        head, _, name = key.rpartition(".")
        out.update({f"{head}.{e}.{name}": local[i] for i, e in enumerate(ids)})
    return out


def plan_shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> dict[str, dict[str, torch.Tensor]]:
    """{filename: {on-disk key: tensor}}: non-expert tensors in model-*.safetensors, one file per expert."""
    common: dict[str, torch.Tensor] = {}
    per_expert: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
    for key, tensor in tensors.items():
        match = EXPERT_KEY.match(key)
        if match:
            per_expert[int(match["expert"])][key] = tensor
        else:
            common[key] = tensor

    shards = {}
    groups = _split_by_size(common, max_bytes)
    for i, group in enumerate(groups):
        shards[f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"] = group
    for e in sorted(per_expert):
        groups = _split_by_size(per_expert[e], max_bytes)
        for i, group in enumerate(groups):
            suffix = "" if len(groups) == 1 else f"-{i + 1:05d}-of-{len(groups):05d}"
            shards[f"{EXPERT_FILE_PREFIX}{e:05d}{suffix}.safetensors"] = group
    return shards


def _split_by_size(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors, key=natural_key):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append({})
            size = 0
        groups[-1][key] = tensors[key]
        size += nbytes
    return groups


def whole_local_experts(experts: Experts, param: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """(tensor [n, ...], the global ids of its n experts): whole experts of `param` (a parameter of `experts`, or
    its state-dict entry) for this process to write, each expert of the model returned by exactly one process.

    Plain parameters: all of them (or the expert-parallel block, before sharding). Sharded on dim 0: this process's
    chunk of its block, no communication. Sharded on dim 1: the block is gathered over "dp" (a collective: every
    process must call this for the same parameters in the same order) and process d of "dp" takes experts d, d + dp,
    ... of it.
    """
    if not isinstance(param, DTensor):
        first = experts.expert_offset if param.shape[0] == experts.num_local_experts else 0
        return param.detach(), list(range(first, first + param.shape[0]))
    plan = experts.ep_plan
    if getattr(param.placements[0], "dim", 0) == 0:
        local = param.to_local().detach()
        per_rank = -(-experts.num_local_experts // plan.dp_size)  # FSDP2 chunks dim 0 as torch.chunk does
        first = experts.expert_offset + plan.dp_rank * per_rank
        return local, list(range(first, first + local.shape[0]))
    block = param.redistribute(plan.mesh, (Replicate(), Shard(0))).to_local().detach()
    mine = list(range(plan.dp_rank, block.shape[0], plan.dp_size))
    return block[mine], [experts.expert_offset + j for j in mine]
