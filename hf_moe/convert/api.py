"""`convert_to_moe`: one call from a dense causal LM to an `MoEForCausalLM`."""

from __future__ import annotations

import copy
import math
import numbers
import os
import re
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel

from ..checkpoint import CheckpointError, load_tokenizer, read_bytes
from ..checkpoint.adapter_experts import adapter_block, base_reference, freeze_base
from ..compat import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_MASKED_LM_MAPPING_NAMES
from ..configuration import MoEConfig, _brief
from ..dense_mlp import DenseMLP, NoMLPFoundError, extract_mlp, find_decoder_layers, find_mlp
from ..layers import SparseMoeBlock
from ..layers.adapter_experts import ADAPTER_METHODS
from ..model_card import hub_model_id
from ..modeling import HEADS, MoEPreTrainedModel, base_head_class
from ..ops import use_backend
from .adapter_experts import ADAPTER_OPTIONS, METHOD_OPTION_NAMES, adapter_size, adapter_spec, check_adapter_options
from .estimate import check_memory, estimate_conversion
from .split import PARTITIONS, calibration_activations, calibration_text, split_block
from .upcycle import upcycle_block

METHODS = ("upcycle", "split", *ADAPTER_METHODS)
# Options of convert_to_moe beyond its named arguments, with their defaults.
OPTIONS: dict[str, Any] = {
    "every": None,  # MoE in layers i with (i + 1) % every == 0, as transformers' decoder_sparse_step
    "noise": 0.0,  # upcycle: relative std of the noise added to each expert copy
    "reinit_fraction": 0.0,  # upcycle: Drop-Upcycling, fraction of each expert's neurons re-initialised
    "seed": 0,  # router init and noise
    "dtype": None,  # torch dtype (or its name) to convert in
    "verify": True,  # measure the logit difference to the dense model on a random probe
    "partition": "kmeans",  # split: random | kmeans | coactivation
    "calibration_data": None,  # split + coactivation: local .txt/.json/.jsonl, read only as far as calibration_tokens
    "calibration_tokens": 2048,
    "tokenizer": None,  # for calibration_data when the model is passed as an object
    # lora / pesc: adapter experts (convert/adapter_experts.py); `r` is the PEFT name of `rank`
    **ADAPTER_OPTIONS,
    "r": None,
    # MoEConfig fields (see its docstring)
    "router_type": "topk",
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.01,
    "router_z_loss_coef": 0.0,
    "router_init_std": None,
    "capacity_factor": None,
    "eval_capacity_factor": None,
    "router_jitter_noise": 0.0,
    "num_prototypes": None,
    "router_bias_update_rate": 0.001,
    "router_weights": "softmax",
    "num_shared_experts": 0,
}
CONFIG_OPTIONS = [
    k for k in OPTIONS
    if k.startswith(("router_", "norm_", "capacity", "eval_capacity", "num_prototypes", "num_shared"))
]
# The papers' settings, used unless the caller sets the option.
ROUTER_DEFAULTS: dict[str, dict[str, Any]] = {
    # Renormalised over its one expert, a top-1 weight is p / p = 1 with no gradient: the router would learn nothing
    # from the LM loss. Unit weights (p / p.detach()) keep the value 1, so the upcycled model stays exact, and give
    # the router the gradient of log p (straight-through).
    "switch": {"capacity_factor": 1.25, "eval_capacity_factor": 2.0, "router_jitter_noise": 0.01,
               "norm_topk_prob": False, "router_weights": "unit"},
    "gshard": {"capacity_factor": 2.0, "eval_capacity_factor": 2.0},
    "aux_free": {"router_aux_loss_coef": 0.0},  # the bias does the balancing
}
# Each method's defaults, used unless the caller sets the option: a split expert is a part of the MLP, so the
# chosen parts add up with unit weights (MoEfication) rather than being averaged.
METHOD_DEFAULTS: dict[str, dict[str, Any]] = {"split": {"router_weights": "unit"}}
# Options recorded in `config.moe_conversion["options"]` (and the model card) when they differ from the default.
RECORDED_OPTIONS = (
    "noise", "reinit_fraction", "seed", "router_type", "partition", "calibration_data", "calibration_tokens",
    "num_shared_experts", "router_weights",
)
METHOD_OPTIONS = {
    "upcycle": ("noise", "reinit_fraction"),
    "split": ("partition", "calibration_data", "calibration_tokens", "tokenizer"),
    **METHOD_OPTION_NAMES,
}
_MOE_CONFIG_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def convert_to_moe(
    model_or_path: PreTrainedModel | str | os.PathLike,
    num_experts: int,
    top_k: int,
    method: str = "upcycle",
    layers: list[int] | None = None,
    *,
    inplace: bool = False,
    **options,
) -> MoEPreTrainedModel:
    """Turn a dense causal LM into an `MoEForCausalLM` (or a classifier of the family, a `...ForSequenceClassification`
    or `...ForTokenClassification`, into the MoE class of its head).

    Args:
        model_or_path: a loaded model, or a local directory / Hub id to load the causal LM from. A loaded model is
            left as it was (the MoE model is built on a copy of it) unless `inplace=True`.
        num_experts: experts per MoE layer.
        top_k: experts per token (`num_experts_per_tok`).
        method: "upcycle" (every expert a copy of the dense MLP, see `upcycle.py`), "split" (the MLP's neurons
            partitioned into experts, see `split.py`), or adapter experts (`adapter_experts.py`): "lora" (every
            expert the frozen MLP plus its own low-rank deltas, MixLoRA) or "pesc" (the frozen MLP's output plus
            each expert's bottleneck adapter, PESC); only their routers and adapters train.
        layers: decoder layers to convert (negative indices count from the end); default all. See `every`.
        inplace: convert the loaded model passed in itself, as FastMoE's `fmoefy` and PEFT's `get_peft_model` do:
            it becomes the MoE model (its attention, embeddings and norms are shared, not copied), which saves
            memory for a large model. Default False: the model passed in is not changed.
        **options (see `OPTIONS`):
            every, seed, dtype, verify;
            upcycle: noise, reinit_fraction (Drop-Upcycling);
            split: partition ("random", "kmeans", "coactivation"), calibration_data (a local .txt/.json/.jsonl
                file for "coactivation"), calibration_tokens, tokenizer (when the model is passed as an object);
            lora, pesc: rank (or r; default 16), lora_alpha (default 2 * rank; scaling lora_alpha / rank),
                lora_dropout; lora: target_modules (of gate_proj, up_proj, down_proj; default all the MLP has);
                pesc: adapter_act (default "gelu");
            MoEConfig fields: router_type, norm_topk_prob, router_aux_loss_coef, router_z_loss_coef,
                router_init_std, capacity_factor, eval_capacity_factor, router_jitter_noise, num_prototypes,
                router_bias_update_rate, router_weights, num_shared_experts.
            The switch and gshard routers default to their papers' capacity factors (1.25 and 2.0 in training, 2.0
            in eval), aux_free to no balancing loss; split defaults to router_weights="unit".
    Returns:
        The MoE model, in the mode (train/eval) the dense model was in.

    Exactness: upcycling with the defaults (renormalised top-k weights, no noise), adapter experts (zero B), and
    splitting with every expert chosen (top_k == num_experts, unit weights) reproduce the dense model's logits up to
    fp32 rounding. The
    difference measured on a random probe is stored in `config.moe_conversion`.
    """
    opts = resolve_options(num_experts, top_k, method, layers, options)
    _check_dense(model_or_path)
    dtype = _dtype(opts["dtype"])
    if isinstance(model_or_path, PreTrainedModel):
        model = model_or_path if inplace else copy.deepcopy(model_or_path)
        if dtype is not None:
            model.to(dtype)
        source = model.config.name_or_path or type(model).__name__  # a name for it: its path or Hub id
    else:
        source = os.fspath(model_or_path)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype if dtype is not None else "auto")
    was_training = model.training
    layers_path, decoder_layers = find_decoder_layers(model)
    moe_layers = _select_layers(layers, opts["every"], len(decoder_layers))
    spec = find_mlp(decoder_layers[moe_layers[0]])
    mlps = {i: extract_mlp(decoder_layers[i], find_mlp(decoder_layers[i]), model.config) for i in moe_layers}
    _check_uniform(mlps)
    first = mlps[moe_layers[0]]
    itemsize = first.up.element_size()
    if method in ADAPTER_METHODS:  # before an adapter exists: the rank sets their size (adapter_experts.py)
        check_memory(*adapter_size(adapter_spec(method, opts, first.glu), first, num_experts, len(moe_layers)))
    else:
        check_memory(estimate_conversion(  # before anything grows with the number of experts (estimate.py)
            sum(p.numel() for p in model.parameters()) * itemsize, first,
            _expert_sizes(method, first, num_experts, opts["num_shared_experts"]), num_experts, len(moe_layers),
            opts["num_shared_experts"], itemsize, 1 << 62,
        ), "`hf_moe.convert_checkpoint(src, out, ...)` (or `hf-moe convert` without --in-memory) streams the "
           "conversion from a directory of safetensors, one MLP at a time.")
    activations = None
    if method == "split" and opts["partition"] == "coactivation":
        tokenizer = _tokenizer(opts["tokenizer"], model_or_path)
        ids = calibration_text(opts["calibration_data"], tokenizer, opts["calibration_tokens"])
        blocks_at = {i: decoder_layers[i].get_submodule(spec.block_path) for i in moe_layers}
        activations = calibration_activations(model, blocks_at, mlps, ids)

    probe = _probe_input(model) if opts["verify"] else None
    dense_logits = _logits(model, probe) if probe is not None else None

    config = MoEConfig.from_base(model.config, **moe_fields(
        num_experts, top_k, method, opts, moe_layers, first, layers_path, spec,
        source=source, license=_license(model_or_path),
    ))
    generator = torch.Generator().manual_seed(opts["seed"])
    blocks = {}
    for i in tqdm(moe_layers, desc=progress_text(method, len(moe_layers), num_experts), leave=False):
        layer_acts = activations.pop(i) if activations is not None else None
        blocks[i] = convert_block(method, mlps.pop(i), config, opts, layer_acts, generator)
    dense_dtype = model.dtype
    moe = MoEPreTrainedModel.from_dense(model, config, blocks)
    if method in ADAPTER_METHODS:  # only the routers and adapters train; the checkpoint refers to the base
        freeze_base(moe)
        config.adapter_experts["base_model"] = base_reference(moe, source, dense_dtype)

    if dense_logits is not None:
        moe_logits = _logits(moe, probe)
        config.moe_conversion.update(
            max_abs_logit_diff=(moe_logits - dense_logits).abs().max().item(),
            same_argmax=bool(torch.equal(moe_logits.argmax(-1), dense_logits.argmax(-1))),
            probe=f"{probe.shape[0]}x{probe.shape[1]} random tokens, fp32 logits, eval mode",
        )
    moe.train(was_training)
    return moe


def resolve_options(num_experts, top_k, method: str, layers, options: dict) -> dict[str, Any]:
    """Every option's value (the caller's, else the router's and the method's defaults, else `OPTIONS`), after
    checking them all."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"convert_to_moe got unknown option(s) {unknown}; valid options: {sorted(OPTIONS)}.")
    if method not in METHODS:
        raise ValueError(f"Unknown conversion method {method!r}; choose one of {METHODS}.")
    opts = {
        **OPTIONS,
        **METHOD_DEFAULTS.get(method, {}),
        **ROUTER_DEFAULTS.get(options.get("router_type", "topk"), {}),
        **options,
    }
    _check_counts(num_experts, top_k)
    seed = opts["seed"]
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an int from 0 to 2**64 - 1 (torch's seed range), got {_brief(seed)}.")
    _check_method_options(method, options, opts)
    check_adapter_options(method, options, opts)
    if layers is not None and opts["every"] is not None:
        raise ValueError("Pass either `layers` or `every`, not both.")
    _dtype(opts["dtype"])
    return opts


def moe_fields(
    num_experts: int,
    top_k: int,
    method: str,
    opts: dict[str, Any],
    moe_layers: list[int],
    first: DenseMLP,
    layers_path: str,
    spec,
    *,
    source: str,
    license: str | None,
) -> dict[str, Any]:
    """The MoE fields of a conversion's config (`MoEConfig.from_base(base_config, **fields)`): the options, the expert
    shape read from `first` (the first converted MLP) and a record of the conversion."""
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        **{k: opts[k] for k in CONFIG_OPTIONS},
        moe_layers=moe_layers,
        **_expert_sizes(method, first, num_experts, opts["num_shared_experts"]),
        expert_glu=first.glu,
        expert_bias=first.has_bias,
        expert_hidden_act=first.act,
        moe_output_dropout=first.dropout,
        decoder_layers_path=layers_path,
        moe_block_path=spec.block_path,
        moe_bypassed_paths=list(spec.bypassed_paths),
        adapter_experts=adapter_spec(method, opts, first.glu) if method in ADAPTER_METHODS else None,
        moe_conversion={
            "method": method,
            "base_model": source,
            "base_model_hub_id": hub_model_id(source),  # the model card's `base_model`
            "license": license,
            "options": {k: _jsonable(opts[k]) for k in RECORDED_OPTIONS if opts[k] != OPTIONS[k]},
        },
    )


def convert_block(
    method: str,
    mlp: DenseMLP,
    config: MoEConfig,
    opts: dict[str, Any],
    activations: torch.Tensor | None,
    generator: torch.Generator,
    share_identical: bool = False,
) -> SparseMoeBlock:
    """One dense MLP -> its MoE block, by `method`. Layers must be converted in order with one `generator` for
    a conversion to be reproducible (streamed or not). `share_identical`: see `assemble_block`."""
    if method == "split":
        return split_block(mlp, config, opts["partition"], activations, generator=generator)
    if method in ADAPTER_METHODS:
        return adapter_block(mlp, config, generator)
    return upcycle_block(
        mlp, config, noise=opts["noise"], reinit_fraction=opts["reinit_fraction"], generator=generator,
        share_identical=share_identical,
    )


def progress_text(method: str, num_layers: int, num_experts: int) -> str:
    if method in ADAPTER_METHODS:
        return f"Adding {num_experts} {dict(lora='LoRA', pesc='PESC')[method]} adapter experts to {num_layers} MLPs"
    verb = {"upcycle": "Upcycling", "split": "Splitting", "merge": "Merging"}[method]
    return f"{verb} {num_layers} MLPs into {num_experts} experts"


def _check_counts(num_experts, top_k) -> None:
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}.")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int between 1 and num_experts={num_experts}, got {top_k!r}.")


def _check_method_options(method: str, given: dict, opts: dict) -> None:
    """Options of another method are an error, whatever their value, not silently ignored."""
    for other, names in METHOD_OPTIONS.items():
        own = METHOD_OPTIONS.get(method, ())
        misplaced = [n for n in names if other != method and n not in own and n in given]  # (a default value too)
        if misplaced:
            raise ValueError(f"{misplaced} only apply to method={other!r}; this conversion uses method={method!r}: "
                             "drop them, or choose that method.")
    for name, high, expected in (("reinit_fraction", 1.0, "between 0 and 1"), ("noise", math.inf, ">= 0 and finite")):
        value = opts[name]
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and 0.0 <= value <= high):  # (NaN fails every comparison)
            raise ValueError(f"{name} must be {expected}, got {value!r}.")
    if not isinstance(opts["num_shared_experts"], int) or opts["num_shared_experts"] < 0:
        raise ValueError(f"num_shared_experts must be an int >= 0, got {opts['num_shared_experts']!r}.")
    if method == "split":
        if opts["partition"] not in PARTITIONS:
            raise ValueError(f"Unknown partition {opts['partition']!r}; choose one of {PARTITIONS}.")
        if opts["partition"] == "coactivation" and opts["calibration_data"] is None:
            raise ValueError(
                "partition='coactivation' clusters neurons by how they fire on text: pass calibration_data=PATH "
                "(a local .txt, .json or .jsonl file with a `text` field)."
            )
        if opts["calibration_data"] is not None and opts["partition"] != "coactivation":
            raise ValueError("calibration_data is only used by partition='coactivation'.")
        if opts["calibration_data"] is not None and not os.path.isfile(opts["calibration_data"]):
            raise FileNotFoundError(f"calibration_data {opts['calibration_data']!r} is not a file.")


def _expert_sizes(method: str, mlp: DenseMLP, num_experts: int, num_shared: int) -> dict[str, Any]:
    """moe_intermediate_size, shared_expert_intermediate_size and moe_output_bias for the method.

    merge: every routed and shared expert is a whole MLP of size I.
    upcycle: the I neurons are cut into S + 1 slices: S shared experts, and routed experts copying the rest.
    split: the I neurons are cut into E + S equal experts; the MLP's output bias, added once per token, goes to
    the shared experts, or to the block (`moe_output_bias`) when there are none.
    """
    size = mlp.intermediate_size
    if method == "merge":  # every expert is a whole source MLP, and so is a shared expert (convert/merge.py)
        return {"moe_intermediate_size": size, "shared_expert_intermediate_size": size if num_shared else None}
    if method in ADAPTER_METHODS:  # every expert is the whole MLP (frozen) plus its adapter
        return {"moe_intermediate_size": size, "shared_expert_intermediate_size": None}
    if method == "upcycle":
        slice_size = size // (num_shared + 1)
        if num_shared and slice_size < 1:
            raise ValueError(f"num_shared_experts={num_shared} leaves no neurons of the {size} for the routed experts.")
        return {
            "moe_intermediate_size": size - num_shared * slice_size,
            "shared_expert_intermediate_size": slice_size if num_shared else None,
        }
    groups = num_experts + num_shared
    if size % groups:
        divisors = [g for g in range(2, min(size, 256) + 1) if size % g == 0]
        raise ValueError(
            f"method='split' cuts the MLP's {size} intermediate neurons into num_experts + num_shared_experts = "
            f"{groups} equal experts, and {groups} does not divide {size}. Totals that do: {divisors[:16]}."
        )
    return {
        "moe_intermediate_size": size // groups,
        "shared_expert_intermediate_size": size // groups if num_shared else None,
        "moe_output_bias": mlp.down_bias is not None and not num_shared,
    }


def _tokenizer(tokenizer, model_or_path):
    """The tokenizer for calibration text: the one given (object or path), else the model directory's."""
    from transformers import AutoTokenizer

    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    source = tokenizer if tokenizer is not None else model_or_path
    if isinstance(source, PreTrainedModel):
        source = source.config.name_or_path
    try:  # (a local directory's tokenizer files are read through the guarded opener)
        return load_tokenizer(source) if os.path.isdir(source) else AutoTokenizer.from_pretrained(os.fspath(source))
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(
            f"partition='coactivation' needs a tokenizer for the calibration text and none loads from "
            f"{source!r} ({err}); pass tokenizer=... (a tokenizer or its directory)."
        ) from err


def _dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"Unknown dtype {dtype!r}; use e.g. 'float32', 'bfloat16' or 'float16'.")
    return value


def _select_layers(layers, every, num_layers: int) -> list[int]:
    if every is not None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"`every` must be a positive int, got {every!r}.")
        return [i for i in range(num_layers) if (i + 1) % every == 0]
    if layers is None:
        return list(range(num_layers))
    chosen = set()
    for i in layers:
        if not isinstance(i, int) or not -num_layers <= i < num_layers:
            raise ValueError(
                f"Layer index {i!r} is out of range: the model has {num_layers} decoder layers (0..{num_layers - 1})."
            )
        chosen.add(i % num_layers)
    if not chosen:
        raise ValueError("`layers` is empty: choose at least one decoder layer.")
    return sorted(chosen)


def _check_model_type(config: PreTrainedConfig, what: str) -> None:
    name = config.model_type
    if name == MoEConfig.model_type:
        raise ValueError(f"{what} is already an hf_moe model.")
    if any(getattr(config, f, None) for f in _MOE_CONFIG_FIELDS):
        raise ValueError(f"{what} (`{name}`) is already a Mixture-of-Experts model; hf_moe converts dense models.")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{what} (`{name}`) is an encoder-decoder model; hf_moe converts decoder-only causal LMs.")
    if name in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        raise ValueError(f"{what} (`{name}`) is an encoder-only model; hf_moe converts decoder-only causal LMs.")
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"{what} (`{name}`) has no causal-LM class in transformers; hf_moe converts causal LMs.")


def _check_dense(model_or_path) -> None:
    """`model_or_path` is a dense causal LM (or a classifier of its family), or a path or Hub id whose config is one:
    checked before anything is copied or loaded."""
    if isinstance(model_or_path, PreTrainedModel):
        model = model_or_path
        _check_model_type(model.config, type(model).__name__)
        heads = [base_head_class(head, type(model.config)) for head in HEADS]
        if not isinstance(model, tuple(h for h in heads if h is not None)):
            names = ", ".join(h.__name__ for h in heads if h is not None)
            raise ValueError(
                f"Pass the causal LM or a classifier of the family ({names}), not {type(model).__name__}: hf_moe "
                "returns the same head over an MoE backbone."
            )
        return
    if not isinstance(model_or_path, (str, os.PathLike)):
        raise TypeError(f"Expected a PreTrainedModel or a path, got {type(model_or_path).__name__}.")
    path = os.fspath(model_or_path)
    if not os.path.exists(path) and not re.fullmatch(r"[\w.-]+/[\w.-]+", path):
        raise FileNotFoundError(f"No model at {path!r}: the directory does not exist.")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path} has no config.json: it is not a saved Hugging Face model.")
    try:
        config = AutoConfig.from_pretrained(path)
    except OSError as err:
        raise FileNotFoundError(f"Could not load a model config from {path!r}: {err}") from err
    _check_model_type(config, path)


def _check_uniform(mlps: dict[int, DenseMLP]) -> None:
    kinds = {m.kind for m in mlps.values()}
    if len(kinds) > 1:
        raise NoMLPFoundError(
            f"The chosen layers have different MLP shapes or activations ({sorted(kinds)}); convert layers of one "
            "kind at a time with `layers=[...]`."
        )


def _probe_input(model: nn.Module) -> torch.Tensor | None:
    param = next(model.parameters())
    if param.device.type == "meta":
        return None
    generator = torch.Generator().manual_seed(1234)
    vocab = model.config.get_text_config().vocab_size
    return torch.randint(0, vocab, (2, 16), generator=generator).to(model.device)


@torch.no_grad()
def _logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq, vocab] fp32 logits of the probe, in eval mode, with the experts on the reference ops (torch): the
    probe checks the conversion's weights, not a kernel (each backend has its own tests), and HF_MOE_BACKEND may name
    a backend that cannot run where the model is (triton, set for CUDA, with the model still on CPU)."""
    was_training = model.training
    model.eval()
    try:
        with use_backend("torch"):
            return model(input_ids=input_ids, use_cache=False).logits.float()
    finally:
        model.train(was_training)


def _license(model_or_path) -> str | None:
    """The `license:` of the base model's card front matter, when it is a local directory."""
    if isinstance(model_or_path, PreTrainedModel):
        model_or_path = model_or_path.config.name_or_path
    directory = os.fspath(model_or_path or "")
    if not os.path.isfile(os.path.join(directory, "README.md")):
        return None
    try:  # (through the guarded opener: a card linked out of the model directory is not read)
        text = read_bytes(directory, "README.md", "the base model").decode("utf-8", errors="replace")
    except (CheckpointError, OSError):
        return None
    match = re.search(r"^---\n(.*?)\n---", text, re.S)
    found = re.search(r"^license:\s*(\S+)", match.group(1), re.M) if match else None
    return found.group(1) if found else None


def _jsonable(value):
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
