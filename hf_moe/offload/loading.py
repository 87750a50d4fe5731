"""`MoEForCausalLM.from_pretrained(path, offload_experts=..., max_expert_memory=...)`.

Everything but the experts loads through transformers as usual, from a view of the directory that lists only the
non-expert files (`checkpoint.local_expert_view`), into a model whose `Experts` were replaced by `OffloadedExperts`
right after construction, so no expert weight is ever allocated. The experts stay in their per-expert files
("disk") or are read once into host memory ("cpu"), and reach an `ExpertCache` of `max_expert_memory` bytes when
the router picks them.
"""

from __future__ import annotations

import os

import torch

from ..checkpoint import (
    HUB_KWARGS, CheckpointError, checkpoint_config, local_expert_view, reading, recover_interrupted_commit,
    resolve_checkpoint, validate_checkpoint, validate_files,
)
from ..configuration import MoEConfig
from ..layers.quantized import CONFIG_FIELD as QUANTIZATION_FIELD
from ..routing import moe_blocks
from .budget import expert_slots, format_size, parse_memory_size
from .cache import ExpertCache
from .experts import OffloadedExperts
from .policy import DEFAULT_POLICY
from .store import DiskExperts, ExpertLayout, HostExperts

MODES = ("disk", "cpu")
# from_pretrained arguments that would load or place weights another way.
_CONFLICTS = {
    "state_dict": "a state_dict",
    "gguf_file": "a GGUF file",
    "quantization_config": "quantization",
    "tp_plan": "tensor parallelism",
    "distributed_config": "tensor parallelism",
}


def load_offloaded(model_class, pretrained_model_name_or_path, *model_args, expert_parallel: bool = False, **kwargs):
    """Load a saved MoE model with its experts offloaded, as an instance of `model_class` (`MoEForCausalLM` or one
    of its specialised classes; `model_class._specialised_for` picks the one of the checkpoint's base). Takes
    `from_pretrained`'s arguments plus:

    Args:
        offload_experts: "disk" (CPU machines: experts read from their files when picked) or "cpu" (GPU machines:
            experts in pinned host memory, copied to a GPU cache on a side stream when picked).
        max_expert_memory: bytes of resident experts (int, or a string like "1GiB"); at least one layer's top-k
            experts.
        offload_policy: the cache's eviction policy: "next_use" (default), "lfu", "lfu_decay" or "lru" (policy.py).
        offload_prefetch: fetch the next layer's predicted experts while a layer computes. Default: on for a GPU
            cache, off for a CPU cache (measured: see `ExpertCache`).
        verify_checksums: as in `from_pretrained`: the non-expert files are hashed at load, and each expert tensor at
            its first read (`DiskExperts`; "cpu" reads them all at load); a file changed in place after the load is
            an error at its next read.
    Returns:
        The model, in eval mode; its cache is `hf_moe.offload.expert_cache(model)`.
    """
    mode = kwargs.pop("offload_experts", None)
    budget_arg = kwargs.pop("max_expert_memory", None)
    policy = kwargs.pop("offload_policy", DEFAULT_POLICY)
    prefetch = kwargs.pop("offload_prefetch", None)
    verify_checksums = kwargs.pop("verify_checksums", None)
    if mode not in MODES:
        raise ValueError(
            f"offload_experts must be 'disk' (experts read from their files; CPU machines) or 'cpu' (experts in host "
            f"memory, a cache on the GPU), got {mode!r}."
        )
    if expert_parallel:
        raise ValueError(
            "offload_experts and expert_parallel do not compose: expert parallelism spreads the experts over "
            "processes for training, offloading fetches them into one process's cache for inference. Choose one."
        )
    for name, what in _CONFLICTS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"offload_experts reads the experts from the checkpoint's files; it cannot load {what} "
                             f"({name}=...). Load without offload_experts.")
    device_map = kwargs.get("device_map")
    if mode == "disk" and device_map not in (None, "cpu", {"": "cpu"}, torch.device("cpu")):
        raise ValueError(
            f"offload_experts='disk' runs on the CPU, but device_map={device_map!r} asks for more. On a GPU use "
            "offload_experts='cpu' with device_map='cuda'."
        )
    if budget_arg is None:
        raise ValueError(
            "offload_experts needs max_expert_memory, the bytes the resident experts may take (e.g. '1GiB'); "
            "`hf-moe inspect DIR` shows the model's expert bytes."
        )
    budget = parse_memory_size(budget_arg)

    path = os.fspath(pretrained_model_name_or_path)
    hub = {k: kwargs.pop(k) for k in HUB_KWARGS if k in kwargs}  # a Hub id: its snapshot in the cache (hub.py)
    directory = os.path.join(resolve_checkpoint(path, **hub), hub.get("subfolder") or "")
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"offload_experts reads the per-expert files of a local directory, and {directory!r} is not one. "
            "Download the model first (`hf download REPO --local-dir DIR`)."
        )
    with reading(directory):  # what is validated, opened and loaded is one checkpoint: a save into it waits
        recover_interrupted_commit(directory)  # (before the config is read: a killed save may have hidden it)
        saved = checkpoint_config(directory)
        if getattr(saved, QUANTIZATION_FIELD, None) is None:
            validate_checkpoint(directory)
        else:  # int8 experts (hf_moe.quantize): DiskExperts checks their header entries below, transformers the rest
            if (getattr(saved, QUANTIZATION_FIELD) or {}).get("linears"):
                raise CheckpointError(
                    f"{directory} holds int8 linear layers besides its int8 experts (quantize_experts(..., "
                    "linears=True)), which offloading does not load: load it whole with hf_moe.load_quantized, or "
                    "save a model quantized with linears=False to offload its experts.")
            validate_files(directory)
        config = kwargs.pop("config", None)
        if not isinstance(config, MoEConfig):
            config = saved
        layout = ExpertLayout.from_config(config)
        disk = DiskExperts(directory, layout, verify_checksums)  # opens every expert file; checks every header entry
        # Fail on a bad budget before loading anything (the dtype is the checkpoint's unless `dtype` says otherwise).
        dtype = kwargs.get("dtype")
        check_dtype = dtype if isinstance(dtype, torch.dtype) else disk.dtype()
        expert_slots(budget, layout.expert_bytes(check_dtype), layout.top_k, layout.num_layers * layout.num_experts)

        model_class = model_class._specialised_for(directory, {"config": config})
        with local_expert_view(directory, 0, 0, verify_checksums) as view:  # the non-expert files only, hashed
            skeleton = _without_experts(model_class)
            model = skeleton.from_pretrained(view, *model_args, config=config, _validated=True, **kwargs)
        model.__class__ = model_class
        model.config.name_or_path = path
        blocks = moe_blocks(model)
        first = blocks[0].gate.weight
        # (the files stay open: a save that replaces the directory later does not change what the store reads)
        store = disk if mode == "disk" else HostExperts(disk, first.dtype, pin=first.device.type == "cuda")

    cache = ExpertCache(
        store, layout, budget, [b.gate for b in blocks], first.device, first.dtype, policy=policy, prefetch=prefetch
    )
    for layer, block in enumerate(blocks):
        block.experts.attach(cache, layer)
    return model.eval()


def expert_cache(model) -> ExpertCache:
    """The `ExpertCache` of a model loaded with `offload_experts` (its stats, policy, prefetch switch, trace)."""
    blocks = moe_blocks(model)
    cache = getattr(blocks[0].experts, "cache", None) if blocks else None
    if cache is None:
        raise ValueError("This model's experts are not offloaded: load it with offload_experts='disk' or 'cpu'.")
    return cache


def describe(model) -> str:
    """One line: the budget and what it holds."""
    cache = expert_cache(model)
    layout = cache.layout
    total = layout.num_layers * layout.num_experts
    return (
        f"experts offloaded from {cache.source}: cache of {cache.num_slots} of {total} experts "
        f"({format_size(cache.pool_bytes())} of {format_size(total * layout.expert_bytes(cache.dtype))}), "
        f"policy {cache.policy.name}, prefetch {'on' if cache.prefetch else 'off'}"
    )


_SKELETONS: dict[type, type] = {}


def _without_experts(model_class: type) -> type:
    """A subclass of `model_class` whose instances swap each `Experts` for an unattached `OffloadedExperts` as soon
    as they are built (on the meta device, inside transformers' from_pretrained). transformers then neither
    allocates nor expects expert weights. Used only while loading: the model gets `model_class` back after."""
    if model_class not in _SKELETONS:

        def __init__(self, config, *args, **kwargs):
            model_class.__init__(self, config, *args, **kwargs)
            for block in moe_blocks(self):
                block.experts = OffloadedExperts(config)

        _SKELETONS[model_class] = type(
            model_class.__name__,
            (model_class,),
            {"__init__": __init__, "__module__": model_class.__module__, "__qualname__": model_class.__qualname__},
        )
    return _SKELETONS[model_class]
