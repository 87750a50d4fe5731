"""Native export: write an hf_moe model as transformers' own MoE architecture, for tools that never heard of hf_moe.

    llama, mistral -> mixtral     (MixtralForCausalLM; every layer MoE, renormalised top-k)
    qwen3          -> qwen3_moe   (Qwen3MoeForCausalLM; dense layers through `mlp_only_layers`)
    llama, qwen2 with one sigmoid-gated shared expert (a merge with `architecture: qwen`)
                   -> qwen2_moe   (Qwen2MoeForCausalLM; dense layers through `mlp_only_layers`)
    olmo2          -> flex_olmo   (FlexOlmoForCausalLM; every layer MoE)

An export is offered only where the native model computes the same function as the hf_moe model: the same
attention, norms and embeddings (the base family's, which the native MoE family shares), the same router (linear
logits, softmax over the experts in fp32, top-k, renormalised where hf_moe renormalises) and the same experts
(SiLU-gated, no biases, fused `gate_up_proj [E, 2I, H]` with gate rows first, `down_proj [E, H, I]`). Anything
else (another router, capacity and dropping, plain or biased experts, MoE in only some layers where the native
family has no dense layers, a family without a native MoE twin) is a `NativeExportError` that lists every reason
and what would make the model fit.

Route: a native config is built from the base config's fields plus the MoE fields (from config.json alone, so a
model that does not fit is refused before any weight is read); the weights are then written tensor by tensor in
the native family's on-disk layout (`hf_moe.export_files`: Mixtral's `block_sparse_moe.experts.{e}.w1/w2/w3`,
Qwen3-MoE's `mlp.experts.{e}.gate_proj/...`, what transformers' own `save_pretrained` writes), never holding the
model: an export takes the memory of one tensor, not of the model. The export is then loaded back with transformers
and run on a random probe after the hf_moe model (one model in memory at a time); the max logit difference goes into
the model card.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, GenerationConfig, PreTrainedConfig

from .checkpoint import (
    TOKENIZER_FILES,
    checkpoint_config,
    checkpoint_file,
    copy_files,
    reading,
    resolve_output_directory,
    same_directory,
    staging_directory,
    validate_checkpoint,
)
from .checkpoint.commit import commit
from .compat import MODEL_FOR_CAUSAL_LM_MAPPING
from .configuration import MoEConfig
from .export_files import (
    DirectorySource,
    ModelSource,
    NativeLayout,
    check_written,
    native_outputs,
    parameter_counts,
    write_weights,
)
from .export_verify import dot_width, hf_moe_logits, logit_tolerance, native_logits, verified_layers
from .model_card import render_native_card
from .modeling import MoEForCausalLM


class NativeExportError(ValueError):
    """The model cannot be written as a native transformers architecture that computes the same function."""


def _uniform_attention_window(base: dict) -> tuple[dict, list[str]]:
    """Qwen3 chooses sliding or full attention per layer (`layer_types`, from `max_window_layers`); Qwen3-MoE has
    one `sliding_window` for every layer. Fits when every layer attends the same way."""
    window = base.get("sliding_window")
    kinds = base.get("layer_types") or ["full_attention"]
    windows = {window if kind == "sliding_attention" else None for kind in kinds}
    if len(windows) > 1:
        return {}, [
            f"layer_types={base['layer_types']} mixes sliding ({window}) and full attention; qwen3_moe uses one "
            "sliding window for all layers. Only a Qwen3 whose layers all attend alike (use_sliding_window=False, "
            "or max_window_layers=0) exports."
        ]
    (window,) = windows
    return {"use_sliding_window": window is not None, "sliding_window": window}, []


@dataclass(frozen=True)
class NativeTarget:
    """How one dense family's MoE model maps onto a native transformers MoE architecture.

    model_type: the native model type ("mixtral").
    experts_field: the native config field for the number of experts.
    dense_layers: the native config can keep chosen layers dense (`mlp_only_layers`); else every layer must be MoE.
    norm_topk_prob_field: renormalising the top-k weights is a native config field; else the native router always
        renormalises, and the hf_moe model must too.
    fixed: native fields set to a value that matches hf_moe's `topk` router.
    required: base fields the native family has no counterpart for -> (the value that fits, why).
    dropped: base fields the native config does not declare and does not need -> why.
    passed: base fields the native modeling code reads although its config class does not declare them.
    attention: base fields -> (native attention fields, problems), where the two families express attention
        differently.
    layout: the on-disk names of the native checkpoints (the Hub's; transformers converts them on load).
    """

    model_type: str
    experts_field: str = "num_experts"
    dense_layers: bool = False
    norm_topk_prob_field: bool = True
    fixed: Mapping[str, object] = field(default_factory=dict)
    required: Mapping[str, tuple[object, str]] = field(default_factory=dict)
    dropped: Mapping[str, str] = field(default_factory=dict)
    passed: tuple[str, ...] = ()
    attention: Callable[[dict], tuple[dict, list[str]]] | None = None
    layout: NativeLayout = NativeLayout(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")
    shared_expert: bool = False  # one sigmoid-gated shared expert in every MoE layer (Qwen2-MoE)


_MIXTRAL = dict(
    model_type="mixtral",
    layout=NativeLayout(block="block_sparse_moe", gate="w1", up="w3", down="w2"),  # the Hub's Mixtral checkpoints
    experts_field="num_local_experts",
    norm_topk_prob_field=False,
    fixed={"router_jitter_noise": 0.0},  # hf_moe's topk router has no input jitter
)
TARGETS: dict[str, NativeTarget] = {
    "llama": NativeTarget(
        **_MIXTRAL,
        required={"attention_bias": (False, "Mixtral's attention projections have no biases")},
        dropped={
            "pretraining_tp": "unused by transformers 5.x's Llama",
            "mlp_bias": "every MLP is an expert here, and expert biases are checked as expert_bias",
        },
    ),
    "mistral": NativeTarget(**_MIXTRAL, dropped={"layer_types": "MistralModel ignores it, as MixtralModel does"}),
    "qwen3": NativeTarget(
        model_type="qwen3_moe",
        dense_layers=True,
        dropped={"max_window_layers": "folded into sliding_window", "layer_types": "folded into sliding_window"},
        passed=("head_dim",),  # Qwen3MoeAttention reads config.head_dim; Qwen3MoeConfig does not declare it
        attention=_uniform_attention_window,
    ),
    "olmo2": NativeTarget(model_type="flex_olmo"),
}
# One sigmoid-gated shared expert per MoE layer (hf-moe merge, architecture: qwen): Qwen2-MoE computes exactly that.
_QWEN2_MOE = dict(
    model_type="qwen2_moe",
    dense_layers=True,
    shared_expert=True,
    layout=NativeLayout(block="mlp", gate="gate_proj", up="up_proj", down="down_proj", shared_expert="shared_expert"),
    passed=("head_dim",),
)
SHARED_EXPERT_TARGETS: dict[str, NativeTarget] = {
    "llama": NativeTarget(
        **_QWEN2_MOE,
        fixed={"qkv_bias": False},
        required={"attention_bias": (False, "Qwen2-MoE's output projection has no bias")},
        dropped={"pretraining_tp": "unused by transformers 5.x's Llama",
                 "mlp_bias": "every MLP is an expert here, and expert biases are checked as expert_bias"},
    ),
    "qwen2": NativeTarget(**_QWEN2_MOE, fixed={"qkv_bias": True}, attention=_uniform_attention_window,
                          dropped={"max_window_layers": "folded into sliding_window",
                                   "layer_types": "folded into sliding_window"}),
}
# Families with a native MoE relative that is NOT the same function, and why: part of the error message.
NO_TARGET_WHY = {
    "qwen2": "qwen2_moe adds a sigmoid-gated shared expert to every MoE layer, and this model has none. Only a "
    "zero-width one (shared_expert_intermediate_size=0) would add exactly zero, and that is a degenerate checkpoint "
    "of empty tensors that serving stacks are not built for; zero weights would declare a shared expert that is not "
    "there. A merge with one gated shared expert (hf-moe merge, architecture: qwen) exports",
    "phi3": "phimoe routes with sparsemixer and uses LayerNorm, not RMSNorm",
}
# Keys of a config's to_dict() that describe the file, not the model.
_BOOKKEEPING = ("model_type", "transformers_version", "architectures", "_name_or_path", "output_attentions", "auto_map",
                "hf_moe_package")


def _is_metadata(name: str) -> bool:
    """A base config field that does not change what the model computes, carried into the native config as it is:
    private bookkeeping a loader adds (`_model_name_or_path`, from transformers' GGUF loader) and special-token ids
    (`unk_token_id`), which only the tokenizer and `generate` read."""
    return name.startswith("_") or name.endswith(("_token_id", "_token_ids"))


@dataclass
class NativeExport:
    """What `export_native` wrote: where, as which architecture, and how closely it reproduces the hf_moe model."""

    path: Path
    model_type: str
    architecture: str
    max_abs_logit_diff: float | None = None
    same_argmax: bool | None = None
    probe: str | None = None
    tensors_checked: int | None = None  # tensors read back and found equal to the hf_moe model's, bit for bit
    verified_layers: tuple[int, int] | None = None  # (decoder layers the logits were compared on, of the model's)


# --------------------------------------------------------------------------------------------------------------
# Does it fit?
# --------------------------------------------------------------------------------------------------------------
def native_target(config: MoEConfig) -> NativeTarget | None:
    """The native family of `config`: Qwen2-MoE for a sigmoid-gated shared expert, else the base family's twin."""
    if config.num_shared_experts and getattr(config, "shared_expert_gate", False):
        return SHARED_EXPERT_TARGETS.get(config.base_model_type)
    return TARGETS.get(config.base_model_type)


def export_problems(config: MoEConfig) -> list[str]:
    """Every reason the model of `config` has no exact native twin, each with what would fix it (empty: it has)."""
    target = native_target(config)
    problems = [] if target is not None else [_no_target(config.base_model_type)]
    problems += _routing_problems(config, target)
    problems += _expert_problems(config, target)
    if target is not None:
        problems += _layout_problems(config, target)
        problems += _base_fields(config, target)[1]
    return problems


def _no_target(base_model_type: str) -> str:
    families = ", ".join(f"{src} -> {t.model_type}" for src, t in TARGETS.items())
    why = f" ({NO_TARGET_WHY[base_model_type]})" if base_model_type in NO_TARGET_WHY else ""
    return (
        f"`{base_model_type}` has no native transformers MoE architecture that computes the same function{why}. "
        f"Native export supports {families}. Keep this model in hf_moe's format (load it after `import hf_moe`)."
    )


def _routing_problems(config: MoEConfig, target: NativeTarget | None) -> list[str]:
    problems = []
    if config.router_type != "topk":
        problems.append(
            f"router_type={config.router_type!r}: native MoE models route by softmax top-k; only hf_moe's 'topk' "
            "router exports. Convert with router_type='topk' (the default)."
        )
    for name in ("capacity_factor", "eval_capacity_factor"):
        if getattr(config, name) is not None:
            problems.append(
                f"{name}={getattr(config, name)}: tokens over an expert's capacity are dropped, and native MoE models "
                "are dropless. Convert dropless (capacity_factor=None, eval_capacity_factor=None)."
            )
    if config.router_weights != "softmax":
        problems.append(
            f"router_weights={config.router_weights!r}: native MoE models weight each chosen expert by its router "
            "probability. Only router_weights='softmax' exports (method='split' defaults to 'unit'; convert with "
            "router_weights='softmax' for an exportable, though no longer exact, split)."
        )
    if getattr(config, "router_skip_threshold", 0.0):
        problems.append(
            f"router_skip_threshold={config.router_skip_threshold}: native MoE models compute every chosen expert "
            "(no dynamic skipping). Set config.router_skip_threshold=0 (an inference option) and export again."
        )
    if target is not None and not target.norm_topk_prob_field and not config.norm_topk_prob:
        problems.append(
            f"norm_topk_prob=False: {target.model_type} always renormalises the top-k weights. Convert with "
            "norm_topk_prob=True (the default)."
        )
    return problems


def _expert_problems(config: MoEConfig, target: NativeTarget | None = None) -> list[str]:
    problems = []
    if getattr(config, "adapter_experts", None) is not None:
        problems.append(
            "adapter_experts: each expert is the frozen dense MLP plus an adapter, held apart; materialize them into "
            "plain experts first (`hf-moe materialize DIR OUT`, or hf_moe.materialize) and export the result."
        )
    if not config.expert_glu:
        problems.append(
            "expert_glu=False: the experts are plain MLPs; native MoE experts are gated (SiLU GLU). Only a base "
            "model with a gated MLP converts to exportable experts."
        )
    if config.expert_hidden_act != "silu":
        problems.append(
            f"expert_hidden_act={config.expert_hidden_act!r}: native MoE experts (and the serving stacks' fused MoE "
            "kernels) use SiLU. Only a SiLU base model exports."
        )
    if config.expert_bias:
        problems.append("expert_bias=True: native MoE experts have no biases. Only a base MLP without biases exports.")
    if target is not None and target.shared_expert:
        if config.num_shared_experts != 1:
            problems.append(f"num_shared_experts={config.num_shared_experts}: {target.model_type} has exactly one.")
    elif config.num_shared_experts:
        problems.append(
            f"num_shared_experts={config.num_shared_experts}: {', '.join(t.model_type for t in TARGETS.values())} "
            "have no always-active shared expert (qwen2_moe's is sigmoid-gated, a different function). Convert "
            "without shared experts."
        )
    if config.moe_output_bias:
        problems.append(
            "moe_output_bias=True: the block adds the dense MLP's output bias after the experts; native MoE blocks "
            "have no bias. Only a base MLP without biases exports."
        )
    if config.moe_output_dropout:
        problems.append(
            f"moe_output_dropout={config.moe_output_dropout}: native MoE blocks have no output dropout. Set "
            "config.moe_output_dropout=0 (it acts in training only) and export again."
        )
    if config.moe_bypassed_paths:
        problems.append(
            f"moe_bypassed_paths={config.moe_bypassed_paths}: the dense MLP was written inline in the decoder layer; "
            "native MoE families keep it in `mlp`."
        )
    return problems


def _layout_problems(config: MoEConfig, target: NativeTarget) -> list[str]:
    problems = []
    if (config.decoder_layers_path, config.moe_block_path) != ("model.layers", "mlp"):
        problems.append(
            f"decoder_layers_path={config.decoder_layers_path!r}, moe_block_path={config.moe_block_path!r}: "
            f"{target.model_type} keeps its MoE blocks at model.layers[i].mlp."
        )
    num_layers = config.get_text_config().num_hidden_layers
    if not target.dense_layers and config.moe_layers != list(range(num_layers)):
        problems.append(
            f"MoE in layers {config.moe_layers} of {num_layers}: {target.model_type} has an MoE block in every "
            "layer. Convert all layers (layers=None, every=None)."
        )
    return problems


def _base_fields(config: MoEConfig, target: NativeTarget) -> tuple[dict, list[str]]:
    """(the base config fields the native config takes, problems with the rest)."""
    base = {k: v for k, v in config.to_base_config().to_dict().items() if k not in _BOOKKEEPING}
    native_class = type(AutoConfig.for_model(target.model_type))
    declared = set(native_class.__dataclass_fields__) | set(PreTrainedConfig.__dataclass_fields__)
    fields, problems = {}, []
    for name, value in base.items():
        if name in target.required:
            fits, why = target.required[name]
            if value != fits:
                problems.append(f"{name}={value!r}: {why}; only {name}={fits!r} exports.")
        elif name in declared or name in target.passed or _is_metadata(name):
            fields[name] = value
        elif name not in target.dropped:
            problems.append(
                f"config field {name}={_short(value)} of `{config.base_model_type}` has no counterpart in "
                f"{target.model_type}, so an exact export cannot carry it. If it does not change what the model "
                "computes, delete it from the checkpoint's config.json and export again; otherwise keep this model "
                "in hf_moe's format."
            )
    if target.attention is not None:
        attention, attention_problems = target.attention(base)
        fields.update(attention)
        problems += attention_problems
    return fields, problems


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------------------------------------------
# Native config and model
# --------------------------------------------------------------------------------------------------------------
def native_config(config: MoEConfig) -> PreTrainedConfig:
    """The native MoE config that describes the same model as `config` (raises `NativeExportError` if none does).

    Base fields (rope, sliding window, head_dim, norms' eps, special tokens, tie_word_embeddings, ...) are carried
    as they are; the MoE fields are set from hf_moe's.
    """
    problems = export_problems(config)
    if problems:
        raise NativeExportError(
            f"This {config.base_model_type} MoE model cannot be exported as a native transformers architecture:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    target = native_target(config)
    fields, _ = _base_fields(config, target)
    fields.update(target.fixed)
    fields[target.experts_field] = config.num_experts
    fields.update(
        num_experts_per_tok=config.num_experts_per_tok,
        router_aux_loss_coef=config.router_aux_loss_coef,
        output_router_logits=config.output_router_logits,
    )
    if target.norm_topk_prob_field:
        fields["norm_topk_prob"] = config.norm_topk_prob
    if target.shared_expert:
        fields["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    if target.dense_layers:  # dense layers keep the base intermediate_size
        moe_layers = set(config.moe_layers)
        fields.update(
            moe_intermediate_size=config.moe_intermediate_size,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(config.get_text_config().num_hidden_layers) if i not in moe_layers],
        )
    else:
        fields["intermediate_size"] = config.moe_intermediate_size
    return AutoConfig.for_model(target.model_type, **fields)


# --------------------------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------------------------
def export_native(
    moe_model_or_dir: MoEForCausalLM | str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    verify: bool | str = True,
    max_shard_size: int | str = "5GB",
) -> NativeExport:
    """Write an hf_moe model as the closest native transformers MoE architecture that computes the same function.

    Args:
        moe_model_or_dir: an `MoEForCausalLM`, or a directory saved by hf_moe (its files are verified against their
            checksums first, as on every load).
        out_dir: the output directory. Written atomically; unrelated files already there are kept.
        verify: True (default): read every tensor written back and compare it with the hf_moe model's, bit for bit,
            and compare the logits of the hf_moe model and of the export loaded by plain transformers, both cut to
            their first decoder layers, on a 2x16 random probe (see `hf_moe.export_verify`). "full": compare the
            whole models' logits (one loaded after the other; about twice the model's size in memory). False: no
            check. In fp32 and fp64 a difference beyond `hf_moe.export_verify.logit_tolerance` (fp32 rounding) is an
            error; the measured difference goes into the model card.
        max_shard_size: the largest weight file, as for `save_pretrained`.
    Returns:
        A `NativeExport` (path, model type, architecture, what was checked and the measured difference).
    Raises:
        NativeExportError: listing every reason the model has no exact native twin, and what would fix each.

    The weights are written tensor by tensor (`hf_moe.export_files`): exporting a directory never holds the model,
    and takes at most 1.5x the model's size in memory with the default check (docs/exporting.md). The folder holds
    config.json, generation_config.json, the safetensors weights in the native layout, the base model's tokenizer
    files when the source has them, and a README.md model card. It loads with
    `AutoModelForCausalLM.from_pretrained(out_dir)` in plain transformers, without hf_moe.
    """
    if verify not in (True, False, "full"):
        raise ValueError(f"verify must be True, False or 'full', got {verify!r}.")
    target = resolve_output_directory(out_dir, "Cannot export to")
    moe, source_dir = _source(moe_model_or_dir, target)
    with reading(source_dir) if moe is None else contextlib.nullcontext():  # one checkpoint, even during a save
        return _export(moe, source_dir, target, verify, max_shard_size)


def _export(moe: MoEForCausalLM | None, source_dir: str | None, target: Path, verify: bool | str,
            max_shard_size: int | str) -> NativeExport:
    # Every reason it cannot export, from config.json alone: before any weight is read or anything written.
    config = moe.config if moe is not None else checkpoint_config(source_dir)
    native = native_config(config)
    if moe is None:
        validate_checkpoint(source_dir, verify_checksums=None)  # a corrupt input is refused, not exported
        source = DirectorySource(Path(source_dir))
        dtype = _config_dtype(config, source)
    else:
        source = ModelSource(moe)
        dtype = moe.dtype
    native.architectures = [_native_class(native).__name__]
    native.dtype = str(dtype).removeprefix("torch.")

    with staging_directory(target) as staging:
        outputs = native_outputs(source.shapes, config, native_target(config).layout)
        write_weights(source, outputs, staging, max_shard_size)
        native.save_pretrained(staging)
        _generation_config(moe, source_dir, native).save_pretrained(staging)
        _copy_tokenizer_files(source_dir or (moe.config.name_or_path if moe is not None else None), staging)
        result = NativeExport(target, native.model_type, native.architectures[0])
        if verify:
            _verify(source, outputs, config, native, staging, dtype, verify == "full", result)
        counts = moe.parameter_counts() if moe is not None else parameter_counts(source.shapes, config)
        (staging / "README.md").write_text(render_native_card(config, counts, dtype, native, result))
        commit(staging, target)
    return result


def _source(moe_model_or_dir, target: Path) -> tuple[MoEForCausalLM | None, str | None]:
    """The hf_moe model if one was passed (else None: the export reads the directory), and the directory it came
    from (for its tokenizer files), if any. The export must not replace that directory."""
    if isinstance(moe_model_or_dir, MoEForCausalLM):
        model, path = moe_model_or_dir, moe_model_or_dir.config.name_or_path
        path = path if path and os.path.isdir(path) else None
    elif isinstance(moe_model_or_dir, (str, os.PathLike)):
        model, path = None, os.fspath(moe_model_or_dir)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path} has no config.json: it is not a saved hf_moe model.")
    else:
        raise TypeError(
            f"export_native takes an hf_moe MoEForCausalLM or the directory it was saved to, got "
            f"{type(moe_model_or_dir).__name__}. Convert a dense model first with hf_moe.convert_to_moe."
        )
    if path is not None and same_directory(path, target):
        raise NativeExportError(f"Export to a new directory: {target} holds the hf_moe model being exported.")
    return model, path


def _native_class(config: PreTrainedConfig) -> type:
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    return model_class[0] if isinstance(model_class, (list, tuple)) else model_class


def _config_dtype(config: MoEConfig, source: DirectorySource) -> torch.dtype:
    """The dtype the checkpoint was saved in (config.json's `dtype`, else that of most of its bytes)."""
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else source.reader.float_dtype()


def _generation_config(moe: MoEForCausalLM | None, source_dir: str | None, native: PreTrainedConfig):
    """The hf_moe model's generation config (its generation_config.json, else the one its config implies), as
    `save_pretrained` of the native model writes it."""
    if moe is not None and moe.generation_config is not None:
        return moe.generation_config
    if source_dir is not None and (Path(source_dir) / "generation_config.json").is_file():
        checkpoint_file(source_dir, "generation_config.json", "the export")  # a link out of the directory is refused
        return GenerationConfig.from_pretrained(source_dir)
    return GenerationConfig.from_model_config(native)


def _copy_tokenizer_files(source_dir: str | None, out: Path) -> None:
    """Copy the tokenizer files of `source_dir` byte for byte (a round trip through a tokenizer class could change
    them), through the guarded opener: a link out of the checkpoint, a FIFO or an oversized file is left out, with
    a warning."""
    if not source_dir or not os.path.isdir(source_dir):
        return
    _, refused = copy_files(source_dir, TOKENIZER_FILES, out, "the checkpoint")
    for line in refused:
        warnings.warn(f"A tokenizer file was not exported: {line}", stacklevel=3)


# --------------------------------------------------------------------------------------------------------------
# Verification
# --------------------------------------------------------------------------------------------------------------
def _verify(source, outputs, config: MoEConfig, native: PreTrainedConfig, directory: Path, dtype: torch.dtype,
            full: bool, result: NativeExport) -> None:
    """Check the export (see `hf_moe.export_verify`) and record what was found in `result`.

    A tensor that differs from its source, a tensor transformers does not find or does not use, or in fp32 (and
    fp64) a logit difference beyond `logit_tolerance` (what rounding explains), means the export is wrong: an error
    rather than a card that says otherwise. In half precision the routers round their logits differently (see the
    card), so the difference is recorded, not judged.
    """
    wrong = check_written(source, outputs, directory)
    if wrong:
        raise NativeExportError(
            f"{len(wrong)} tensors of the export differ from the hf_moe model's after writing ({wrong[:6]}): the disk "
            "or the file system corrupted them. Nothing was exported; try again, on another disk if it recurs."
        )
    result.tensors_checked = len(outputs)
    n = verified_layers(config, full)
    probe, expected = hf_moe_logits(source, config, n, dtype)
    got, problems = native_logits(directory, native, n, dtype, probe)
    if problems:
        raise NativeExportError(
            f"transformers does not read the exported {result.architecture} as the hf_moe model: tensors {problems}. "
            "This is a bug in hf_moe's export; please report it with the model's config.json."
        )
    result.verified_layers = (n, config.num_hidden_layers)
    result.max_abs_logit_diff = (got - expected).abs().max().item()
    result.same_argmax = bool(torch.equal(got.argmax(-1), expected.argmax(-1)))
    result.probe = f"{probe.shape[0]}x{probe.shape[1]} random tokens, {str(dtype).removeprefix('torch.')}, eval mode"
    width = dot_width(config)
    bound = logit_tolerance(expected.abs().max().item(), width)
    if dtype in (torch.float32, torch.float64) and not result.max_abs_logit_diff <= bound:
        raise NativeExportError(
            f"The exported {result.architecture} does not reproduce the hf_moe model: max |logit difference| "
            f"{result.max_abs_logit_diff:.3e} on a random probe through {n} of {config.num_hidden_layers} layers, "
            f"allowed {bound:.1e} (8 * 2**-24 * sqrt({width}) * max(1, max |logit|): rounding). This is a bug in "
            "hf_moe's export; please report it with the model's config.json."
        )
