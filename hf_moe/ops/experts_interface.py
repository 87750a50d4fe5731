"""`experts_implementation="hf_moe"` for transformers' native MoE models (Mixtral, Qwen3-MoE, OLMoE, ...).

After `import hf_moe`:

    AutoModelForCausalLM.from_pretrained(path, experts_implementation="hf_moe")

runs the experts of a native model on hf_moe's dispatch ops (compiled when available). Layouts those ops do not
take (transposed or interleaved gate/up weights, custom gating, a norm after each expert, transformers' own
expert parallelism, an activation that is no ACT2FN one) are passed on to transformers' `grouped_mm`
implementation, which handles them. The choice depends only on the module's attributes, so a model takes the
same path eagerly, under `torch.compile` and under `torch.export`, from the first call.

A model whose experts do not dispatch through the ExpertsInterface at all (JetMoe, Llama-4 text, ...) would
accept the name and never call hf_moe; it is refused when it is built instead, with the same test transformers
applies to `experts_implementation="grouped_mm"` (`_refuse_unsupported`).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..compat import (
    ALL_EXPERTS_FUNCTIONS,
    can_set_experts_implementation,
    default_apply_gate,
    grouped_mm_experts_forward,
)
from . import experts_forward
from .activations import activation_key

NAME = "hf_moe"


def _supported(experts: torch.nn.Module) -> bool:
    return (
        not getattr(experts, "is_transposed", False)
        and getattr(experts, "is_concatenated", True)
        and not getattr(experts, "has_post_expert_norm", False)
        and not getattr(experts, "_is_expert_parallel", False)
        and getattr(type(experts), "_apply_gate", default_apply_gate) is default_apply_gate
        and (getattr(experts, "activation", None) is not None or activation_key(getattr(experts, "act_fn", None)) is not None)
    )


def hf_moe_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts signature: hidden_states [N, H], top_k_index [N, k], top_k_weights [N, k] -> [N, H]."""
    if not _supported(self):
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return experts_forward(self, hidden_states, top_k_index, top_k_weights)


def _refuse_unsupported(module: torch.nn.Module, name: str, submodule: torch.nn.Module | None) -> None:
    """Module-registration hook (all modules): a transformers model built with `experts_implementation="hf_moe"`
    whose class does not dispatch its experts through the ExpertsInterface is refused at its first submodule.

    Only models whose config asks for "hf_moe" are checked (an isinstance and a dict read for all others).
    hf_moe's own models (model_type "hf_moe") always run hf_moe's experts, whatever the setting.
    """
    if not isinstance(module, PreTrainedModel):
        return None
    config = module.__dict__.get("config")
    if getattr(config, "_experts_implementation", None) != NAME or getattr(config, "model_type", None) == NAME:
        return None
    if not can_set_experts_implementation(type(module)):
        raise ValueError(
            f'{type(module).__name__} does not support experts_implementation="{NAME}": its experts do not '
            "dispatch through transformers' ExpertsInterface (no @use_experts_implementation), so hf_moe would "
            'never run while its config said "hf_moe". Build it without experts_implementation (its own experts '
            'run), as transformers requires for "grouped_mm" too.'
        )
    return None


_registration_hook = []  # the handle of `_refuse_unsupported`, once registered


def register() -> None:
    """Register "hf_moe" in transformers' ExpertsInterface, and the check that refuses models that ignore it."""
    ALL_EXPERTS_FUNCTIONS.register(NAME, hf_moe_experts_forward)
    if not _registration_hook:
        _registration_hook.append(torch.nn.modules.module.register_module_module_registration_hook(_refuse_unsupported))
