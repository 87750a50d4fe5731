"""The methods of `shrink`, one class each behind one interface (`ShrinkMethod`), found by name in `SHRINK_METHODS`.

    reconstruction  each layer's subset that reproduces the original model's output there best (select.py)
    loss            reconstruction's best few subsets per layer, one chosen by the model's loss (search.py)
    merge           reconstruction's subset, the other experts merged into the closest kept one (merge.py)
    frequency       the most routed experts
    random          seeded; reads no text and runs nothing

`shrink` (api.py) makes two calls: `choose_globally` for scope global (one choice for every layer, kept in `fixed`),
then `apply`, which writes every layer and returns what each kept. A method that reads text applies itself in one
layer-by-layer forward (`shrink_pass`) that calls its `choose` in every MoE layer and hands the next layer the shrunk
block's output; its `choose_globally` is a first forward that calls `statistics` in every layer and shrinks nothing.
Methods that reconstruct carry the original model's rows beside the shrunk model's in the same forward, so that a
layer aims at the original model's output and can make up for what the layers before it lost (select.py).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..layerwise import fill_parameters
from ..modeling import MoEForCausalLM
from .layer import LayerData, expert_params, is_sigmoid_router, replaced_block, router_state, select_rows
from .layout import MoELayout, ShrinkError
from .merge import groups_for, logit_correlation, merge_layer
from .output import ShrunkWriter, head_class
from .passes import cut_pass, empty_model, forward_pass, layer_data, load_buffers
from .search import SEARCH_CANDIDATES, LossSearch, SearchResult
from .select import Choice, Reconstruction, frequency_subset, global_subset, random_subset

Kept = tuple[dict, dict, Choice]  # (router state, expert tensors {name: [keep, ...]}, the choice) of one layer


class ShrinkMethod:
    """A way of choosing what each MoE layer keeps, over one checkpoint (`layout`), `keep` experts a layer.

    Subclasses set `name` and define `choose` (one layer, in the shrinking forward), `statistics` (one layer, in the
    scoring forward of global scope) and `global_choice` (from every layer's statistics), or override `apply` and
    `choose_globally` where they run no forward (random) or more than one (loss).
    """

    name: ClassVar[str]
    reads_text: ClassVar[bool] = True  # needs calibration text (`ids`)
    reconstructs: ClassVar[bool] = False  # needs every expert's output and the original model's output at the layer
    scopes: ClassVar[tuple[str, ...]] = ("layer", "global")

    def __init__(self, layout: MoELayout, keep: int, *, seed: int = 0, progress: bool = True,
                 search_candidates: int = SEARCH_CANDIDATES):
        self.layout, self.keep, self.seed, self.progress = layout, keep, seed, progress
        self.search_candidates = search_candidates
        self.generator = torch.Generator().manual_seed(seed)
        self.dtype = layout.source.float_dtype()  # what the checkpoint stores
        self.fixed: dict | None = None  # global scope: {"kept": [...], "groups": {...}} for every layer
        self._configs: dict[int, object] = {}

    @classmethod
    def check_model(cls, layout: MoELayout, src) -> None:
        """Refuse a model this method cannot shrink (ShrinkError, saying what to use instead)."""

    def config_for(self, m: int):
        """The model config with m experts (top-k lowered to m where larger)."""
        if m not in self._configs:
            self._configs[m] = self.layout.shrunk_config(m, min(self.layout.top_k, m))
        return self._configs[m]

    # ------------------------------------------------------------------------------------ what a method defines
    def choose(self, layer: int, block, data: LayerData, state: dict, params: dict) -> Kept:
        """What MoE layer `layer` keeps, from its `data`, router `state` and expert tensors `params` ({name: [E, ...]}
        fp32); follows `fixed` where set."""
        raise NotImplementedError

    def statistics(self, block, data: LayerData, state: dict) -> dict:
        """One layer's share of global scope's choice."""
        raise NotImplementedError

    def global_choice(self, stats: list[dict]) -> dict:
        """One {"kept": [...], "groups": {...}} for every layer, from each MoE layer's `statistics`, in order."""
        return {"kept": global_subset(self.name, self.keep, [s["table"] for s in stats], self.layout.num_experts),
                "groups": {}}

    # ------------------------------------------------------------------------------------------ what shrink calls
    def choose_globally(self, ids: torch.Tensor) -> dict:
        """Global scope: one choice for every layer, from a first pass over the original model."""
        stats = {}

        def visit(layer, block, hidden, output):
            x = hidden.reshape(-1, hidden.shape[-1]).float()
            params = expert_params(block, self.layout.expert_params)
            state = router_state(block)
            stats[layer] = self.statistics(block, self._data(block, params, x, None), state)

        forward_pass(self.layout, ids, visit, f"Scoring ({self.name}, {ids.numel()} tokens)", self.progress)
        return self.global_choice([stats[i] for i in self.layout.moe_layers])

    def apply(self, writer: ShrunkWriter, ids: torch.Tensor | None) -> tuple[dict[int, Choice], SearchResult | None]:
        """Write every MoE layer's router and experts; (each layer's choice, the loss search's result or None)."""
        return self.shrink_pass(ids, writer), None

    # ---------------------------------------------------------------------------------------------- the forward
    def shrink_pass(self, ids: torch.Tensor, writer: ShrunkWriter | None) -> dict[int, Choice]:
        """The layer-by-layer forward that shrinks: each MoE layer chosen (`choose`) on the activations of the model
        as shrunk so far, written (unless `writer` is None), and replaced by the shrunk block for the next layers."""
        tokens, layout, choices = ids.numel(), self.layout, {}
        if self.reconstructs:  # rows [:B] carry the original model, rows [B:] the shrunk one
            ids = torch.cat([ids, ids])

        def visit(layer, block, hidden, output):
            original, hidden = hidden.chunk(2) if self.reconstructs else (None, hidden)
            x = hidden.reshape(-1, hidden.shape[-1]).float()
            params = expert_params(block, layout.expert_params)
            state = router_state(block)
            data = self._data(block, params, x, None if original is None else original.reshape(x.shape).float())
            kept_state, kept_params, choices[layer] = self.choose(layer, block, data, state, params)
            # rounded as the checkpoint stores them: the next layers see what the shrunk model will compute
            kept_state = {k: v.to(self.dtype).float() if v.is_floating_point() else v for k, v in kept_state.items()}
            kept_params = {k: v.to(self.dtype).float() for k, v in kept_params.items()}
            if writer is not None:
                writer.write_layer(layer, kept_state, kept_params)
            if self.keep == layout.num_experts:
                return None  # every expert kept, in order: the block is unchanged
            kept = replaced_block(block, self.config_for(self.keep), kept_state, kept_params)(hidden)
            kept = kept[0] if isinstance(kept, tuple) else kept
            return kept if original is None else torch.cat([output.chunk(2)[0], kept])

        forward_pass(layout, ids, visit, f"Shrinking ({self.name}, {tokens} tokens)", self.progress)
        return choices

    def _data(self, block, params: dict, x: torch.Tensor, original: torch.Tensor | None) -> LayerData:
        return layer_data(block, params, x, original, self.layout.num_experts, self.seed, self.reconstructs)

    def _cut(self, state: dict, params: dict, choice: Choice) -> Kept:
        index = torch.tensor(choice.kept)
        return (select_rows(state, choice.kept, self.layout.num_experts),
                {n: t.index_select(0, index) for n, t in params.items()}, choice)


class ReconstructionMethod(ShrinkMethod):
    """Each layer's subset that reproduces the original model's output at the layer best (`select.Reconstruction`)."""

    name = "reconstruction"
    reconstructs = True
    candidates = 1  # subsets of each layer kept in `ranked`, best first

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ranked: dict[int, list[Choice]] = {}

    def choose(self, layer, block, data, state, params):
        rec = Reconstruction(block, data, state, self.config_for)
        if self.fixed:
            choice = Choice(self.fixed["kept"])
            choice.error = rec.error(choice.kept)
        else:
            self.ranked[layer] = rec.ranked(self.keep, self.candidates)
            choice = self.ranked[layer][0]
        return self._cut(state, params, choice)

    def statistics(self, block, data, state):
        rec = Reconstruction(block, data, state, self.config_for)
        table = rec.table(self.keep)
        return {"table": table if table is not None else rec.removal_costs()}


class LossMethod(ReconstructionMethod):
    """Reconstruction's `search_candidates` best subsets of each layer, one chosen by the model's loss on the
    calibration text (`search.LossSearch`, on the model loaded whole in the checkpoint's dtype)."""

    name = "loss"
    scopes = ("layer",)

    @property
    def candidates(self) -> int:
        return self.search_candidates

    @classmethod
    def check_model(cls, layout, src):
        if not layout.is_native and head_class(layout.config) is not MoEForCausalLM:
            raise ShrinkError(f"method='loss' scores by the next-token loss of a causal LM; {src} is a "
                              f"{head_class(layout.config).__name__}: use method='reconstruction'.")

    def apply(self, writer, ids):
        """Reconstruction's forward (each layer's candidates, nothing written), the search, then each layer read, cut
        and written."""
        layout, e = self.layout, self.layout.num_experts
        self.shrink_pass(ids, None)
        model = empty_model(layout)
        model.tie_weights()  # a tied output head is not on disk: it is the input embedding, once read
        fill_parameters(model, "", layout.read, self.dtype)
        model.tie_weights()
        originals = {}
        for layer in layout.moe_layers:
            originals[layer] = model.get_submodule(layout.memory_prefix(layer)[:-1])
            load_buffers(layout, layer, originals[layer])
        model.eval()
        config = self.config_for(self.keep)

        def install(layer: int, rows: list[int] | None) -> None:
            block = originals[layer]
            if rows is not None:
                index = torch.tensor(rows)
                experts = {n: getattr(block.experts, n).detach().index_select(0, index) for n in layout.expert_params}
                block = replaced_block(block, config, select_rows(router_state(block), rows, e), experts)
            parent, _, name = layout.memory_prefix(layer)[:-1].rpartition(".")
            model.get_submodule(parent).register_module(name, block)

        candidates = {layer: [c.kept for c in self.ranked[layer]] for layer in layout.moe_layers}
        found = LossSearch(model, model.get_submodule(layout.layers_path), install, ids).run(candidates, self.progress)
        del model, originals
        cut_pass(layout, writer, found.kept.__getitem__, f"Shrinking ({self.name})", self.progress)
        choices = {layer: next(c for c in self.ranked[layer] if c.kept == kept) for layer, kept in found.kept.items()}
        return choices, found


class MergeMethod(ReconstructionMethod):
    """Reconstruction's subset, each expert left out merged into the kept one whose routing it correlates with most,
    where that reproduces the layer better (`merge.merge_layer`)."""

    name = "merge"

    def choose(self, layer, block, data, state, params):
        rec = Reconstruction(block, data, state, self.config_for)
        centres = self.fixed["kept"] if self.fixed else rec.best(self.keep).kept
        groups = self.fixed["groups"] if self.fixed else groups_for(centres, logit_correlation(data.logits))
        choice, kept_state, kept_params = merge_layer(rec, block.experts, params, centres, groups,
                                                     is_sigmoid_router(block))
        return kept_state, kept_params, choice

    def statistics(self, block, data, state):
        return {**super().statistics(block, data, state), "similarity": logit_correlation(data.logits)}

    def global_choice(self, stats):
        kept = super().global_choice(stats)["kept"]
        return {"kept": kept, "groups": groups_for(kept, torch.stack([s["similarity"] for s in stats]).mean(0))}


class FrequencyMethod(ShrinkMethod):
    """The experts routed the most (token, slot) pairs on the calibration text."""

    name = "frequency"

    def choose(self, layer, block, data, state, params):
        kept = self.fixed["kept"] if self.fixed else frequency_subset(data.usage(), self.keep)
        return self._cut(state, params, Choice(kept))

    def statistics(self, block, data, state):
        return {"usage": data.usage()}

    def global_choice(self, stats):
        kept = global_subset(self.name, self.keep, [s["usage"] for s in stats], self.layout.num_experts)
        return {"kept": kept, "groups": {}}


class RandomMethod(ShrinkMethod):
    """`keep` experts drawn uniformly (seeded): the baseline. Reads no text and runs nothing."""

    name = "random"
    reads_text = False

    def choose_globally(self, ids):
        return {"kept": random_subset(self.layout.num_experts, self.keep, self.generator), "groups": {}}

    def apply(self, writer, ids):
        fixed = self.fixed["kept"] if self.fixed else None

        def kept_for(layer: int) -> list[int]:
            return fixed or random_subset(self.layout.num_experts, self.keep, self.generator)

        kept = cut_pass(self.layout, writer, kept_for, f"Shrinking ({self.name})", self.progress)
        return {layer: Choice(rows) for layer, rows in kept.items()}, None


SHRINK_METHODS: dict[str, type[ShrinkMethod]] = {
    m.name: m for m in (ReconstructionMethod, LossMethod, MergeMethod, FrequencyMethod, RandomMethod)
}
METHODS = tuple(SHRINK_METHODS)  # the public names, in the order the docs give them
