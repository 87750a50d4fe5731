"""Refusals before any weight is read: every source model must be the base model's architecture, with its shapes,
its vocabulary and its tokenizer. Only config.json, the safetensors headers and the tokenizer files are read.

Each refusal is a `MergeSourceError` (a ValueError: `hf-moe merge` exits with status 2) naming the source, the
mismatch and both values.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig

from ..checkpoint import CheckpointError
from ..checkpoint.hub import is_hub_id, resolve_checkpoint
from .api import _check_model_type
from .merge_config import MergeConfig
from .stream import StreamingUnsupported, _SafetensorsSource

# Config fields that fix the tensors' shapes or what the layers compute, compared between every source and the base.
SHAPE_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "vocab_size", "hidden_act", "tie_word_embeddings", "n_embd", "n_layer", "n_head", "n_inner", "ffn_dim",
)


class MergeSourceError(ValueError):
    """A source model cannot be merged with the others (architecture, shape, vocabulary or tokenizer)."""


@dataclass
class Source:
    """One model directory of the merge: its config, tensors (headers only) and the model keys -> file keys map."""

    path: str
    config: PreTrainedConfig
    tensors: _SafetensorsSource
    names: dict[str, str]


def open_sources(recipe: MergeConfig, dtype: torch.dtype | None = None) -> dict[str, Source]:
    """{path: Source} for the base model and every expert, after checking them all against the base.

    Raises `MergeSourceError` (or FileNotFoundError) naming the first mismatch; no weight has been read then.
    """
    paths = recipe.sources()
    configs = {p: _config(p) for p in paths}
    base = configs[recipe.base_model]
    for path in paths[1:]:
        _compare_configs(recipe.base_model, base, path, configs[path])
    _check_architecture(recipe, base)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(base, dtype=dtype or torch.float32)
    shapes = {k: t.shape for k, t in meta.state_dict().items()}
    sources = {}
    for path in paths:
        try:
            tensors = _SafetensorsSource(Path(path))
            names = tensors.match(meta)
        except StreamingUnsupported as why:
            raise MergeSourceError(
                f"{path}: {why}. hf_moe merges safetensors checkpoints: re-save the model with "
                "save_pretrained(..., safe_serialization=True)."
            ) from None
        for key, name in names.items():
            stored = tensors.dtype_shape(name)[1]
            if stored != shapes[key]:
                raise MergeSourceError(
                    f"shape mismatch: {path} stores {name} as {list(stored)}, the base model "
                    f"{recipe.base_model} has {list(shapes[key])}. Merge only fine-tunes of one base model."
                )
        sources[path] = Source(path, configs[path], tensors, names)
    _check_tokenizers(recipe.base_model, paths[1:])
    return sources


def localize(recipe: MergeConfig) -> MergeConfig:
    """`recipe` with every Hub id (`org/name`, or mergekit's `org/name@revision`, that is not a local directory)
    replaced by its local snapshot in huggingface_hub's cache (`resolve_checkpoint`: downloaded once, unless
    offline; the config, safetensors and tokenizer files)."""
    paths = {}
    for path in recipe.sources():
        repo, _, revision = path.partition("@")
        if os.path.isdir(path) or not is_hub_id(repo):
            continue
        try:
            paths[path] = resolve_checkpoint(repo, revision=revision or None)
        except (FileNotFoundError, CheckpointError):
            raise
        except Exception as err:  # no such repository or revision, gated, no network
            raise FileNotFoundError(
                f"{path} is not a local directory and could not be fetched from the Hub ({type(err).__name__}: "
                f"{err}). Download it first, or name a local directory."
            ) from None
    if not paths:
        return recipe
    recipe = copy.deepcopy(recipe)
    recipe.base_model = paths.get(recipe.base_model, recipe.base_model)
    for spec in [*recipe.experts, *recipe.shared_experts]:
        spec.source_model = paths.get(spec.source_model, spec.source_model)
    return recipe


def _config(path: str) -> PreTrainedConfig:
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"No model at {path!r}: hf_moe merges local model directories (download Hub models first)."
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path} has no config.json: it is not a saved Hugging Face model.")
    config = AutoConfig.from_pretrained(path)
    try:
        _check_model_type(config, path)
    except ValueError as err:
        raise MergeSourceError(str(err)) from None
    return config


def _compare_configs(base_path: str, base: PreTrainedConfig, path: str, config: PreTrainedConfig) -> None:
    if config.model_type != base.model_type:
        raise MergeSourceError(
            f"architecture mismatch: {path} is a `{config.model_type}` model, the base model {base_path} a "
            f"`{base.model_type}` one. Every source must be a fine-tune of the base model."
        )
    a, b = base.get_text_config(), config.get_text_config()
    for name in SHAPE_FIELDS:
        if getattr(a, name, None) != getattr(b, name, None):
            what = "vocabulary" if name == "vocab_size" else "shape"
            raise MergeSourceError(
                f"{what} mismatch: {path} has {name}={getattr(b, name, None)!r}, the base model {base_path} "
                f"{name}={getattr(a, name, None)!r}. Every source must be a fine-tune of the base model."
            )


def _check_architecture(recipe: MergeConfig, base: PreTrainedConfig) -> None:
    if recipe.architecture == "qwen" and recipe.shared is None and base.model_type != "qwen3":
        raise MergeSourceError(
            f"architecture=qwen without shared_experts is Qwen3-MoE, which needs qwen3 sources (these are "
            f"`{base.model_type}`); Qwen2-MoE has exactly one shared expert: add shared_experts."
        )


def _tokenizer_vocab(path: str) -> dict[str, int] | None:
    """The token -> id map of the tokenizer in `path`, or None when it has none."""
    from transformers import AutoTokenizer

    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.isfile(os.path.join(path, n)) for n in names):
        return None
    try:
        return AutoTokenizer.from_pretrained(path).get_vocab()
    except (OSError, ValueError) as err:
        raise MergeSourceError(f"{path}: its tokenizer does not load ({err}).") from None


def _check_tokenizers(base_path: str, paths: list[str]) -> None:
    """Every source's tokenizer maps the same tokens to the same ids as the base model's (sources without a
    tokenizer are read with the base model's)."""
    base = _tokenizer_vocab(base_path)
    if base is None:
        return
    for path in paths:
        vocab = _tokenizer_vocab(path)
        if vocab is None or vocab == base:
            continue
        changed = sorted(t for t in set(base) | set(vocab) if base.get(t) != vocab.get(t))
        shown = ", ".join(f"{t!r}: {base.get(t)} -> {vocab.get(t)}" for t in changed[:3])
        raise MergeSourceError(
            f"tokenizer mismatch: {path}'s tokenizer differs from the base model {base_path}'s in {len(changed)} "
            f"token(s) ({shown}). Experts must read the same token ids."
        )
