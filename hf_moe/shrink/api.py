"""`shrink`: an MoE checkpoint -> the same kind of checkpoint with fewer experts per layer, streamed layer by layer.

The model is never loaded whole (passes.py): the calibration text runs through it one decoder layer at a time, and
when an MoE block has run, the method (methods.py, one class each) chooses what the layer keeps, the layer's new
router and experts are written, and the next layer gets the output of the shrunk block instead: later layers are
chosen on the activations of the model as shrunk so far. `random` reads no text and runs nothing: each layer's
router and experts are read, cut and written. `loss` runs the layer-by-layer forward of reconstruction without
writing, loads the model whole for `search.LossSearch`, then reads, cuts and writes each layer as random does.
This module checks the request, opens the checkpoint and the output, and hands them to the method.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint import (
    load_tokenizer, reading, resolve_output_directory, same_directory, staging_directory, validate_checkpoint,
)
from .calibration import calibration_ids, min_tokens
from .layout import MoELayout, ShrinkError, open_layout
from .methods import METHODS, SHRINK_METHODS
from .output import ShrunkWriter
from .search import SEARCH_CANDIDATES, SearchResult
from .select import Choice

SCOPES = ("layer", "global")


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
    kind = SHRINK_METHODS[method]
    if scope not in kind.scopes:  # method loss
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
        kind.check_model(layout, src)
        if new_top_k < layout.top_k:
            left = f"{keep} expert{'s' if keep > 1 else ''}"
            warnings.warn(f"top-k lowered from {layout.top_k} to {new_top_k}: only {left} left per layer.",
                          stacklevel=2)
        ids = None
        if kind.reads_text:
            if data is None:
                raise ShrinkError(f"method={method!r} needs calibration text: pass data= (--data FILE), a few "
                                  "thousand tokens like the text the model will serve.")
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(src)
            ids = calibration_ids(data, tokenizer, calibration_tokens, seq_len,
                                  min_tokens(layout.num_experts, layout.top_k))
        result = ShrinkResult(resolve_output_directory(out, "Cannot write the shrunk model to"), layout.kind, method,
                              scope, layout.num_experts, keep, layout.top_k, new_top_k,
                              calibration_tokens=0 if ids is None else ids.numel())
        run = kind(layout, keep, seed=seed, progress=progress, search_candidates=search_candidates)
        with staging_directory(result.path) as staging, ShrunkWriter(layout, staging, keep, max_shard_size) as writer:
            writer.copy_unchanged()
            if scope == "global":
                run.fixed = run.choose_globally(ids)
            result.layers, result.search = run.apply(writer, ids)
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
