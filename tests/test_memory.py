"""Activations saved for backward by one MoE block, against the dense MLP with the same active FLOPs."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from hf_moe import MoEConfig, SparseMoeBlock
from hf_moe.ops import use_backend
from hf_moe.profiling import saved_activation_bytes


@pytest.mark.parametrize("backend", ["compiled", "torch"])
@pytest.mark.parametrize("num_experts,top_k,inter", [(8, 2, 1024), (64, 8, 256)])
def test_saved_activations_within_1_1x_of_dense(num_experts, top_k, inter, backend):
    hidden, tokens = 512, 512
    base = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1, num_attention_heads=8)
    block = SparseMoeBlock(MoEConfig.from_base(base, num_experts=num_experts, num_experts_per_tok=top_k))
    dense = LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=top_k * inter))
    x = torch.randn(1, tokens, hidden, requires_grad=True)
    with use_backend(backend):
        moe_bytes = saved_activation_bytes(block, x)
    dense_bytes = saved_activation_bytes(dense, x)
    assert moe_bytes <= 1.1 * dense_bytes, (moe_bytes, dense_bytes)
    # No [tokens, experts]-sized masks beyond the router's own logits/probabilities: everything else the block
    # keeps scales with tokens x (hidden + 2 x top_k x intermediate).
    assert moe_bytes < 4 * tokens * (hidden + 2 * top_k * inter + 4 * num_experts) + 64 * tokens * top_k
