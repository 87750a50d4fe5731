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

from ..layers import Experts
from ..layers.adapter_experts import AdapterExperts, adapter_blocks
from ..modeling import MoEForCausalLM, MoEPreTrainedModel

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
