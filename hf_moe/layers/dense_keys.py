"""A warning for weights that address the dense MLPs an MoE model no longer has.

An MoE block takes the place of a dense MLP (`mlp.gate_proj`, `mlp.up_proj`, `mlp.down_proj` become `mlp.gate`,
`mlp.experts`), and in families whose MLP is written inline in the decoder layer the bypassed projections become
`nn.Identity`. A state dict that still addresses those modules loads into nothing: `load_state_dict(strict=False)`
merely lists the keys as unexpected, and PEFT, which loads adapters that way, drops a dense LoRA's MLP part without
a word. `warn_on_replaced_mlp_keys` is a `load_state_dict` pre-hook for an MoE model's backbone that names them.
"""

from __future__ import annotations

import re
import warnings

from torch import nn

from .block import SparseMoeBlock


def replaced_mlp_modules(module: nn.Module, keys, prefix: str = "") -> list[str]:
    """The module names (with `prefix`) that `keys` address inside an MoE block or a bypassed (`nn.Identity`)
    projection of `module`, where no such submodule, parameter or buffer exists. Sorted, each once."""
    found = set()
    for key in keys:
        if not key.startswith(prefix):
            continue
        parts = key[len(prefix):].split(".")
        owner = module
        for depth, part in enumerate(parts[:-1]):
            child = owner._modules.get(part)
            if child is not None:
                owner = child
                continue
            if isinstance(owner, (SparseMoeBlock, nn.Identity)) and part not in owner._parameters and (
                part not in owner._buffers
            ):
                found.add(prefix + ".".join(parts[: depth + 1]))
            break
    return sorted(found, key=_natural)


def warn_on_replaced_mlp_keys(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
    """`nn.Module.register_load_state_dict_pre_hook` hook of an MoE model's backbone: warns, naming them, when the
    state dict being loaded addresses dense MLP modules that MoE blocks replaced (their weights are not loaded)."""
    names = replaced_mlp_modules(module, state_dict.keys(), prefix)
    if not names:
        return
    warnings.warn(
        f"{len(names)} modules in the weights being loaded are dense MLP modules that this hf_moe model replaced "
        f"with MoE blocks, so their weights are NOT loaded: {compact_names(names)}. If these are a LoRA adapter "
        "trained on the dense model, load it with `hf_moe.convert_adapter(adapter_dir, moe_model)`, which applies "
        "it to every expert exactly, instead of `PeftModel.from_pretrained`.",
        UserWarning,
        stacklevel=2,
    )


def compact_names(names: list[str]) -> str:
    """Module names with their first number folded into ranges: `m.layers.[0-2].mlp.gate_proj`."""
    groups: dict[str, list[int]] = {}
    for name in names:
        match = re.search(r"(?<=\.)\d+(?=\.)", name)
        if match is None:
            groups.setdefault(name, [])
            continue
        template = name[: match.start()] + "{}" + name[match.end():]
        groups.setdefault(template, []).append(int(match.group()))
    out = []
    for template, numbers in groups.items():
        out.append(template.format(f"[{_ranges(sorted(numbers))}]") if numbers else template)
    return ", ".join(out)


def _ranges(numbers: list[int]) -> str:
    spans, start = [], numbers[0]
    for previous, current in zip(numbers, numbers[1:] + [None]):
        if current != previous + 1:
            spans.append(str(start) if start == previous else f"{start}-{previous}")
            start = current
    return ",".join(spans)


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in name.split(".")]
