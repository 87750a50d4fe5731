"""`experts_implementation="hf_moe"` for transformers' native MoE models (Mixtral, Qwen3-MoE, OLMoE, ...).

After `import hf_moe`:

    AutoModelForCausalLM.from_pretrained(path, experts_implementation="hf_moe")

runs the experts of a native model on hf_moe's dispatch ops (compiled when available). Layouts those ops do not
take (transposed or interleaved gate/up weights, custom gating, a norm after each expert, transformers' own
expert parallelism) are passed on to transformers' `grouped_mm` implementation, which handles them.
"""

from __future__ import annotations

import torch

from ..compat import ALL_EXPERTS_FUNCTIONS, default_apply_gate, grouped_mm_experts_forward
from . import experts_forward

NAME = "hf_moe"


def _supported(experts: torch.nn.Module) -> bool:
    return (
        not getattr(experts, "is_transposed", False)
        and getattr(experts, "is_concatenated", True)
        and not getattr(experts, "has_post_expert_norm", False)
        and not getattr(experts, "_is_expert_parallel", False)
        and getattr(type(experts), "_apply_gate", default_apply_gate) is default_apply_gate
    )


def hf_moe_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts signature: hidden_states [N, H], top_k_index [N, k], top_k_weights [N, k] -> [N, H]."""
    if not _supported(self):
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return experts_forward(self, hidden_states, top_k_index, top_k_weights)


def register() -> None:
    ALL_EXPERTS_FUNCTIONS.register(NAME, hf_moe_experts_forward)
