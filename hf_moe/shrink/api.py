"""`shrink`: an MoE checkpoint -> the same kind of checkpoint with fewer experts per layer, streamed layer by layer.

The model is never loaded whole. Its parameters stay on the meta device, and the calibration text runs through it
one decoder layer at a time (`hf_moe.layerwise.layerwise`: each layer read from the files just before it
runs, released after). When an MoE block has run, a hook on it sees the block's input and output, chooses what the
layer keeps (`select`, `merge`), writes the layer's new router and experts, and hands the next layer the output of
the shrunk block instead: later layers are chosen on the activations of the model as shrunk so far. Peak memory is
one decoder layer, every expert's output on the calibration tokens, and the activations of the calibration batch.
`random` reads no text and runs nothing: each layer's router and experts are read, cut and written. `loss` runs the
layer-by-layer forward of reconstruction without writing, loads the model whole for `search.LossSearch`, then reads,
cuts and writes each layer as random does.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import init_empty_weights
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

from ..checkpoint import (
    load_tokenizer, reading, resolve_output_directory, same_directory, staging_directory, validate_checkpoint,
)
from ..layerwise import layerwise, materialize
from ..modeling import MoEForCausalLM
from .calibration import calibration_ids, min_tokens
from .layer import LayerData, combine, expert_outputs, expert_params, is_sigmoid_router, replaced_block, route
from .layer import router_state, select_rows
from .layout import MoELayout, ShrinkError, open_layout
from .merge import groups_for, logit_correlation, merge_layer
from .output import ShrunkWriter, head_class
from .search import SEARCH_CANDIDATES, LossSearch, SearchResult
from .select import METHODS, Choice, Reconstruction, frequency_subset, global_subset, random_subset

SCOPES = ("layer", "global")
RECONSTRUCTING = ("reconstruction", "merge", "loss")  # methods that need every expert's output and the target
SEARCH_BYTES = 768 << 20  # every expert's output on the tokens a layer's search uses: at most this much (fp32)


@dataclass
class ShrinkResult:
    """What `shrink` wrote: where, from how many experts to how many, and what each MoE layer kept."""

    path: Path
    kind: str  # "hf_moe" or the native model_type
    method: str
    scope: str
    num_experts: int
    keep: int
    top_k: int
    new_top_k: int
    layers: dict[int, Choice] = field(default_factory=dict)
    calibration_tokens: int = 0
    seconds: float = 0.0
    search: SearchResult | None = None  # method "loss"

    def report(self) -> dict:
        """The record written to shrink.json (and, for hf_moe, config.moe_conversion["shrink"])."""
        return {
            "method": self.method, "scope": self.scope, "num_experts": self.num_experts, "keep": self.keep,
            "top_k": self.top_k, "new_top_k": self.new_top_k, "calibration_tokens": self.calibration_tokens,
            "kept": {str(i): c.kept for i, c in self.layers.items()},
            "merged": {str(i): {str(k): v for k, v in c.groups.items()} for i, c in self.layers.items() if c.groups},
            "relative_error": {str(i): round(c.error, 6) for i, c in self.layers.items() if c.error is not None},
            **({"calibration_loss": self.search.report()} if self.search else {}),
            "note": "kept[layer][i]: the original expert that is now expert i (merged with merged[layer][it] where "
                    "listed); relative_error: the layer's routed experts in the shrunk model against the original "
                    "model's at that layer, on the calibration tokens: each token's squared error relative to its "
                    "own output's, averaged (hf_moe.shrink.select)"
                    + ("; calibration_loss: the model's mean next-token loss on the calibration text, full, with "
                       "reconstruction's choice in every layer, and with the experts kept (hf_moe.shrink.search); "
                       "relative_error as measured in reconstruction's pass, before the search" if self.search else ""),
        }


def shrink(
    model: str | os.PathLike,
    out: str | os.PathLike,
    keep: int,
    method: str = "reconstruction",
    data: str | os.PathLike | None = None,
    *,
    scope: str = "layer",
    seed: int = 0,
    calibration_tokens: int = 4096,
    seq_len: int = 256,
    tokenizer=None,
    max_shard_size: int | str = "5GB",
    search_candidates: int = SEARCH_CANDIDATES,
    progress: bool = True,
) -> ShrinkResult:
    """Shrink the MoE checkpoint in directory `model` to `keep` experts per MoE layer, into `out`.

    Args:
        model: an hf_moe checkpoint, or a native transformers MoE checkpoint (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
            FlexOlmo) in a local directory.
        out: the output directory: the same kind of checkpoint, with `keep` experts per layer. Written atomically.
        keep: experts kept in every MoE layer, 1 to the model's count (the count itself changes nothing).
        method: "reconstruction" (the subset that reproduces each layer's output best), "merge" (the same subset,
            with the other experts merged into the closest kept one where that reproduces the layer better),
            "frequency" (the most routed), "random" (seeded; the baseline), or "loss" (each layer one of
            reconstruction's best `search_candidates` subsets, chosen by the model's loss on the calibration text;
            loads the model whole). See `hf_moe.shrink.select` and `hf_moe.shrink.search`.
        data: calibration text (.txt, or .json/.jsonl with a `text` field); every method but random needs it.
        scope: "layer" (each layer its own experts) or "global" (the same expert ids in every layer, chosen from
            all layers' statistics; see `hf_moe.shrink.select`).
        seed: of `random`, and of the sample of tokens a layer's search uses when the text is long.
        calibration_tokens: tokens of `data` used, in rows of `seq_len`.
        tokenizer: for `data`; default the one saved in `model`.
        search_candidates: subsets tried per layer by method "loss".
    Returns:
        A `ShrinkResult`. top-k is lowered to `keep` where it was larger (said in the result and on stderr).
    Raises:
        ShrinkError (a ValueError): keep out of range, calibration text too short or not text, a model that is not an
            MoE, or one whose experts are not plain (adapter experts: `hf-moe materialize` first), whose tensors do
            not have the sizes its config gives, or whose weights are not all finite.
    """
    start = time.perf_counter()
    if method not in METHODS:
        raise ShrinkError(f"method must be one of {', '.join(METHODS)}, got {method!r}.")
    if scope not in SCOPES:
        raise ShrinkError(f"scope must be 'layer' or 'global', got {scope!r}.")
    if method == "loss" and scope != "layer":
        raise ShrinkError("method='loss' chooses each layer's experts (scope='layer'); for one set in every layer use "
                          "method='reconstruction' with scope='global'.")
    for name, value in (("search_candidates", search_candidates), ("calibration_tokens", calibration_tokens),
                        ("seq_len", seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ShrinkError(f"{name} must be a positive integer, got {value!r}.")
    src = Path(model)
    if same_directory(src, out):
        raise ShrinkError(f"The output directory {out} is the model {src}: write the shrunk model elsewhere.")
    with reading(src):  # one checkpoint, even while a save replaces it
        layout = open_layout(src)
        _check_keep(layout, keep)
        if layout.kind == "hf_moe":
            validate_checkpoint(src, verify_checksums=None)  # a corrupt input is refused, not shrunk
        new_top_k = min(layout.top_k, keep)
        _check_top_k(layout, new_top_k)
        if method == "loss" and not layout.is_native and head_class(layout.config) is not MoEForCausalLM:
            raise ShrinkError(f"method='loss' scores by the next-token loss of a causal LM; {src} is a "
                              f"{head_class(layout.config).__name__}: use method='reconstruction'.")
        if new_top_k < layout.top_k:
            left = f"{keep} expert{'s' if keep > 1 else ''}"
            warnings.warn(f"top-k lowered from {layout.top_k} to {new_top_k}: only {left} left per layer.",
                          stacklevel=2)
        ids = None
        if method != "random":
            if data is None:
                raise ShrinkError(f"method={method!r} needs calibration text: pass data= (--data FILE), a few "
                                  "thousand tokens like the text the model will serve.")
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(src)
            ids = calibration_ids(data, tokenizer, calibration_tokens, seq_len,
                                  min_tokens(layout.num_experts, layout.top_k))
        result = ShrinkResult(resolve_output_directory(out, "Cannot write the shrunk model to"), layout.kind, method,
                              scope, layout.num_experts, keep, layout.top_k, new_top_k,
                              calibration_tokens=0 if ids is None else ids.numel())
        run = _Run(layout, keep, method, seed, progress, search_candidates)
        with staging_directory(result.path) as staging, ShrunkWriter(layout, staging, keep, max_shard_size) as writer:
            writer.copy_unchanged()
            if scope == "global":
                run.fixed = _global_choice(run, ids)
            if method == "loss":
                result.layers, result.search = _search_by_loss(run, ids, writer)
            else:
                result.layers = run.apply(writer, ids)
            result.seconds = time.perf_counter() - start
            report = result.report()
            if layout.is_native:
                writer.finish_native({layout.family.experts_field: keep, "num_experts_per_tok": new_top_k},
                                     result.path, report)
            else:
                config = layout.shrunk_config(keep, new_top_k)
                config.moe_conversion = dict(config.moe_conversion or {}, shrink=report)
                writer.finish_hf_moe(config, result.path, report)
    return result


def _check_keep(layout: MoELayout, keep) -> None:
    e = layout.num_experts
    if not isinstance(keep, int) or isinstance(keep, bool) or not 1 <= keep <= e:
        raise ShrinkError(f"keep must be an integer from 1 to the model's {e} experts per layer, got {keep!r}.")


def _check_top_k(layout: MoELayout, top_k: int) -> None:
    router = getattr(layout.config, "router_type", "topk")
    if router == "gshard" and top_k != 2:
        raise ShrinkError("The gshard router routes top-2: keep at least 2 experts.")


# --------------------------------------------------------------------------------------------------------- runs
class _Run:
    """One pass over the MoE layers: each layer's choice (or, with `collect`, only its statistics)."""

    def __init__(self, layout: MoELayout, keep: int, method: str, seed: int, progress: bool,
                 search_candidates: int = SEARCH_CANDIDATES):
        self.layout, self.keep, self.method, self.progress = layout, keep, method, progress
        self.search_candidates = search_candidates
        self.generator = torch.Generator().manual_seed(seed)
        self.seed = seed
        self.dtype = layout.source.float_dtype()  # what the checkpoint stores
        self.fixed: dict | None = None  # global scope: {"kept": [...], "groups": {...}} for every layer
        self.searched: dict[int, list[int]] = {}  # method loss: each layer's experts, chosen by `search`
        self.ranked: dict[int, list[Choice]] = {}  # reconstruction's best subsets per layer (method loss: its candidates)
        self.collect = False  # first pass of global scope: statistics only
        self.stats: dict[int, dict] = {}
        self.choices: dict[int, Choice] = {}
        self._configs: dict[int, object] = {}

    @property
    def paired(self) -> bool:
        """Whether the forward carries the original model's rows beside the shrunk model's (`_forward`)."""
        return self.method in RECONSTRUCTING and not self.collect

    def config_for(self, m: int):
        if m not in self._configs:
            self._configs[m] = self.layout.shrunk_config(m, min(self.layout.top_k, m))
        return self._configs[m]

    def apply(self, writer: ShrunkWriter, ids) -> dict[int, Choice]:
        if ids is None:
            self._without_forward(writer)
        else:
            self._forward(ids, writer)
        return self.choices

    # -------------------------------------------------------------------------------- random: no forward at all
    def _without_forward(self, writer: ShrunkWriter) -> None:
        layout = self.layout
        fixed = self.fixed["kept"] if self.fixed else None
        for layer in tqdm(layout.moe_layers, desc=f"Shrinking ({self.method})", disable=not self.progress):
            kept = fixed or self.searched.get(layer) or random_subset(layout.num_experts, self.keep, self.generator)
            prefix = layout.memory_prefix(layer)
            router = {k[len(prefix) + 5:]: layout.read(k) for k in self._router_keys(layer)}
            experts = {n: layout.read(f"{prefix}experts.{n}") for n in layout.expert_params}
            index = torch.tensor(kept)
            writer.write_layer(layer, select_rows(router, kept, layout.num_experts),
                               {n: t.index_select(0, index) for n, t in experts.items()})
            self.choices[layer] = Choice(kept)

    def _router_keys(self, layer: int) -> list[str]:
        """In-memory keys of layer `layer`'s router tensors that are on disk."""
        disk, memory = self.layout.disk_prefix(layer) + "gate.", self.layout.memory_prefix(layer) + "gate."
        return [memory + k[len(disk):] for k in self.layout.source.entries if k.startswith(disk)]

    # ------------------------------------------------------------------------------- the layer-by-layer forward
    def _forward(self, ids: torch.Tensor, writer: ShrunkWriter | None) -> None:
        layout = self.layout
        # Reconstruction and merge aim each layer at the original model's output, carried beside the shrunk model's in
        # the same forward (the calibration rows twice), so that a layer can make up for what the layers before it
        # lost (select.py); the scoring pass of global scope shrinks nothing and needs no second copy (`paired`).
        tokens = ids.numel()
        if self.paired:  # rows [:B] carry the original model, rows [B:] the shrunk one
            ids = torch.cat([ids, ids])
        model = _empty_model(layout).eval()
        bar = tqdm(total=len(layout.moe_layers), disable=not self.progress,
                   desc=f"{'Scoring' if self.collect else 'Shrinking'} ({self.method}, {tokens} tokens)")
        handles = []
        for layer in layout.moe_layers:
            block = model.get_submodule(layout.memory_prefix(layer)[:-1])
            handles.append(block.register_forward_pre_hook(self._load_buffers(layer)))
            handles.append(block.register_forward_hook(self._hook(layer, writer, bar)))
        try:
            with torch.no_grad(), layerwise(model, layout.layers_path, layout.read, torch.float32):
                model.base_model(input_ids=ids, use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
            bar.close()

    def _load_buffers(self, layer: int):
        """A pre-hook giving the block's persistent buffers (an aux_free router's bias) their saved values."""
        prefix = self.layout.memory_prefix(layer)

        def hook(block, args):
            for name, buffer in block.named_buffers():
                owner, _, attr = name.rpartition(".")
                module = block.get_submodule(owner) if owner else block
                key = self.layout.disk_prefix(layer) + name
                if attr not in module._non_persistent_buffers_set and key in self.layout.source.entries:
                    module._buffers[attr] = self.layout.read(prefix + name).to(buffer.dtype)

        return hook

    def _hook(self, layer: int, writer: ShrunkWriter | None, bar):
        def hook(block, args, output):
            hidden = args[0]
            new = self._layer(layer, block, hidden, writer, output[0] if isinstance(output, tuple) else output)
            bar.update()
            if new is None:
                return None
            return (new, *output[1:]) if isinstance(output, tuple) else new

        return hook

    def _layer(self, layer: int, block, hidden: torch.Tensor, writer: ShrunkWriter | None,
               output: torch.Tensor) -> torch.Tensor | None:
        """Choose what MoE layer `layer` keeps, write it and return the shrunk block's output on `hidden` (None in
        the scoring pass of global scope). `output`: the full block's on `hidden`. Paired (`_forward`), the first
        half of `hidden`'s rows is the original model's and keeps the full block's output."""
        layout, e = self.layout, self.layout.num_experts
        original, hidden = hidden.chunk(2) if self.paired else (None, hidden)
        x = hidden.reshape(-1, hidden.shape[-1]).float()
        params = expert_params(block, layout.expert_params)
        state = router_state(block)
        data = self._data(block, params, x, None if original is None else original.reshape(x.shape).float())
        if self.collect:
            self.stats[layer] = self._statistics(block, data, state)
            return None
        kept_state, kept_params, choice = self._choose(layer, block, data, state, params)
        # rounded as the checkpoint stores them: the next layers see what the shrunk model will compute
        kept_state = {k: v.to(self.dtype).float() if v.is_floating_point() else v for k, v in kept_state.items()}
        kept_params = {k: v.to(self.dtype).float() for k, v in kept_params.items()}
        self.choices[layer] = choice
        if writer is not None:  # method loss writes after its search
            writer.write_layer(layer, kept_state, kept_params)
        if self.keep == e:
            return None  # every expert kept, in order: the block is unchanged
        kept = replaced_block(block, self.config_for(self.keep), kept_state, kept_params)(hidden)
        kept = kept[0] if isinstance(kept, tuple) else kept
        return kept if original is None else torch.cat([output.chunk(2)[0], kept])

    def _data(self, block, params: dict, x: torch.Tensor, original: torch.Tensor | None = None) -> LayerData:
        """The layer's routing on a sample of the tokens x [N, H] (all of them when they fit SEARCH_BYTES), and for
        reconstruction and merge every expert's output there and the target: the block's routed output on the
        original model's input at the same tokens (`original` [N, H]) where given, else on x."""
        e = self.layout.num_experts
        n = max(1, min(x.shape[0], SEARCH_BYTES // (4 * e * x.shape[1])))
        if n < x.shape[0]:
            sample = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(self.seed))[:n].sort().values
            x = x.index_select(0, sample)
            original = None if original is None else original.index_select(0, sample)
        index, weights, logits = route(block.gate, x)
        data = LayerData(x, logits, index, weights)
        if self.method in RECONSTRUCTING:
            data.outputs = expert_outputs(block.experts, params, x)
            if original is None:
                data.routed = combine(data.outputs, index, weights)
            else:
                target_index, target_weights, _ = route(block.gate, original)
                data.routed = combine(expert_outputs(block.experts, params, original), target_index, target_weights)
        return data

    def _statistics(self, block, data: LayerData, state) -> dict:
        if self.method == "frequency":
            return {"usage": data.usage()}
        rec = Reconstruction(block, data, state, self.config_for)
        table = rec.table(self.keep)
        stats = {"table": table if table is not None else rec.removal_costs()}
        if self.method == "merge":
            stats["similarity"] = logit_correlation(data.logits)
        return stats

    def _choose(self, layer: int, block, data: LayerData, state, params) -> tuple[dict, dict, Choice]:
        """(router state, expert tensors, the choice) of the kept experts (random never runs the model); for method
        loss, reconstruction's choice, with the candidates of the search in `ranked`."""
        e = self.layout.num_experts
        fixed = self.fixed
        if self.method == "merge":
            rec = Reconstruction(block, data, state, self.config_for)
            centres = fixed["kept"] if fixed else rec.best(self.keep).kept
            groups = fixed["groups"] if fixed else groups_for(centres, logit_correlation(data.logits))
            choice, kept_state, kept_params = merge_layer(rec, block.experts, params, centres, groups,
                                                         is_sigmoid_router(block))
            return kept_state, kept_params, choice
        if fixed:
            choice = Choice(fixed["kept"])
        elif self.method in ("reconstruction", "loss"):
            count = self.search_candidates if self.method == "loss" else 1
            self.ranked[layer] = Reconstruction(block, data, state, self.config_for).ranked(self.keep, count)
            choice = self.ranked[layer][0]
        else:
            choice = Choice(frequency_subset(data.usage(), self.keep))
        if fixed and self.method == "reconstruction":
            choice.error = Reconstruction(block, data, state, self.config_for).error(choice.kept)
        index = torch.tensor(choice.kept)
        return select_rows(state, choice.kept, e), {n: t.index_select(0, index) for n, t in params.items()}, choice


def _empty_model(layout: MoELayout):
    """The checkpoint's model with its parameters on the meta device (buffers real): hf_moe's head or the native
    family's causal LM."""
    with init_empty_weights(include_buffers=False):
        return (head_class(layout.config)(layout.config) if not layout.is_native
                else AutoModelForCausalLM.from_config(layout.config))


def _search_by_loss(run: _Run, ids: torch.Tensor, writer: ShrunkWriter) -> tuple[dict[int, Choice], SearchResult]:
    """Method loss: reconstruction's forward (each layer's candidates, nothing written), the search by the model's
    loss on the model loaded whole in the checkpoint's dtype (`search`), then each layer read, cut and written."""
    layout, e = run.layout, run.layout.num_experts
    run._forward(ids, None)
    model = _empty_model(layout)
    model.tie_weights()  # a tied output head is not on disk: it is the input embedding, once read
    materialize(model, "", layout.read, run.dtype)
    model.tie_weights()
    originals = {}
    for layer in layout.moe_layers:
        originals[layer] = model.get_submodule(layout.memory_prefix(layer)[:-1])
        run._load_buffers(layer)(originals[layer], ())
    model.eval()
    config = run.config_for(run.keep)

    def install(layer: int, rows: list[int] | None) -> None:
        block = originals[layer]
        if rows is not None:
            index = torch.tensor(rows)
            experts = {n: getattr(block.experts, n).detach().index_select(0, index) for n in layout.expert_params}
            block = replaced_block(block, config, select_rows(router_state(block), rows, e), experts)
        parent, _, name = layout.memory_prefix(layer)[:-1].rpartition(".")
        model.get_submodule(parent).register_module(name, block)

    candidates = {layer: [c.kept for c in run.ranked[layer]] for layer in layout.moe_layers}
    found = LossSearch(model, model.get_submodule(layout.layers_path), install, ids).run(candidates, run.progress)
    del model, originals
    run.searched = found.kept
    run._without_forward(writer)
    choices = {layer: next(c for c in run.ranked[layer] if c.kept == kept) for layer, kept in found.kept.items()}
    return choices, found


def _global_choice(run: _Run, ids) -> dict:
    """Global scope: one expert set (and, for merge, one grouping) for every layer, from a first pass over the
    original model (`select.global_subset`)."""
    e, keep = run.layout.num_experts, run.keep
    if run.method == "random":
        return {"kept": random_subset(e, keep, run.generator), "groups": {}}
    run.collect = True
    run._forward(ids, None)
    run.collect = False
    stats = [run.stats[i] for i in run.layout.moe_layers]
    key = "usage" if run.method == "frequency" else "table"
    kept = global_subset(run.method, keep, [s[key] for s in stats], e)
    groups = {}
    if run.method == "merge":
        similarity = torch.stack([s["similarity"] for s in stats]).mean(0)
        groups = groups_for(kept, similarity)
    return {"kept": kept, "groups": groups}

