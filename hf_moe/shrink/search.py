"""`method="loss"`: each MoE layer keeps one of reconstruction's best few subsets, the one the model's own loss on the
calibration text prefers, chosen by a coordinate search over the layers in order.

EEP (arXiv 2407.00945) scores candidate prunings by the model's loss instead of each layer's output error; its
evolutionary search over all layers at once needs hundreds of full evaluations. Here each layer tries
`candidates` subsets (reconstruction's best first, its choice the starting point) with every other layer held at its
current choice, and keeps the one with the lowest loss; a layer is never changed for a loss that is not lower, so
the result's calibration loss is at most reconstruction's.

The whole model is in memory (the one method that loads it whole): the checkpoint's weights in the dtype it stores,
each MoE block replaced by a block of its own class holding the candidate's router rows and experts, which is what
the written checkpoint computes. When layer l is searched the layers before it are final, so their outputs are
replayed from the best evaluation so far (`_Replay`): a candidate costs the forward from layer l on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

SEARCH_CANDIDATES = 8  # subsets tried per layer: reconstruction's best, in its order


@dataclass
class SearchResult:
    """The subsets kept ({layer: expert ids}) and the model's mean next-token loss (nats) on the calibration text:
    the full model's, with reconstruction's choice in every layer, and with the choice kept."""

    kept: dict[int, list[int]]
    full_loss: float
    reconstruction_loss: float
    loss: float
    evaluations: int

    def report(self) -> dict:
        return {"full": round(self.full_loss, 6), "reconstruction": round(self.reconstruction_loss, 6),
                "kept": round(self.loss, 6), "evaluations": self.evaluations}


class _Replay(nn.Module):
    """Stands in for a decoder layer whose output is known (the layers before it are final): returns it as is."""

    def __init__(self, layer: nn.Module, output):
        super().__init__()
        self.output = output
        for name, value in vars(layer).items():  # plain attributes a model's loop may read (attention_type)
            if not name.startswith("_") and name != "training":
                self.__dict__[name] = value

    def forward(self, *args, **kwargs):
        return self.output


class LossSearch:
    """The coordinate search over the MoE layers of `model` (eval mode, weights in memory).

    `install(layer, rows)` puts into `model` the block of MoE layer `layer` cut to experts `rows` (None: the
    original block); `layers` is the model's decoder layers (nn.ModuleList); ids [B, T] the calibration rows.
    """

    def __init__(self, model: nn.Module, layers: nn.ModuleList, install: Callable[[int, list[int] | None], None],
                 ids: torch.Tensor):
        self.model, self.layers, self.install, self.ids = model, layers, install, ids
        self.evaluations = 0

    @torch.no_grad()
    def loss(self, start: int = 0) -> tuple[float, dict[int, object]]:
        """(mean next-token loss, {decoder layer: its output} for the layers from `start` on, which run; the
        layers before `start` are expected to be `_Replay`s)."""
        outputs, handles = {}, []
        for index in range(start, len(self.layers)):
            handles.append(self.layers[index].register_forward_hook(
                lambda module, args, output, index=index: outputs.__setitem__(index, output)))
        try:
            logits = self.model(input_ids=self.ids, use_cache=False).logits
        finally:
            for handle in handles:
                handle.remove()
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                           self.ids[:, 1:].reshape(-1))
        self.evaluations += 1
        return loss.item(), outputs

    def run(self, candidates: dict[int, list[list[int]]], progress: bool = True) -> SearchResult:
        """Search every MoE layer of `candidates` ({layer: subsets, reconstruction's choice first}), in order."""
        for layer in candidates:
            self.install(layer, None)
        full, _ = self.loss()
        kept = {layer: subsets[0] for layer, subsets in candidates.items()}
        for layer, rows in kept.items():
            self.install(layer, rows)
        start, cached = self.loss()
        best = start
        bar = tqdm(total=sum(len(s) - 1 for s in candidates.values()), disable=not progress,
                   desc="Searching by the model's loss")
        try:
            for layer in sorted(candidates):
                originals = [self.layers[i] for i in range(layer)]
                for i in range(layer):
                    self.layers[i] = _Replay(originals[i], cached[i])
                try:
                    for rows in candidates[layer][1:]:
                        self.install(layer, rows)
                        loss, outputs = self.loss(layer)
                        if loss < best:
                            best, kept[layer] = loss, rows
                            cached.update(outputs)
                        bar.update()
                        bar.set_postfix(loss=f"{best:.4f}")
                    self.install(layer, kept[layer])
                finally:
                    for i, module in enumerate(originals):
                        self.layers[i] = module
        finally:
            bar.close()
        return SearchResult(kept, full, start, best, self.evaluations)
