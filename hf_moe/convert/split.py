"""Neuron-split conversion (MoEfication, Zhang et al. 2022; LLaMA-MoE, Zhu et al. 2024): partition the dense
MLP's intermediate neurons into experts, instead of copying the MLP.

With E experts and S shared experts the I neurons are cut into E + S groups of I / (E + S). The S groups of the
most used neurons become the shared (always active) experts; the E others become the routed experts. The router
starts from the partition: expert e's row is the mean of its neurons' input weights, so its logit is the mean
pre-activation of those neurons. With every expert chosen (top_k == E) and unit weights
(`router_weights="unit"`), the block computes exactly the dense MLP.

Partitions:
    random        a random permutation
    kmeans        balanced k-means on the neurons' input weights (gate rows for gated MLPs)
    coactivation  balanced k-means on the neurons' activation profiles over calibration text: neurons that fire
                  together go to the same expert
"""

from __future__ import annotations

import torch

from ..dense_mlp import DenseMLP
from ..layers import SparseMoeBlock
from .assemble import assemble_block, neurons

PARTITIONS = ("random", "kmeans", "coactivation")


def balanced_kmeans(features: torch.Tensor, groups: int, iters: int = 15, generator=None) -> torch.Tensor:
    """Cluster the n rows of `features` [n, d] into `groups` clusters of exactly n / groups rows (cosine).

    Each iteration assigns rows greedily, the most decided first (largest gap between their best and worst
    centroid), each to its most similar centroid that still has room. Returns labels [n] (int64).
    """
    n = features.shape[0]
    if n % groups:
        raise ValueError(f"{n} neurons do not split into {groups} equal groups.")
    cap = n // groups
    x = torch.nn.functional.normalize(features.float(), dim=1)
    centroids = x[torch.randperm(n, generator=generator)[:groups]]
    labels = torch.empty(n, dtype=torch.int64)
    for _ in range(iters):
        sim = x @ centroids.t()  # [n, groups]
        order = (sim.max(1).values - sim.min(1).values).argsort(descending=True).tolist()
        prefs = sim.argsort(dim=1, descending=True).tolist()
        counts = [0] * groups
        new = torch.empty_like(labels)
        for i in order:
            for j in prefs[i]:
                if counts[j] < cap:
                    new[i] = j
                    counts[j] += 1
                    break
        if torch.equal(new, labels):
            break
        labels = new
        centroids = torch.nn.functional.normalize(
            torch.zeros(groups, x.shape[1]).index_add_(0, labels, x), dim=1
        )
    return labels


def hidden_activation(mlp: DenseMLP, x: torch.Tensor) -> torch.Tensor:
    """[T, H] -> [T, I]: what each intermediate neuron outputs before the down projection."""
    from transformers.activations import ACT2FN

    act = ACT2FN[mlp.act]
    up = torch.nn.functional.linear(x, mlp.up, mlp.up_bias)
    if mlp.glu:
        return act(torch.nn.functional.linear(x, mlp.gate, mlp.gate_bias)) * up
    return act(up)


def partition(
    mlp: DenseMLP,
    num_groups: int,
    method: str,
    activations: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> list[torch.Tensor]:
    """`num_groups` index tensors of equal size over the I neurons, ordered from most to least used.

    `activations` [T, I] (calibration) measure use for every method when given; otherwise use is the product of
    the neuron's input and output weight norms.
    """
    size = mlp.intermediate_size
    if size % num_groups:
        raise ValueError(
            f"The MLP's {size} intermediate neurons do not split into {num_groups} equal experts (num_experts + "
            "num_shared_experts); choose a number of experts that divides it."
        )
    if method == "random":
        labels = torch.randperm(size, generator=generator) % num_groups
    elif method == "kmeans":
        weights = mlp.gate if mlp.glu else mlp.up
        labels = balanced_kmeans(weights.detach().cpu(), num_groups, generator=generator)
    elif method == "coactivation":
        if activations is None:
            raise ValueError("partition='coactivation' needs calibration activations (calibration_data=...).")
        labels = balanced_kmeans(activations.abs().t().cpu(), num_groups, generator=generator)
    else:
        raise ValueError(f"Unknown partition {method!r}; choose one of {PARTITIONS}.")
    if activations is not None:
        use = activations.abs().float().mean(0).cpu()
    else:
        rows = mlp.gate if mlp.glu else mlp.up
        use = (rows.float().norm(dim=1) * mlp.down.float().norm(dim=0)).cpu()
    groups = [torch.nonzero(labels == g).squeeze(1) for g in range(num_groups)]
    groups.sort(key=lambda idx: -use[idx].sum().item())
    return [g.to(mlp.up.device) for g in groups]


def split_block(
    mlp: DenseMLP,
    config,
    method: str = "random",
    activations: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> SparseMoeBlock:
    """An MoE block made of a partition of `mlp`'s neurons (see the module docstring), on `mlp`'s device."""
    s = config.num_shared_experts
    groups = partition(mlp, config.num_experts + s, method, activations, generator)
    shared = neurons(mlp, torch.cat(groups[:s])) if s else None
    routed = groups[s:]
    experts = [neurons(mlp, idx) for idx in routed]
    rows = mlp.gate if mlp.glu else mlp.up
    router = torch.stack([rows.index_select(0, idx).float().mean(0) for idx in routed])  # [E, H] centroids
    return assemble_block(config, experts, router, shared=shared, down_bias=mlp.down_bias)


def calibration_text(path, tokenizer, max_tokens: int) -> torch.Tensor:
    """The first `max_tokens` tokens of a local .txt / .json / .jsonl file (a `text` field), as one row [1, T]: read
    and tokenized piece by piece until there are that many (`hf_moe.inputs.token_ids`; the rest is never read)."""
    import os

    from ..inputs import TEXT_KINDS, token_ids

    if not os.path.isfile(path):
        raise FileNotFoundError(f"calibration_data {path!r} is not a file.")
    if os.path.splitext(path)[1].lower() not in TEXT_KINDS:
        raise ValueError(f"calibration_data must be a .txt, .json or .jsonl file, got {path!r}.")
    if os.path.getsize(path) == 0:
        raise ValueError(f"calibration_data {path!r} is empty: give it text (a .txt file, or .json/.jsonl records "
                         "with a `text` field).")
    ids = token_ids(path, tokenizer, max_tokens, "calibration_data")
    if len(ids) < 16:
        raise ValueError(f"{path} gives only {len(ids)} tokens; calibration needs at least 16: give it more text.")
    return torch.tensor([ids])


@torch.no_grad()
def calibration_activations(model, blocks_at: dict[int, torch.nn.Module], mlps: dict[int, DenseMLP], input_ids):
    """{layer: [T, I]} neuron outputs of each dense MLP while the model reads `input_ids` [1, T].

    `blocks_at[i]` is the module of layer i whose input is the MLP's input (the MLP, or its first projection when
    the MLP is written inline in the layer).
    """
    out: dict[int, torch.Tensor] = {}

    def hook(layer):
        def record(module, args):
            x = args[0].reshape(-1, args[0].shape[-1])
            out[layer] = hidden_activation(mlps[layer], x.to(mlps[layer].up.dtype)).float().cpu()

        return record

    handles = [module.register_forward_pre_hook(hook(i)) for i, module in blocks_at.items()]
    was_training = model.training
    model.eval()
    try:
        model(input_ids=input_ids.to(model.device))
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return out
