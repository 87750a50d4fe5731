"""`OffloadedExperts`: an MoE layer's experts computed from the expert cache instead of resident weights."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from .cache import compute


class OffloadedExperts(nn.Module):
    """Takes the place of `Experts` in a model loaded with `offload_experts=...`. Holds no [E, ...] weights: the
    experts its tokens pick are made resident in the shared `ExpertCache`, then computed there by the same
    `hf_moe.ops.experts_forward` as `Experts`, so the result is the fully loaded model's.

    Forward:
        hidden_states [N, H], top_k_index [N, k], top_k_weights [N, k] -> [N, H]

    Inference only: the cache's slots are overwritten as other layers run, so there are no weights to train.
    Not compilable (`supports_compile`): which experts to read is decided on the host, between the router and the
    experts, so `hf_moe.generation` leaves a model holding these to eager decoding.
    """

    supports_compile = False

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = config.moe_intermediate_size
        self.has_gate = config.expert_glu
        self.has_bias = config.expert_bias
        self.is_transposed = False
        self.activation = config.expert_hidden_act
        self.act_fn = ACT2FN[config.expert_hidden_act]
        self.cache = None  # the model's ExpertCache (a plain attribute, shared by every layer), set by `attach`
        self.layer = None  # this layer's position among the MoE layers
        self.register_state_dict_post_hook(_refuse_state_dict)

    def attach(self, cache, layer: int) -> None:
        self.cache, self.layer = cache, layer

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.cache is None:
            raise RuntimeError("These offloaded experts belong to no expert cache: load the model with "
                               "MoEForCausalLM.from_pretrained(path, offload_experts=..., max_expert_memory=...).")
        if torch.is_grad_enabled() and hidden_states.requires_grad:
            raise RuntimeError(
                "A model loaded with offload_experts is for inference: its experts are fetched into a cache and "
                "overwritten, so nothing can be trained through them. Run it under torch.no_grad() (generate does), "
                "or load it without offload_experts to train."
            )
        cache = self.cache
        cache.follow(hidden_states)
        # Host sync (on a GPU): which experts to read is decided on the host; offloading cannot avoid it.
        experts = top_k_index[top_k_index >= 0].unique().tolist()
        passes = cache.begin(self.layer, experts)
        out = None
        ahead = cache.predict(self.layer + 1, hidden_states) if passes else None
        for i, chunk in enumerate(passes):
            # Several passes mean the cache is too small for this layer alone: fetch nothing ahead then.
            remap = cache.acquire(self.layer, chunk, ahead if len(passes) == 1 else None)
            try:
                slot_index = torch.where(top_k_index >= 0, remap[top_k_index.clamp_min(0)], -1)
                part = compute(cache.pool_experts, hidden_states, slot_index, top_k_weights)
            finally:
                cache.release()
            # Each (token, slot) pair is computed in exactly one pass, the others adding zero: with k <= 2, fp32
            # sums equal the single pass's bit for bit.
            out = part if out is None else out + part
        return out if out is not None else torch.zeros_like(hidden_states)

    def expert_choice(self, hidden_states, expert_index, expert_weights):
        raise NotImplementedError(
            "Expert-choice routing runs in training only, and a model with offloaded experts is for inference: "
            "call model.eval(), or load it without offload_experts to train."
        )

    def extra_repr(self) -> str:
        kind = "glu" if self.has_gate else "mlp"
        return (
            f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, intermediate_dim={self.intermediate_dim}, "
            f"{kind}, bias={self.has_bias}, offloaded (layer {self.layer} of {self.cache!r})"
        )


def _refuse_state_dict(module, state_dict, prefix, local_metadata):
    if module.cache is not None:
        raise RuntimeError(
            "This model was loaded with offload_experts: its experts are not in memory, so its state dict (and a "
            f"save) would lack them. Load it without offload_experts to save it, or copy {module.cache.source!r}."
        )
