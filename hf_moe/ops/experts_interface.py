"""`experts_implementation="hf_moe"` for transformers' native MoE models (Mixtral, Qwen3-MoE, OLMoE, ...).

After `import hf_moe`:

    AutoModelForCausalLM.from_pretrained(path, experts_implementation="hf_moe")

runs the experts of a native model on hf_moe's dispatch ops (compiled when available). Layouts those ops do not
take (transposed or interleaved gate/up weights, custom gating, a norm after each expert, transformers' own
expert parallelism, an activation that is no ACT2FN one) are passed on to transformers' `grouped_mm`
implementation, which handles them. The choice depends only on the module's attributes, so a model takes the
same path eagerly, under `torch.compile` and under `torch.export`, from the first call.

A model whose experts do not dispatch through the ExpertsInterface at all (JetMoe, Llama-4 text, ...) accepts any
registered name, "hf_moe" included, and never calls it: transformers checks only "grouped_mm" (with
`_can_set_experts_implementation`). hf_moe cannot see such a model being built without a process-wide hook on
every module, which it does not install (`import hf_moe` changes nothing outside hf_moe but public registries).
`check_experts_implementation(model)` applies transformers' test and refuses, naming the class.
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
from .backend import experts_forward
from .activations import activation_key

NAME = "hf_moe"


def _supported(experts: torch.nn.Module) -> bool:
    return (
        not getattr(experts, "is_transposed", False)
        and getattr(experts, "is_concatenated", True)
        and not getattr(experts, "has_post_expert_norm", False)
        and not getattr(experts, "_is_expert_parallel", False)
        and getattr(type(experts), "_apply_gate", default_apply_gate) is default_apply_gate
        and (
            getattr(experts, "activation", None) is not None
            or activation_key(getattr(experts, "act_fn", None)) is not None
        )
    )


def hf_moe_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts signature: hidden_states [N, H], top_k_index [N, k], top_k_weights [N, k] -> [N, H]."""
    if not _supported(self):
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return experts_forward(self, hidden_states, top_k_index, top_k_weights)


def check_experts_implementation(model: torch.nn.Module) -> None:
    """Raise `ValueError` if `model` was asked for `experts_implementation="hf_moe"` but its experts do not
    dispatch through transformers' ExpertsInterface (JetMoe, Llama-4 text), so hf_moe would never run. hf_moe's own
    models (model_type "hf_moe") always run hf_moe's experts."""
    config = getattr(model, "config", None)
    if getattr(config, "_experts_implementation", None) != NAME or getattr(config, "model_type", None) == NAME:
        return
    if isinstance(model, PreTrainedModel) and not can_set_experts_implementation(type(model)):
        raise ValueError(
            f'{type(model).__name__} does not support experts_implementation="{NAME}": its experts do not '
            "dispatch through transformers' ExpertsInterface (no @use_experts_implementation), so hf_moe would "
            'never run while its config says "hf_moe". Load it without experts_implementation (its own experts '
            'run), as transformers requires for "grouped_mm" too.'
        )


def register() -> None:
    """Register "hf_moe" in transformers' ExpertsInterface."""
    ALL_EXPERTS_FUNCTIONS.register(NAME, hf_moe_experts_forward)
