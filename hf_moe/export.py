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

Route: a native config is built from the base config's fields plus the MoE fields; the native model is built from
it on the meta device and given the hf_moe model's own tensors (shared, not copied: the names match one to one); the
native model's own `save_pretrained` then writes the files, so they are exactly what transformers writes for that
architecture (Mixtral's `block_sparse_moe.experts.{e}.w1/w2/w3`, Qwen3-MoE's `mlp.experts.{e}.gate_proj/...`).
The export is then loaded back from disk and run on a random probe beside the hf_moe model; the max logit
difference goes into the model card.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig

from .checkpoint import (
    TOKENIZER_FILES,
    checkpoint_config,
    copy_files,
    reading,
    resolve_output_directory,
    same_directory,
    staging_directory,
)
from .checkpoint.commit import commit
from .configuration import MoEConfig
from .convert.api import _logits, _probe_input
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
    shared_expert: bool = False  # one sigmoid-gated shared expert in every MoE layer (Qwen2-MoE)
    renames: Mapping[str, str] = field(default_factory=dict)  # hf_moe name fragment -> native


_MIXTRAL = dict(
    model_type="mixtral",
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
    renames={".mlp.shared_experts.": ".mlp.shared_expert."},
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
    "zero-width one (shared_expert_intermediate_size=0) would add exactly zero, and that is a degenerate checkpoint of empty "
    "tensors that serving stacks are not built for; zero weights would declare a shared expert that is not there. A "
    "merge with one gated shared expert (hf-moe merge, architecture: qwen) exports",
    "phi3": "phimoe routes with sparsemixer and uses LayerNorm, not RMSNorm",
}
# Keys of a config's to_dict() that describe the file, not the model.
_BOOKKEEPING = ("model_type", "transformers_version", "architectures", "_name_or_path", "output_attentions", "auto_map")


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
    if target is not None and not target.norm_topk_prob_field and not config.norm_topk_prob:
        problems.append(
            f"norm_topk_prob=False: {target.model_type} always renormalises the top-k weights. Convert with "
            "norm_topk_prob=True (the default)."
        )
    return problems


def _expert_problems(config: MoEConfig, target: NativeTarget | None = None) -> list[str]:
    problems = []
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


def _native_model(moe: MoEForCausalLM, config: PreTrainedConfig) -> nn.Module:
    """The native model, built on the meta device, holding the hf_moe model's own tensors (shared, not copied).

    The names match one to one (`model.layers.{i}.mlp.gate.weight`, `...mlp.experts.gate_up_proj [E, 2I, H]`,
    `...down_proj [E, H, I]`, attention, norms, embeddings, and non-persistent buffers such as the rotary
    `inv_freq`). Every native tensor must find a source of the same shape and every source tensor a place: a
    leftover would be a weight the export silently drops.
    """
    with torch.device("meta"):
        native = AutoModelForCausalLM.from_config(config)
    source = {**dict(moe.named_parameters(remove_duplicate=False)), **dict(moe.named_buffers(remove_duplicate=False))}
    for old, new in native_target(moe.config).renames.items():
        source = {name.replace(old, new): tensor for name, tensor in source.items()}
    slots = {}
    for module_name, module in native.named_modules(remove_duplicate=False):
        for store in (module._parameters, module._buffers):
            for name, tensor in store.items():
                if tensor is not None:
                    slots[f"{module_name}.{name}" if module_name else name] = (store, name, tensor.shape)
    missing = sorted(set(slots) - set(source))
    unused = sorted(set(source) - set(slots))
    shapes = [
        f"{n}: {tuple(source[n].shape)} -> {tuple(shape)}"
        for n, (_, _, shape) in slots.items()
        if n in source and source[n].shape != shape
    ]
    if missing or unused or shapes:
        raise NativeExportError(
            f"The {type(native).__name__} built from the exported config does not hold exactly the hf_moe model's "
            f"tensors (this is a bug in hf_moe's export; please report it). Without a source: {missing[:8]}; "
            f"without a place: {unused[:8]}; shape mismatches: {shapes[:8]}."
        )
    for name, (store, attr, _) in slots.items():
        store[attr] = source[name]
    if moe.generation_config is not None:
        native.generation_config = copy.deepcopy(moe.generation_config)
    return native


# --------------------------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------------------------
def export_native(
    moe_model_or_dir: MoEForCausalLM | str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    verify: bool = True,
    max_shard_size: int | str = "5GB",
) -> NativeExport:
    """Write an hf_moe model as the closest native transformers MoE architecture that computes the same function.

    Args:
        moe_model_or_dir: an `MoEForCausalLM`, or a directory saved by hf_moe.
        out_dir: the output directory. Written atomically; unrelated files already there are kept.
        verify: load the written files back with transformers and compare their logits with the hf_moe model's on a
            2x16 random probe; the difference goes into the model card, and in fp32 a difference beyond rounding is
            an error. Loading needs memory for a second copy of the model: pass False to skip for very large models.
        max_shard_size: passed to the native `save_pretrained`.
    Returns:
        A `NativeExport` (path, model type, architecture, measured difference).
    Raises:
        NativeExportError: listing every reason the model has no exact native twin, and what would fix each.

    The folder holds config.json, generation_config.json, the safetensors weights in the native layout, the base
    model's tokenizer files when the source has them, and a README.md model card. It loads with
    `AutoModelForCausalLM.from_pretrained(out_dir)` in plain transformers, without hf_moe.
    """
    target = resolve_output_directory(out_dir, "Cannot export to")
    moe, source_dir = _source(moe_model_or_dir, target)
    with reading(source_dir) if moe is None else contextlib.nullcontext():  # config and weights of one checkpoint
        # Every reason it cannot export, from config.json alone: before any weight is read or anything written.
        config = native_config(moe.config if moe is not None else checkpoint_config(source_dir))
        if moe is None:  # (its checksums verified, as on every load: a corrupt input is refused, not exported)
            moe = MoEForCausalLM.from_pretrained(source_dir, dtype="auto")

    with staging_directory(target) as staging:
        native = _native_model(moe, config)
        native.save_pretrained(staging, max_shard_size=max_shard_size)
        result = NativeExport(target, config.model_type, type(native).__name__)
        del native
        _copy_tokenizer_files(source_dir or moe.config.name_or_path, staging)
        if verify:
            _measure(moe, staging, result)
        (staging / "README.md").write_text(render_native_card(moe, config, result))
        commit(staging, target)
    return result


def _source(moe_model_or_dir, target: Path) -> tuple[MoEForCausalLM | None, str | None]:
    """The hf_moe model if one was passed (else None: it is loaded once the config is known to export), and the
    directory it came from (for its tokenizer files), if any. The export must not replace that directory."""
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


def _copy_tokenizer_files(source_dir: str | None, out: Path) -> None:
    """Copy the tokenizer files of `source_dir` byte for byte (a round trip through a tokenizer class could change
    them), through the guarded opener: a link out of the checkpoint, a FIFO or an oversized file is left out, with
    a warning."""
    if not source_dir or not os.path.isdir(source_dir):
        return
    _, refused = copy_files(source_dir, TOKENIZER_FILES, out, "the checkpoint")
    for line in refused:
        warnings.warn(f"A tokenizer file was not exported: {line}", stacklevel=3)


@torch.no_grad()
def _measure(moe: MoEForCausalLM, directory: Path, result: NativeExport) -> None:
    """Load `directory` with transformers and compare its logits with the hf_moe model's on a random probe.

    In fp32 (and fp64) the two compute the same function up to summation order, so a difference beyond
    1e-4 * max(1, max |logit|) means the export is wrong: an error rather than a card that says otherwise. In half
    precision the routers round their logits differently (see the card), so the difference is recorded, not judged.
    """
    probe = _probe_input(moe)
    if probe is None:  # the model is on the meta device
        return
    native = AutoModelForCausalLM.from_pretrained(directory, dtype=moe.dtype).to(probe.device)
    expected, got = _logits(moe, probe), _logits(native, probe)
    del native
    result.max_abs_logit_diff = (got - expected).abs().max().item()
    result.same_argmax = bool(torch.equal(got.argmax(-1), expected.argmax(-1)))
    dtype = str(moe.dtype).removeprefix("torch.")
    result.probe = f"{probe.shape[0]}x{probe.shape[1]} random tokens, {dtype}, eval mode"
    bound = 1e-4 * max(1.0, expected.abs().max().item())
    if moe.dtype in (torch.float32, torch.float64) and not result.max_abs_logit_diff <= bound:
        raise NativeExportError(
            f"The exported {result.architecture} does not reproduce the hf_moe model: max |logit difference| "
            f"{result.max_abs_logit_diff:.3e} on a random probe (allowed {bound:.1e} in fp32). This is a bug in "
            "hf_moe's export; please report it with the model's config.json."
        )
