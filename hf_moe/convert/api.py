"""`convert_to_moe`: one call from a dense causal LM to an `MoEForCausalLM`."""

from __future__ import annotations

import os
import re
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_MASKED_LM_MAPPING_NAMES

from ..configuration import MoEConfig
from ..modeling import MoEForCausalLM
from .adapters import DenseMLP, NoMLPFoundError, extract_mlp, find_decoder_layers, find_mlp
from .upcycle import upcycle_block

METHODS = ("upcycle",)
# Options of convert_to_moe beyond its named arguments, with their defaults.
OPTIONS: dict[str, Any] = {
    "every": None,  # MoE in layers i with (i + 1) % every == 0, as transformers' decoder_sparse_step
    "noise": 0.0,  # relative std of the noise added to each expert copy
    "seed": 0,  # router init and noise
    "dtype": None,  # torch dtype (or its name) to convert in
    "verify": True,  # measure the logit difference to the dense model on a random probe
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
}
CONFIG_OPTIONS = [k for k in OPTIONS if k.startswith(("router_", "norm_", "capacity", "eval_capacity", "num_"))]
# The papers' settings, used unless the caller sets the option.
ROUTER_DEFAULTS: dict[str, dict[str, Any]] = {
    "switch": {"capacity_factor": 1.25, "eval_capacity_factor": 2.0, "router_jitter_noise": 0.01},
    "gshard": {"capacity_factor": 2.0, "eval_capacity_factor": 2.0},
    "aux_free": {"router_aux_loss_coef": 0.0},  # the bias does the balancing
}
_MOE_CONFIG_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def convert_to_moe(
    model_or_path: PreTrainedModel | str | os.PathLike,
    num_experts: int,
    top_k: int,
    method: str = "upcycle",
    layers: list[int] | None = None,
    **options,
) -> MoEForCausalLM:
    """Turn a dense causal LM into an `MoEForCausalLM`.

    Args:
        model_or_path: a loaded `...ForCausalLM`, converted in place (as FastMoE's `fmoefy` and PEFT do), or a
            local directory / Hub id to load it from.
        num_experts: experts per MoE layer.
        top_k: experts per token (`num_experts_per_tok`).
        method: "upcycle" (every expert a copy of the dense MLP).
        layers: decoder layers to convert (negative indices count from the end); default all. See `every`.
        **options: every, noise, seed, dtype, verify, and the MoEConfig fields router_type, norm_topk_prob,
            router_aux_loss_coef, router_z_loss_coef, router_init_std, capacity_factor, eval_capacity_factor,
            router_jitter_noise, num_prototypes, router_bias_update_rate (see `OPTIONS`). The switch and gshard
            routers default to their papers' capacity factors (1.25 and 2.0 in training, 2.0 in eval), aux_free to no balancing loss.
    Returns:
        The MoE model, in the mode (train/eval) the dense model was in.

    With the defaults (renormalised top-k weights, no noise) the result reproduces the dense model's logits up
    to fp32 rounding; the measured difference on a random probe is stored in `config.moe_conversion`.
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"convert_to_moe got unknown option(s) {unknown}; valid options: {sorted(OPTIONS)}.")
    opts = {**OPTIONS, **ROUTER_DEFAULTS.get(options.get("router_type", "topk"), {}), **options}
    _check_counts(num_experts, top_k)
    if method not in METHODS:
        raise ValueError(f"Unknown conversion method {method!r}; choose one of {METHODS}.")
    if layers is not None and opts["every"] is not None:
        raise ValueError("Pass either `layers` or `every`, not both.")
    dtype = _dtype(opts["dtype"])

    model, source = _load_dense(model_or_path, dtype)
    was_training = model.training
    layers_path, decoder_layers = find_decoder_layers(model)
    moe_layers = _select_layers(layers, opts["every"], len(decoder_layers))
    spec = find_mlp(decoder_layers[moe_layers[0]])
    mlps = {i: extract_mlp(decoder_layers[i], find_mlp(decoder_layers[i]), model.config) for i in moe_layers}
    _check_uniform(mlps)
    first = mlps[moe_layers[0]]

    probe = _probe_input(model) if opts["verify"] else None
    dense_logits = _logits(model, probe) if probe is not None else None

    config = MoEConfig.from_base(
        model.config,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        **{k: opts[k] for k in CONFIG_OPTIONS},
        moe_layers=moe_layers,
        moe_intermediate_size=first.intermediate_size,
        expert_glu=first.glu,
        expert_bias=first.has_bias,
        expert_hidden_act=first.act,
        moe_output_dropout=first.dropout,
        decoder_layers_path=layers_path,
        moe_block_path=spec.block_path,
        moe_bypassed_paths=list(spec.bypassed_paths),
        moe_conversion={
            "method": method,
            "base_model": source,
            "license": _license(model_or_path),
            "options": {k: _jsonable(opts[k]) for k in ("noise", "seed", "router_type") if opts[k] != OPTIONS[k]},
        },
    )
    generator = torch.Generator().manual_seed(opts["seed"])
    blocks = {}
    for i in tqdm(moe_layers, desc=f"Upcycling {len(moe_layers)} MLPs to {num_experts} experts", leave=False):
        blocks[i] = upcycle_block(mlps.pop(i), config, noise=opts["noise"], generator=generator)
    moe = MoEForCausalLM.from_dense(model, config, blocks)

    if dense_logits is not None:
        moe_logits = _logits(moe, probe)
        config.moe_conversion.update(
            max_abs_logit_diff=(moe_logits - dense_logits).abs().max().item(),
            same_argmax=bool(torch.equal(moe_logits.argmax(-1), dense_logits.argmax(-1))),
            probe=f"{probe.shape[0]}x{probe.shape[1]} random tokens, fp32 logits, eval mode",
        )
    moe.train(was_training)
    return moe


def _check_counts(num_experts, top_k) -> None:
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}.")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int between 1 and num_experts={num_experts}, got {top_k!r}.")


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


def _load_dense(model_or_path, dtype) -> tuple[PreTrainedModel, str]:
    """The dense causal LM, and a name for it (its path or Hub id)."""
    if isinstance(model_or_path, PreTrainedModel):
        model = model_or_path
        _check_model_type(model.config, type(model).__name__)
        causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING[type(model.config)]
        if not isinstance(model, causal_lm if isinstance(causal_lm, type) else tuple(causal_lm)):
            raise ValueError(
                f"Pass the causal LM ({getattr(causal_lm, '__name__', causal_lm)}), not {type(model).__name__}: "
                "hf_moe returns a model with its LM head."
            )
        if dtype is not None:
            model.to(dtype)
        return model, model.config.name_or_path or type(model).__name__
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
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype if dtype is not None else "auto")
    return model, path


def _check_uniform(mlps: dict[int, DenseMLP]) -> None:
    kinds = {(m.glu, m.has_bias, m.act, m.hidden_size, m.intermediate_size) for m in mlps.values()}
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
    was_training = model.training
    model.eval()
    try:
        return model(input_ids=input_ids, use_cache=False).logits.float()
    finally:
        model.train(was_training)


def _license(model_or_path) -> str | None:
    """The `license:` of the base model's card front matter, when it is a local directory."""
    if isinstance(model_or_path, PreTrainedModel):
        model_or_path = model_or_path.config.name_or_path
    card = os.path.join(os.fspath(model_or_path or ""), "README.md")
    if not os.path.isfile(card):
        return None
    match = re.search(r"^---\n(.*?)\n---", open(card, encoding="utf-8", errors="replace").read(), re.S)
    found = re.search(r"^license:\s*(\S+)", match.group(1), re.M) if match else None
    return found.group(1) if found else None


def _jsonable(value):
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
