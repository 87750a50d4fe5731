"""Adapter experts in a conversion: the options of `convert_to_moe(method="lora" | "pesc")`, their record in the
config, and the memory they add.

The layer is `hf_moe.layers.adapter_experts.AdapterExperts`; the block built on a dense MLP, the base frozen, and
loading a saved adapter-expert checkpoint onto its base are `hf_moe.checkpoint.adapter_experts`'s.
"""

from __future__ import annotations

from typing import Any

import torch

from ..dense_mlp import DenseMLP
from ..layers.adapter_experts import ADAPTER_METHODS, LORA_TARGETS, adapter_shapes, check_adapter_spec
from .estimate import ConversionSize, format_bytes

# convert_to_moe options of the adapter methods, with their defaults (PEFT's names).
ADAPTER_OPTIONS: dict[str, Any] = {
    "rank": 16,  # r: the adapters' rank (lora) or bottleneck width (pesc); `r` is accepted as its PEFT name
    "lora_alpha": None,  # scaling = lora_alpha / rank; default 2 * rank (MixLoRA's ratio)
    "target_modules": None,  # lora: which of gate_proj, up_proj, down_proj get adapters (default: all the MLP has)
    "lora_dropout": 0.0,  # dropout on the adapters' input (training only)
    "adapter_act": "gelu",  # pesc: the bottleneck's activation (Camelidae's)
}
METHOD_OPTION_NAMES = {
    "lora": ("rank", "r", "lora_alpha", "target_modules", "lora_dropout"),
    "pesc": ("rank", "r", "lora_alpha", "lora_dropout", "adapter_act"),
}


def adapter_spec(method: str, opts: dict, glu: bool) -> dict:
    """The config's `adapter_experts` record for a conversion (without `base_model`, added once the model exists)."""
    rank = opts.get("r") if opts.get("r") is not None else opts["rank"]
    if not (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1):
        raise ValueError(f"rank must be a positive int, got {rank!r}.")
    alpha = opts["lora_alpha"] if opts["lora_alpha"] is not None else 2 * rank
    spec = {"method": method, "r": rank, "lora_alpha": alpha, "lora_dropout": opts["lora_dropout"]}
    if method == "lora":
        targets = opts["target_modules"]
        if targets is None:
            targets = [t for t in LORA_TARGETS if glu or t != "gate_proj"]
        elif isinstance(targets, str):
            targets = [t.strip() for t in targets.split(",") if t.strip()]
        spec["target_modules"] = list(targets)
    else:
        spec["adapter_act"] = opts["adapter_act"]
    return spec


def adapter_size(spec: dict, mlp: DenseMLP, num_experts: int, num_layers: int) -> tuple[ConversionSize, str]:
    """(What the adapter experts of `spec` on MLPs like `mlp` add to the dense model, a hint naming the rank): for
    `estimate.check_memory`, before any adapter exists. Adapters are fp32 on a 16-bit MLP (`adapter_block`)."""
    itemsize = mlp.up.element_size()
    adapter_itemsize = 4 if mlp.up.dtype in (torch.float16, torch.bfloat16) else itemsize
    shapes = adapter_shapes(spec, mlp.hidden_size, mlp.intermediate_size)
    expert = sum(rows * cols for rows, cols in shapes.values()) * adapter_itemsize
    router = num_experts * mlp.hidden_size * itemsize
    added = num_layers * (num_experts * expert + router)
    hint = (f"The adapters of rank {spec['r']} take {format_bytes(expert)} per expert and layer: choose a smaller rank "
            "(rank=, `--rank`).")
    return ConversionSize(added, added, num_experts + 1, num_experts, num_layers, expert), hint


def check_adapter_options(method: str, options: dict, opts: dict) -> None:
    """For an adapter method: the rank is given once, its options are valid, and no option of the other methods
    conflicts with it. (Options of the adapter methods given to another method are `_check_method_options`'s.)"""
    if method in ADAPTER_METHODS:
        if "rank" in options and "r" in options:
            raise ValueError("Pass the rank once: `rank` or its PEFT name `r`, not both.")
        if opts["num_shared_experts"]:
            raise ValueError(f"method={method!r} makes every expert the whole frozen MLP plus an adapter: there is "
                             "nothing left to share (num_shared_experts must be 0).")
        check_adapter_spec(adapter_spec(method, opts, glu=True), glu=True, name="the options")
