"""The experts of one MoE layer, as fused 3-D weights in transformers 5.x's layout."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from ..compat import init
from ..ops import expert_weights as ops_expert_weights
from ..ops import experts_forward, reference


class Experts(nn.Module):
    """E expert MLPs stored as stacked weights, never as a ModuleList of Linear layers.

    Parameters (E experts, H hidden, I intermediate):
        GLU:      gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]
        plain:    up_proj [E, I, H], down_proj [E, H, I]
        biases:   gate_up_proj_bias [E, 2I] or up_proj_bias [E, I], and down_proj_bias [E, H], when `expert_bias`
    Forward:
        hidden_states [N, H], top_k_index [N, k], top_k_weights [N, k] -> [N, H]

    The attribute names (`has_gate`, `has_bias`, `is_transposed`, `act_fn`) match transformers' experts
    modules, so the same dispatch code (`hf_moe.ops.experts_forward`) runs on both.

    Args:
        expert_range: (start, end): hold only experts [start, end) of `num_experts` (the block of one process under
            expert parallelism, built that way so the others are never allocated). `hf_moe.parallel` then makes
            the module exchange tokens with the processes that hold the others (`ep_plan`).
    """

    def __init__(self, config, expert_range: tuple[int, int] | None = None):
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        start, end = expert_range if expert_range is not None else (0, e)
        if not 0 <= start < end <= e:
            raise ValueError(f"expert_range {expert_range} is not a non-empty range of the {e} experts.")
        self.num_experts = e
        self.num_local_experts, self.expert_offset = end - start, start
        self.ep_plan = None  # set by hf_moe.parallel when the experts are sharded over processes
        e = end - start  # the experts this module allocates
        self.hidden_dim = h
        self.intermediate_dim = i
        self.has_gate = config.expert_glu
        self.has_bias = config.expert_bias
        self.is_transposed = False
        self.activation = config.expert_hidden_act  # ACT2FN key
        self.act_fn = ACT2FN[config.expert_hidden_act]
        up_rows = 2 * i if self.has_gate else i
        up_name = "gate_up_proj" if self.has_gate else "up_proj"
        self.register_parameter(up_name, nn.Parameter(torch.empty(e, up_rows, h)))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        if self.has_bias:
            self.register_parameter(f"{up_name}_bias", nn.Parameter(torch.empty(e, up_rows)))
            self.down_proj_bias = nn.Parameter(torch.empty(e, h))
        else:
            self.register_parameter(f"{up_name}_bias", None)
            self.down_proj_bias = None
        self.init_std = config.moe_init_std
        self.reset_parameters()
        self.register_load_state_dict_pre_hook(_load_per_expert_keys)

    def reset_parameters(self) -> None:
        """Weights from N(0, init_std), biases zero (for experts built from scratch, not upcycled)."""
        for name, param in self.named_parameters(recurse=False):
            if name.endswith("_bias"):
                init.zeros_(param)
            else:
                init.normal_(param, mean=0.0, std=self.init_std)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return experts_forward(self, hidden_states, top_k_index, top_k_weights)

    def expert_choice(
        self, hidden_states: torch.Tensor, expert_index: torch.Tensor, expert_weights: torch.Tensor
    ) -> torch.Tensor:
        """Expert-choice routing: every expert computes the same number C of tokens, so one batched matmul runs
        them all.

        Args:
            hidden_states: [N, H]; expert_index: [E, C] token ids; expert_weights: [E, C].
        Returns:
            [N, H]: for each token, the weighted sum of the outputs of the experts that took it (zero if none).
        """
        return batched_expert_choice(hidden_states, expert_index, expert_weights, *ops_expert_weights(self),
                                     self.activation, self.has_gate)

    def extra_repr(self) -> str:
        kind = "glu" if self.has_gate else "mlp"
        local = ""
        if self.num_local_experts != self.num_experts:
            local = f", local experts {self.expert_offset}..{self.expert_offset + self.num_local_experts - 1}"
        return (
            f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, intermediate_dim={self.intermediate_dim}, "
            f"{kind}, bias={self.has_bias}{local}"
        )


def _load_per_expert_keys(module, state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs):
    """Let `load_state_dict` take the on-disk layout, where expert e of `gate_up_proj` is `{prefix}{e}.gate_up_proj`.

    A complete set of experts is stacked into the fused key. A partial set (one shard file of a per-expert
    checkpoint, as `transformers.Trainer` loads them one at a time) is copied into its slices in place.
    """
    offset, local = module.expert_offset, module.num_local_experts
    for name, param in module.named_parameters(recurse=False):
        per_expert = {}
        for e in range(module.num_experts):
            key = f"{prefix}{e}.{name}"
            if key in state_dict:
                tensor = state_dict.pop(key)
                if offset <= e < offset + local:  # experts of other ranks (expert parallelism) are not ours
                    per_expert[e - offset] = tensor
        if not per_expert:
            continue
        if len(per_expert) == local and prefix + name not in state_dict:
            state_dict[prefix + name] = torch.stack([per_expert[e] for e in range(local)])
            continue
        for e, tensor in per_expert.items():
            if tensor.shape != param.shape[1:]:
                error_msgs.append(
                    f"size mismatch for {prefix}{e + offset}.{name}: copying a param with shape {tuple(tensor.shape)}, "
                    f"the expert's slice has shape {tuple(param.shape[1:])}."
                )
                continue
            with torch.no_grad():
                param[e].copy_(tensor)


def batched_expert_choice(
    hidden_states: torch.Tensor,
    expert_index: torch.Tensor,
    expert_weights: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    activation: str,
    glu: bool,
) -> torch.Tensor:
    """Expert-choice routing with one batched matmul per projection (every expert takes C tokens).

    Args:
        hidden_states: [N, H]; expert_index: [E, C] token ids; expert_weights: [E, C]; w1 [E, W, H], b1 [E, W],
        w2 [E, H, I], b2 [E, H].
    Returns:
        [N, H]: for each token, the weighted sum of the outputs of the experts that took it (zero if none).
    """
    e, c = expert_index.shape
    x = hidden_states.index_select(0, expert_index.reshape(-1)).view(e, c, -1)  # [E, C, H]
    h = torch.bmm(x, w1.transpose(1, 2))  # [E, C, W]
    if b1 is not None:
        h = h + b1.unsqueeze(1)
    a = reference.expert_act(h.reshape(e * c, -1), None, activation, glu).view(e, c, -1)
    y = torch.bmm(a, w2.transpose(1, 2))  # [E, C, H]
    if b2 is not None:
        y = y + b2.unsqueeze(1)
    y = y * expert_weights.to(y.dtype).unsqueeze(-1)
    out = hidden_states.new_zeros(hidden_states.shape)
    return out.index_add(0, expert_index.reshape(-1), y.reshape(e * c, -1))
