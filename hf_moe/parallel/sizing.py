"""Memory per process of an expert-parallel x FSDP2 layout, computed (for `hf-moe plan`) and measured.

The computation takes the model built on the meta device (no memory) and applies `hf_moe.parallelize`'s placement to
every parameter's shape, rank by rank, exactly as FSDP2 chunks it (torch.chunk along dim 0):

    expert parameter [E, ...]     block of E / ep experts on "ep", chunked over "dp" (on dim 0 or 1: shard.py)
    other parameter  [n, ...]     chunked over "ep", replicated along "dp" (hybrid sharding)

Per parameter element it counts: weights and gradients in `dtype`; AdamW's exp_avg and exp_avg_sq in
`optimizer_dtype`, an fp32 master copy when `dtype` is not fp32 (mixed precision), and AdamW's scalar `step` per
parameter tensor. Activations are a rough estimate (see `activation_bytes`); the all-to-all bytes follow
dispatch.py's count. `measured_bytes` reads the same quantities off a live model and optimizer, so a test can
hold the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ADAM_STEP_BYTES = 4  # torch.optim.AdamW keeps `step` as an fp32 scalar tensor per parameter


@dataclass(frozen=True)
class Layout:
    """ep processes per expert-parallel group, dp groups (ep * dp processes)."""

    ep: int
    dp: int

    @property
    def world(self) -> int:
        return self.ep * self.dp


@dataclass
class Estimate:
    layout: Layout
    by_rank: list[dict[str, int]]  # weights, gradients, optimizer bytes of each rank, in mesh order (d * ep + p)
    activations: int  # rough, per rank, for one micro-batch without activation checkpointing
    gathered: int  # the largest FSDP2 unit gathered for compute: its weights and, in backward, its gradients
    all_to_all_per_step: int  # bytes each rank sends and receives per optimizer step (forward and backward)
    experts_per_rank: float  # the largest rank's share of experts (a fraction when they are sliced on dim 1)

    @property
    def per_rank(self) -> dict[str, int]:
        """The largest rank's bytes of each kind (ranks differ by FSDP2's uneven chunks)."""
        return {k: max(r[k] for r in self.by_rank) for k in self.by_rank[0]}

    @property
    def total(self) -> int:
        return max(sum(r.values()) for r in self.by_rank) + self.activations + self.gathered


def _chunks(n: int, parts: int) -> list[int]:
    """Dim-0 sizes of torch.chunk(tensor of n rows, parts), padded with empty chunks to `parts` (FSDP2's split)."""
    size = -(-n // parts) if n else 0
    return [max(0, min(size, n - i * size)) for i in range(parts)]


def estimate(
    model: torch.nn.Module,
    layout: Layout,
    *,
    dtype: torch.dtype = torch.bfloat16,
    optimizer_dtype: torch.dtype = torch.float32,
    micro_batch: int = 1,
    seq_len: int = 2048,
    gradient_accumulation_steps: int = 1,
) -> Estimate:
    """Bytes per rank of the MoE model `model` under `layout` (see the module docstring). Only its parameters' shapes
    and its config are read: build it whole (every expert) on the meta device, `with torch.device("meta"):
    MoEForCausalLM(config)`, which takes no memory."""
    from ..layers import Experts
    from .shard import expert_shard_dim

    config = model.config
    e = config.num_experts
    if e % layout.ep:
        raise ValueError(f"num_experts={e} does not divide by the expert-parallel size {layout.ep}.")
    block = e // layout.ep
    elt = torch.empty((), dtype=dtype).element_size()
    opt_elt = torch.empty((), dtype=optimizer_dtype).element_size()
    master = 0 if dtype == torch.float32 else 4
    numel = [0] * layout.world
    tensors = [0] * layout.world
    expert_ids = {id(p) for m in model.modules() if isinstance(m, Experts) for p in m.parameters(recurse=False)}
    for param in model.parameters():
        rest = param[0].numel() if param.dim() else 1
        rows = param.shape[0] if param.dim() else 1
        for d in range(layout.dp):
            for p in range(layout.ep):
                if id(param) not in expert_ids:
                    local = _chunks(rows, layout.ep)[p] * rest
                elif expert_shard_dim(block, layout.dp, param.shape) == 0:
                    local = _chunks(block, layout.dp)[d] * rest
                else:
                    local = block * rest // layout.dp
                numel[d * layout.ep + p] += local
                tensors[d * layout.ep + p] += 1
    sliced = any(expert_shard_dim(block, layout.dp, p.shape) for p in model.parameters() if id(p) in expert_ids)
    by_rank = [
        {"weights": n * elt, "gradients": n * elt, "optimizer": n * (2 * opt_elt + master) + t * ADAM_STEP_BYTES}
        for n, t in zip(numel, tensors)
    ]
    tokens = micro_batch * seq_len
    moe_layers = len(config.moe_layers)
    k, h = config.num_experts_per_tok, config.hidden_size
    all_to_all = 2 * 2 * tokens * k * h * elt * (layout.ep - 1) // layout.ep * moe_layers * gradient_accumulation_steps
    return Estimate(
        layout=layout,
        by_rank=by_rank,
        activations=activation_bytes(config, tokens, elt),
        gathered=gathered_bytes(model, config, layout, elt),
        all_to_all_per_step=all_to_all,
        experts_per_rank=block / layout.dp if sliced else _chunks(block, layout.dp)[0],
    )


def gathered_bytes(model, config, layout: Layout, elt: int) -> int:
    """The parameters FSDP2 holds gathered for compute, and their unsharded gradients in the backward, in `dtype`:
    the root unit (embeddings, final norm, LM head: gathered for the whole step) plus the largest decoder layer
    (its other parameters whole, its experts' block of E / ep)."""
    from ..layers import Experts

    layers = model.get_submodule(config.decoder_layers_path)
    in_layers = {id(p) for p in layers.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_layers)
    largest = 0
    for layer in layers:
        n = 0
        for module in layer.modules():
            for param in module.parameters(recurse=False):
                n += param.numel() // layout.ep if isinstance(module, Experts) else param.numel()
        largest = max(largest, n)
    return 2 * (root + largest) * elt


def activation_bytes(config, tokens: int, elt: int) -> int:
    """A rough count of the activations kept for backward, one micro-batch of `tokens`, no checkpointing.

    Per token and decoder layer: attention about 6 H + 2 kv values (norm, q, k, v, scores' output, o_proj input;
    memory-efficient attention keeps no T x T scores), a dense MLP 3 I, an MoE block H + 2 E (fp32 logits) +
    k (H + 2 I) (hf_moe's experts keep x and h per slot). Plus the fp32 logits of the LM head. Expect +-30%.
    """
    text = config.get_text_config()
    h = config.hidden_size
    heads = getattr(text, "num_attention_heads", 1)
    kv = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or h // heads
    layers = text.num_hidden_layers
    attention = 6 * h + 2 * kv * head_dim
    dense_i = getattr(text, "intermediate_size", None) or 4 * h
    moe = h + 2 * config.num_experts + config.num_experts_per_tok * (h + 2 * config.moe_intermediate_size)
    moe_layers = len(config.moe_layers)
    per_token = layers * attention * elt + moe_layers * moe * elt + (layers - moe_layers) * 3 * dense_i * elt
    return tokens * (per_token + 4 * text.vocab_size)


def candidate_layouts(num_experts: int, gpus: int, gpus_per_node: int) -> list[Layout]:
    """Every (ep, dp) with ep dividing both num_experts and gpus, expert parallelism inside a node first."""
    layouts = [Layout(ep, gpus // ep) for ep in range(1, gpus + 1) if gpus % ep == 0 and num_experts % ep == 0]
    return sorted(layouts, key=lambda l: (l.ep > gpus_per_node, -l.ep))


def _local_bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def measured_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """The bytes this process holds of weights, gradients and optimizer state (local shards of DTensors)."""
    out = {
        "weights": sum(_local_bytes(p) for p in model.parameters()),
        "gradients": sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None),
    }
    if optimizer is not None:
        out["optimizer"] = sum(
            _local_bytes(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)
        )
    return out
