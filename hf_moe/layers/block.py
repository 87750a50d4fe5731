"""The MoE block: a drop-in replacement for a dense MLP."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from .adapter_experts import AdapterExperts
from .experts import Experts
from .router import build_router


class SharedExperts(nn.Module):
    """Always-active experts (Qwen-MoE, DeepSeek-MoE) as one dense MLP, with transformers' projection names.

    GLU: down_proj(act(gate_proj(x)) * up_proj(x)); plain: down_proj(act(up_proj(x))). Intermediate size
    num_shared_experts * shared_expert_intermediate_size.
    Forward: [N, H] -> [N, H]
    """

    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        inter = config.num_shared_experts * config.shared_expert_intermediate_size
        bias = config.expert_bias
        self.glu = config.expert_glu
        if self.glu:
            self.gate_proj = nn.Linear(h, inter, bias=bias)
        self.up_proj = nn.Linear(h, inter, bias=bias)
        self.down_proj = nn.Linear(inter, h, bias=bias)
        self.act_fn = ACT2FN[config.expert_hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act_fn(self.gate_proj(x)) * self.up_proj(x) if self.glu else self.act_fn(self.up_proj(x))
        return self.down_proj(h)


class SparseMoeBlock(nn.Module):
    """Router + experts. `block(hidden_states)` has the shape of `mlp(hidden_states)`.

    Submodules are named as in transformers' MoE models: `gate` (the router, see `router.py`), `experts`, and
    `shared_experts` when `num_shared_experts` > 0 (their output is added to the routed experts'), scaled by
    sigmoid(`shared_expert_gate`(x)) when `config.shared_expert_gate` (Qwen2-MoE's gated shared expert).
    The router's decision is not returned (the block is a drop-in for an MLP): the block hands it to
    `router_recorder`, the model's `hf_moe.routing.RouterRecorder`, which keeps it while the model records (for
    the losses, the statistics and `output_router_logits`). A block outside a model has none and records nothing.

    Forward:
        hidden_states [..., H] -> [..., H]

    `expert_range` (start, end) builds only experts [start, end) (see `Experts`).
    """

    def __init__(self, config, expert_range: tuple[int, int] | None = None):
        super().__init__()
        self.gate = build_router(config)
        # (adapter experts: a frozen MLP shared by all plus per-expert adapters, layers/adapter_experts.py)
        experts_class = AdapterExperts if getattr(config, "adapter_experts", None) else Experts
        self.experts = experts_class(config, expert_range)
        self.shared_experts = SharedExperts(config) if config.num_shared_experts else None
        gated = self.shared_experts is not None and getattr(config, "shared_expert_gate", False)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if gated else None  # [1, H]
        self.bias = nn.Parameter(torch.zeros(config.hidden_size)) if config.moe_output_bias else None
        self.dropout = nn.Dropout(config.moe_output_dropout) if config.moe_output_dropout else None
        self.router_recorder = None  # set by the model that installs the block (a plain attribute, not a module)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])  # [N, H]
        routing = self.gate(flat)
        if self.router_recorder is not None:
            self.router_recorder.record(routing)
        if routing.is_expert_choice:
            out = self.experts.expert_choice(flat, routing.expert_index, routing.expert_weights)
        else:
            out = self.experts(flat, routing.dispatch_index(), routing.top_k_weights)
        if self.shared_experts is not None:
            shared = self.shared_experts(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        if self.bias is not None:
            out = out + self.bias
        out = out.view(shape)
        return self.dropout(out) if self.dropout is not None else out
