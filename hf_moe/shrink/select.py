"""Which experts a layer keeps: random, frequency and reconstruction, per layer or one set for every layer.

    random          `keep` experts drawn uniformly (seeded): the baseline every method must beat.
    frequency       the `keep` experts routed the most (token, slot) pairs on the calibration text (ties: the
                    larger routing weight), the baseline of the literature.
    reconstruction  the subset whose block output is closest to the original model's at that layer on the
                    calibration text (after Lu et al. 2024): sum over tokens t of
                    || routed_S(x'_t) - routed(x_t) ||^2 / || routed(x_t) ||^2, where x' is the block's input in the
                    model shrunk so far and x the original model's (api.py carries both in one forward), and routed_S
                    routes with the router cut to the rows of S (top-k over S, renormalised as the model does)
                    exactly as the shrunk checkpoint will. Aiming at the original output lets a layer make up for
                    what the layers before it lost; each token's error counts relative to its own output, since a
                    few tokens with massive activations (a sequence's first) would otherwise weigh most of the sum.
                    On the BTX model of docs/shrinking.md the two together lowered the held-out loss at 4 of 8
                    experts more than either alone (the numbers are there). Every subset is tried when there are at
                    most ENUMERATION_LIMIT of them (all of them for 8 experts);
                    above, greedy backward elimination (drop the expert whose removal costs least, repeatedly).
    loss            reconstruction's `search_candidates` best subsets of each layer, one chosen by the model's own loss
                    on the calibration text (search.py): a coordinate search over the layers, after EEP's scoring by
                    the model's loss rather than by each layer's output. At 2 of 8 experts, the pair that reproduces
                    a layer best is often not the one that keeps the loss down (docs/shrinking.md).

Global scope (one set of expert ids for every layer: whole expert files drop out of an hf_moe checkpoint, and the
experts of a merge of fine-tunes are the same model in every layer) is chosen from the original model's statistics
over all layers: frequency sums the pairs, reconstruction minimises the sum over layers of the relative error, or,
when the subsets are too many to try, keeps the experts whose removal alone costs most, summed over layers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .layer import LayerData, combine, make_router, route, select_rows

ENUMERATION_LIMIT = 256  # subsets tried one by one; above, greedy elimination
TOKEN_FLOOR = 0.01  # a token's squared output norm counts as at least this share of the mean (see Reconstruction)


@dataclass
class Choice:
    """What one layer keeps: expert ids (sorted; the new expert i is old expert kept[i], or the merge of it and
    groups[kept[i]]), and the relative reconstruction error on the calibration text, where measured."""

    kept: list[int]
    groups: dict[int, list[int]] = field(default_factory=dict)
    error: float | None = None


def random_subset(num_experts: int, keep: int, generator: torch.Generator) -> list[int]:
    return sorted(torch.randperm(num_experts, generator=generator)[:keep].tolist())


def frequency_subset(scores: tuple[torch.Tensor, torch.Tensor], keep: int) -> list[int]:
    """The `keep` experts with the most routed pairs; scores = ([E] pairs, [E] routing weight)."""
    counts, mass = scores
    order = sorted(range(counts.numel()), key=lambda e: (-counts[e].item(), -mass[e].item(), e))
    return sorted(order[:keep])


class Reconstruction:
    """The relative reconstruction error of candidate subsets of one layer's experts.

    `config_for(m)` gives the model config with m experts (top-k lowered to m where needed), from which a router of
    the layer's own class is built for each candidate.
    """

    def __init__(self, block, data: LayerData, state: dict[str, torch.Tensor], config_for: Callable[[int], object]):
        self.block, self.data, self.state, self.config_for = block, data, state, config_for
        norms = data.routed.double().pow(2).sum(-1)  # [N]
        # each token's error relative to its own output (the module docstring), floored for tokens with almost none
        self.token_weight = 1.0 / (norms + TOKEN_FLOOR * norms.mean()).clamp_min(1e-30)  # [N]
        self.norm = (norms * self.token_weight).sum().item() or 1.0
        self._routers = {}  # one router per expert count, its rows swapped per candidate (building one costs more)

    def output(self, rows: list[int], state: dict[str, torch.Tensor] | None = None,
               outputs: torch.Tensor | None = None) -> torch.Tensor:
        """[N, H] routed output of the layer cut to experts `rows` (router rows from `state` when given, the original
        ones otherwise; expert outputs [m, N, H] from `outputs` when given, the original experts' otherwise)."""
        e = self.data.num_experts
        state = state if state is not None else select_rows(self.state, rows, e)
        router = self._routers.get(len(rows))
        if router is None:
            router = self._routers[len(rows)] = make_router(self.block, self.config_for(len(rows)), state)
        else:
            router.load_state_dict(state, strict=True, assign=True)
        index, weights, _ = route(router, self.data.x)
        if outputs is not None:
            return combine(outputs, index, weights)
        ids = torch.tensor(rows, dtype=torch.long)
        index = torch.where(index >= 0, ids[index.clamp_min(0)], -1)
        return combine(self.data.outputs, index, weights)

    def error(self, rows: list[int], state=None, outputs=None) -> float:
        diff = self.output(rows, state, outputs).double() - self.data.routed.double()
        return (diff.pow(2).sum(-1) * self.token_weight).sum().item() / self.norm

    def table(self, keep: int) -> dict[tuple[int, ...], float] | None:
        """{subset: error} of every subset of `keep` experts, or None when there are more than ENUMERATION_LIMIT."""
        e = self.data.num_experts
        if math.comb(e, keep) > ENUMERATION_LIMIT:
            return None
        return {s: self.error(list(s)) for s in itertools.combinations(range(e), keep)}

    def best(self, keep: int) -> Choice:
        return self.ranked(keep, 1)[0]

    def ranked(self, keep: int, count: int) -> list[Choice]:
        """The `count` subsets of `keep` experts with the lowest error, best first: from every subset where they can
        be tried, else the ends of greedy backward elimination (its last step's drops, best first)."""
        table = self.table(keep)
        if table is not None:
            order = sorted(table, key=lambda s: (table[s], s))[:count]
            return [Choice(list(s), error=table[s]) for s in order]
        current = list(range(self.data.num_experts))
        if len(current) == keep:
            return [Choice(current, error=0.0)]
        while True:
            trials = sorted((self.error([e for e in current if e != j]), j) for j in current)  # (error, dropped)
            if len(current) == keep + 1:
                return [Choice([e for e in current if e != j], error=error) for error, j in trials[:count]]
            current.remove(trials[0][1])

    def removal_costs(self) -> list[float]:
        """[E] error of the layer without each expert alone (the global proxy when subsets are too many)."""
        e = self.data.num_experts
        return [self.error([j for j in range(e) if j != i]) for i in range(e)]


def global_subset(method: str, keep: int, per_layer: list, num_experts: int) -> list[int]:
    """One expert set for every layer, from each layer's statistics (see the module docstring): frequency scores,
    reconstruction tables (or removal costs where the subsets are too many)."""
    if method == "frequency":
        counts = sum(s[0] for s in per_layer)
        mass = sum(s[1] for s in per_layer)
        return frequency_subset((counts, mass), keep)
    if all(isinstance(t, dict) for t in per_layer):
        total = {s: sum(t[s] for t in per_layer) for s in per_layer[0]}
        return list(min(total, key=lambda s: (total[s], s)))
    costs = torch.tensor([t for t in per_layer], dtype=torch.float64).sum(0)  # [E] summed removal costs
    return sorted(torch.argsort(costs, descending=True, stable=True)[:keep].tolist())
