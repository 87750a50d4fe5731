"""`materialize`: adapter experts -> an ordinary hf_moe MoE, expert e = W + s B_e A_e.

The result has plain `Experts` (fused [E, ...] weights), so everything downstream works on it: `save_pretrained` writes
a full per-expert checkpoint, `hf-moe export` writes Mixtral / Qwen-MoE, `hf_moe.quantize_experts` makes int8 experts,
offloading and merging read it. It computes what the adapter experts computed, to fp32 rounding (each W + s B A is
formed in fp32 and rounded once to the model's dtype).
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

from ..checkpoint import checkpoint_config
from ..checkpoint.adapter_experts import is_adapter_checkpoint, local_base
from ..checkpoint.commit import nested_directories
from ..layers import Experts
from ..layers.adapter_experts import AdapterExperts, adapter_blocks
from ..modeling import MoEForCausalLM, MoEPreTrainedModel
from .estimate import SKIP_VARIABLE, available_memory, format_bytes

PESC_WHY = (
    "PESC experts are the frozen MLP's output plus a bottleneck adapter with an activation inside, "
    "F(x) + U act(D F(x)): no expert of the Mixtral shape act(x W_gate) * x W_up -> W_down computes that, so they "
    "cannot become plain experts. A PESC model trains, saves and loads as it is; for native export, int8 or "
    "offloading, convert with method='lora'."
)


def materialize(model_or_path: MoEPreTrainedModel | str | os.PathLike, *, base=None, **kwargs) -> MoEPreTrainedModel:
    """Turn a model with LoRA adapter experts into an ordinary hf_moe MoE, in place (as PEFT's `merge_and_unload`):
    every MoE block's `AdapterExperts` becomes `Experts` with expert e's projections W + (lora_alpha / r) B_e A_e,
    the config loses `adapter_experts`, and every parameter trains again (as after `convert_to_moe`).

    Args:
        model_or_path: the model, or an adapter-expert checkpoint directory (loaded onto its base; `base` and
            `kwargs` go to `MoEForCausalLM.from_pretrained`).
    Returns:
        The model (the same object when one was passed).
    Raises:
        ValueError: the model has no adapter experts, or PESC ones (see `PESC_WHY`).
    """
    if isinstance(model_or_path, (str, os.PathLike)):
        model = MoEForCausalLM.from_pretrained(model_or_path, base=base, **kwargs)
    elif base is not None or kwargs:
        raise TypeError("base= and loading options apply to a checkpoint directory, not to a model in memory.")
    else:
        model = model_or_path
    config = model.config
    spec = getattr(config, "adapter_experts", None)
    if spec is None:
        raise ValueError(f"{type(model).__name__} has no adapter experts: it is an ordinary MoE already.")
    if spec["method"] != "lora":
        raise ValueError(f"Cannot materialize {spec['method']!r} adapter experts. {PESC_WHY}")
    plain = copy.copy(config)  # Experts reads only the shape fields, which materializing leaves as they are
    plain.adapter_experts = None
    _check_memory(adapter_blocks(model))
    for path, experts in adapter_blocks(model).items():
        model.get_submodule(path).experts = plain_experts(experts, plain)
    config.adapter_experts = None
    config.moe_conversion = {
        **(config.moe_conversion or {}),
        "materialized_from": {k: v for k, v in spec.items() if k != "base_model"},
    }
    for param in model.parameters():
        param.requires_grad_(True)
    return model


def check_output_directory(src: str | os.PathLike, out: str | os.PathLike, base=None) -> None:
    """Refuse (ValueError) an OUT for `hf-moe materialize SRC OUT` that is SRC or the base model SRC loads onto (`base`
    or the recorded one), lies inside either, or holds either: a save there would replace or write among files that
    a checkpoint needs. Called before anything is loaded."""
    src, out = os.fspath(src), os.fspath(out)
    needed = [("SRC", src)]
    if is_adapter_checkpoint(src):
        path = local_base(src, checkpoint_config(src), base)
        if path is not None:
            needed.append(("the base model", path))
    for what, path in needed:
        if nested_directories(out, path):
            raise ValueError(
                f"OUT {out} is, lies inside or holds {what} {path}, which the adapter checkpoint needs: materializing "
                "there would replace it or write into it. Nothing was written: choose another OUT."
            )


def _check_memory(blocks: dict[str, AdapterExperts]) -> None:
    """Refuse (ValueError, with the sizes) plain experts that would not fit in the memory available: E whole MLPs per
    layer, in the model's dtype, and one role's fp32 [E, out, in] while it is formed."""
    if not blocks or os.environ.get(SKIP_VARIABLE, "").strip().lower() in ("1", "true", "yes"):
        return
    first = next(iter(blocks.values()))
    mlp = first.dense_mlp
    itemsize, per_expert = mlp.up_proj.element_size(), sum(p.numel() for p in mlp.parameters())
    expert = per_expert * itemsize
    added = len(blocks) * first.num_experts * expert + first.num_experts * mlp.up_proj.numel() * 4
    available = available_memory()
    if available is not None and added > available:
        raise ValueError(
            f"Materializing would hold about {format_bytes(added)} more than the adapter model ({first.num_experts} "
            f"plain experts x {len(blocks)} MoE layer(s), {format_bytes(expert)} each), but {format_bytes(available)} "
            f"of memory is available. Materialize on a machine with more memory; or, if you know it fits, set "
            f"{SKIP_VARIABLE}=1."
        )


@torch.no_grad()
def plain_experts(experts: AdapterExperts, config) -> Experts:
    """The `Experts` computing what `experts` (LoRA) computes: [E, 2I, H] gate_up (or [E, I, H] up) and [E, H, I]
    down, each W + s B_e A_e, with the frozen MLP's biases in every expert."""
    base = experts.dense_mlp
    dtype, device = base.up_proj.dtype, base.up_proj.device
    with torch.device("meta"):
        out = Experts(config)

    def merged(role: str) -> torch.Tensor:  # [E, out, in]
        weight = getattr(base, f"{role}_proj").float()
        stacked = weight.unsqueeze(0).repeat(experts.num_experts, 1, 1)
        if f"{role}_proj" in experts.targets:
            a, b = getattr(experts, f"{role}_lora_A").float(), getattr(experts, f"{role}_lora_B").float()
            stacked.baddbmm_(b, a, alpha=experts.scaling)  # W + s B_e A_e, in fp32
        return stacked.to(dtype)

    def repeated(bias: torch.Tensor) -> torch.Tensor:  # [E, out]
        return bias.detach().unsqueeze(0).repeat(experts.num_experts, 1)

    if experts.has_gate:
        out.gate_up_proj = nn.Parameter(torch.cat([merged("gate"), merged("up")], dim=1))
    else:
        out.up_proj = nn.Parameter(merged("up"))
    out.down_proj = nn.Parameter(merged("down"))
    if experts.has_bias:
        if experts.has_gate:
            out.gate_up_proj_bias = nn.Parameter(repeated(torch.cat([base.gate_proj_bias, base.up_proj_bias])))
        else:
            out.up_proj_bias = nn.Parameter(repeated(base.up_proj_bias))
        out.down_proj_bias = nn.Parameter(repeated(base.down_proj_bias))
    return out.to(device)
