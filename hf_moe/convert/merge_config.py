"""The merge recipe: mergekit-moe's YAML, as users write it, with hf_moe's own fields beside it.

mergekit-moe's fields (mergekit 0.1.5, `mergekit/moe/config.py`), with the same meaning:

    base_model          donor of attention, norms, embeddings and head (and of the prompts' hidden states)
    experts             list of {source_model, positive_prompts, negative_prompts, noise_scale, residual_scale}
    gate_mode           hidden | hidden_avg | hidden_last | cheap_embed | random | uniform_random (default hidden)
    experts_per_token   top-k (default 2)
    dtype               output dtype (default: the base model's)
    shared_experts      at most one {source_model, positive_prompts, negative_prompts, residual_scale}
    architecture        mixtral | qwen | deepseek: the function the merged model computes (see `ARCHITECTURES`)

hf_moe's fields (none of them changes what a mergekit config means):

    gate_mode: calibration    router rows from the mean hidden state of each source's own text at each MoE layer
    experts[].calibration_data    that text (a local .txt, .json or .jsonl file); default: its positive_prompts
    calibration_tokens        tokens of calibration text read per source (default 2048)
    non_expert_weights        base (mergekit: attention, norms, embeddings from base_model) or average (BTX: the
                              mean over the experts' source models)
    layers / every            which decoder layers become MoE (default: all, as mergekit)
    hidden_dtype              dtype of the forward that computes hidden-state gates (default bfloat16, as mergekit)
    seed                      random gates and noise_scale (mergekit draws them unseeded)
    router_type, norm_topk_prob, router_aux_loss_coef, ...   any MoEConfig router field (`ROUTER_FIELDS`)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..configuration import _brief, _cut
from ..inputs import InputFileError, read_limited

GATE_MODES = ("hidden", "hidden_avg", "hidden_last", "cheap_embed", "random", "uniform_random", "calibration")
PROMPT_MODES = ("hidden", "hidden_avg", "hidden_last", "cheap_embed")
# architecture -> what the merged model computes, and which native transformers family it exports to.
ARCHITECTURES = {
    "mixtral": "routed experts only (exports to Mixtral from Llama/Mistral sources, to Qwen3-MoE from Qwen3)",
    "qwen": "routed experts plus one shared expert scaled by sigmoid(x . g) (Qwen2-MoE); without shared experts "
    "and Qwen3 sources, Qwen3-MoE",
    "deepseek": "routed experts plus at most one always-on shared expert, ungated (DeepSeek-MoE)",
}
NON_EXPERT_WEIGHTS = ("base", "average")
# MoEConfig fields a merge recipe may set (see hf_moe.MoEConfig).
ROUTER_FIELDS = (
    "router_type", "norm_topk_prob", "router_aux_loss_coef", "router_z_loss_coef", "capacity_factor",
    "eval_capacity_factor", "router_jitter_noise", "num_prototypes", "router_bias_update_rate", "router_weights",
)


# A recipe expands to at most this many values (a string counts one per 64 characters): YAML aliases can make a
# 700-byte file expand to billions (an "alias bomb"), which any traversal (a message's repr, a copy) would then pay.
MAX_RECIPE_VALUES = 100_000
MAX_DEPTH = 64
MAX_RECIPE_BYTES = 8 << 20  # the YAML file, refused above this before it is read (its values cannot fill more)
# noise_scale and residual_scale above this are absurd (mergekit's are ~0.01 and <= 1): past it, weights overflow.
MAX_SCALE = 1000.0
SEED_RANGE = 2**64  # torch.Generator.manual_seed takes 0 <= seed < 2**64


class MergeConfigError(ValueError):
    """The merge recipe is malformed or asks for something hf_moe cannot build."""


@dataclass
class ExpertSpec:
    """One source model and how it is routed to."""

    source_model: str
    positive_prompts: list[str] | None = None
    negative_prompts: list[str] | None = None
    noise_scale: float | None = None
    residual_scale: float | None = None
    calibration_data: str | None = None  # hf_moe

    @property
    def name(self) -> str:
        return os.path.basename(os.path.normpath(self.source_model)) or self.source_model


@dataclass
class MergeConfig:
    """A parsed merge recipe (see the module docstring for every field)."""

    base_model: str
    experts: list[ExpertSpec]
    gate_mode: str = "hidden"
    experts_per_token: int = 2
    dtype: str | None = None
    shared_experts: list[ExpertSpec] = field(default_factory=list)
    architecture: str | None = None
    non_expert_weights: str = "base"
    layers: list[int] | None = None
    every: int | None = None
    calibration_tokens: int = 2048
    hidden_dtype: str = "bfloat16"
    seed: int = 0
    router: dict[str, Any] = field(default_factory=dict)

    @property
    def shared(self) -> ExpertSpec | None:
        return self.shared_experts[0] if self.shared_experts else None

    @property
    def shared_expert_gate(self) -> bool:
        """The shared expert is scaled by sigmoid(x . g), as in Qwen2-MoE (`architecture: qwen`)."""
        return self.shared is not None and self.architecture == "qwen"

    def sources(self) -> list[str]:
        """Every model read, base first, without repeats."""
        paths = [self.base_model, *(e.source_model for e in [*self.experts, *self.shared_experts])]
        return list(dict.fromkeys(paths))

    def to_dict(self) -> dict[str, Any]:
        """The recipe as a YAML-able dict (what the model card and `config.moe_conversion` record)."""
        lists = ("experts", "shared_experts", "router")
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in lists}
        out["experts"] = [_spec_dict(e) for e in self.experts]
        if self.shared_experts:
            out["shared_experts"] = [_spec_dict(e) for e in self.shared_experts]
        out.update(self.router)
        return {k: v for k, v in out.items() if v is not None}


def _spec_dict(spec: ExpertSpec) -> dict:
    return {f.name: getattr(spec, f.name) for f in fields(spec) if getattr(spec, f.name) is not None}


# --------------------------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------------------------
def load_merge_config(recipe: str | os.PathLike | dict | MergeConfig, **overrides) -> MergeConfig:
    """A `MergeConfig` from a YAML file, a dict (the YAML's content) or a `MergeConfig`; `overrides` replace
    top-level fields. Every field is checked; a wrong one is a `MergeConfigError` that names it."""
    if isinstance(recipe, MergeConfig):
        data = recipe.to_dict()
    elif isinstance(recipe, dict):
        data = dict(recipe)
    elif isinstance(recipe, (str, os.PathLike)):
        data = _read_yaml(Path(recipe))
    else:
        raise TypeError(f"A merge recipe is a YAML file, a dict or a MergeConfig, got {type(recipe).__name__}.")
    data.update(overrides)
    return parse_merge_config(data)


def _read_yaml(path: Path) -> dict:
    import yaml

    if not path.is_file():
        raise FileNotFoundError(f"No merge config at {str(path)!r}: the file does not exist.")
    try:
        text = read_limited(path, "The merge config", MAX_RECIPE_BYTES, "a recipe names a few models and prompts; "
                            "give long calibration text as experts[].calibration_data files.")
    except InputFileError as err:
        raise MergeConfigError(str(err)) from None
    try:
        data = yaml.load(text.decode("utf-8"), Loader=_bounded_loader())  # (yaml.safe_load's loader)
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise MergeConfigError(f"{path} is not valid YAML: {_cut(str(err), 400)}") from None
    except _TooDeep:
        raise MergeConfigError(f"{path} nests its values more than {MAX_DEPTH} deep: a recipe never does.") from None
    if not isinstance(data, dict):
        raise MergeConfigError(f"{path} must hold a mapping (base_model:, experts:, ...), not {type(data).__name__}.")
    return data


_TOP_LEVEL = {f.name for f in fields(MergeConfig)} - {"router"}
_SPEC_FIELDS = {f.name for f in fields(ExpertSpec)}
_MERGEKIT = {"base_model", "experts", "gate_mode", "experts_per_token", "dtype", "shared_experts", "architecture"}


def parse_merge_config(data: dict) -> MergeConfig:
    """Check and convert the YAML mapping `data` (see the module docstring)."""
    _check_size(data)
    unknown = sorted(map(str, set(data) - _TOP_LEVEL - set(ROUTER_FIELDS)))
    if unknown:
        raise MergeConfigError(
            f"Unknown field(s) {unknown} in the merge config. mergekit-moe's fields: {', '.join(sorted(_MERGEKIT))}; "
            f"hf_moe's: {', '.join(sorted(_TOP_LEVEL - _MERGEKIT))}, and the router fields {', '.join(ROUTER_FIELDS)}."
        )
    if "base_model" not in data:
        raise MergeConfigError(
            "The merge config has no base_model: name the model that gives attention, norms and embeddings."
        )
    if not isinstance(data.get("experts"), list) or not data["experts"]:
        raise MergeConfigError("The merge config needs `experts:`, a list of at least one {source_model: ...}.")
    config = MergeConfig(
        base_model=_model_reference(data["base_model"], "base_model"),
        experts=[_expert(e, f"experts[{i}]") for i, e in enumerate(data["experts"])],
        shared_experts=[_expert(e, f"shared_experts[{i}]") for i, e in enumerate(_list(data, "shared_experts"))],
        router={k: data[k] for k in ROUTER_FIELDS if k in data},
        **{k: data[k] for k in _TOP_LEVEL - {"base_model", "experts", "shared_experts"} if data.get(k) is not None},
    )
    _check(config)
    return config


class _TooDeep(Exception):
    pass


def _bounded_loader():
    """yaml.SafeLoader, refusing to nest collections more than `MAX_DEPTH` deep while it scans: deeper, its scanner
    takes quadratic time (seconds for a 6 KB line of brackets) and its composer overflows the stack."""
    import yaml

    class Loader(yaml.SafeLoader):
        def fetch_flow_collection_start(self, TokenClass):
            if self.flow_level >= MAX_DEPTH:
                raise _TooDeep
            super().fetch_flow_collection_start(TokenClass)

        def add_indent(self, column):
            if len(self.indents) >= MAX_DEPTH:
                raise _TooDeep
            return super().add_indent(column)

    return Loader


def _check_size(data) -> None:
    """`data` expands to at most `MAX_RECIPE_VALUES` values (counted with repeats, as a traversal pays them: YAML
    aliases share one object), nested at most `MAX_DEPTH` deep; counting stops at the limit, so it costs at most
    that. The error names the field where the limit was reached."""
    budget, stack = MAX_RECIPE_VALUES, [(data, 0, "")]
    while stack:
        value, depth, where = stack.pop()
        budget -= 1 + (len(value) // 64 if isinstance(value, str) else 0)
        if budget < 0 or depth > MAX_DEPTH:
            field = _cut(where, 80) or "its top level"
            raise MergeConfigError(
                f"The merge config expands to more than {MAX_RECIPE_VALUES} values, at {field} (YAML aliases repeat "
                "what they name: an alias bomb?). A recipe names a few models and prompts: write it out plainly."
                if budget < 0 else f"The merge config nests its values more than {MAX_DEPTH} deep, at {field}: a "
                "recipe never does."
            )
        if isinstance(value, dict):
            stack.extend((v, depth + 1, f"{where}.{_cut(str(k), 40)}".lstrip(".")) for k, v in value.items())
            stack.extend((k, depth + 1, where) for k in value)
        elif isinstance(value, (list, tuple)):
            stack.extend((v, depth + 1, f"{where}[{i}]") for i, v in enumerate(value))


def _list(data: dict, key: str) -> list:
    value = data.get(key) or []
    if not isinstance(value, list):
        raise MergeConfigError(f"{key} must be a list, got {type(value).__name__}.")
    return value


def _model_reference(value, where: str) -> str:
    """mergekit's ModelReference as a path: `path`, or {model: {path: ...}}. LoRA references are refused."""
    if isinstance(value, dict) and set(value) <= {"model", "lora", "override_architecture"}:
        if value.get("lora"):
            raise MergeConfigError(
                f"{where} names a LoRA adapter: merge it into its model first (peft's merge_and_unload)."
            )
        value = value.get("model")
        value = value.get("path") if isinstance(value, dict) else value
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise MergeConfigError(f"{where} must be a model directory or Hub id, got {_brief(value)}.")
    value = os.fspath(value)
    if "+" in value and not os.path.exists(value):
        raise MergeConfigError(
            f"{where}={_brief(value)} uses mergekit's `model+lora` syntax: merge the LoRA adapter into the model first "
            "(peft's merge_and_unload) and name the merged directory."
        )
    return value


def _expert(value, where: str) -> ExpertSpec:
    if not isinstance(value, dict) or "source_model" not in value:
        raise MergeConfigError(f"{where} must be a mapping with a source_model, got {_brief(value)}.")
    unknown = sorted(map(str, set(value) - _SPEC_FIELDS))
    if unknown:
        raise MergeConfigError(f"Unknown field(s) {unknown} in {where}; valid: {', '.join(sorted(_SPEC_FIELDS))}.")
    spec = ExpertSpec(**{**value, "source_model": _model_reference(value["source_model"], f"{where}.source_model")})
    for name in ("positive_prompts", "negative_prompts"):
        prompts = getattr(spec, name)
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompts is not None and not (isinstance(prompts, list) and all(isinstance(p, str) for p in prompts)):
            raise MergeConfigError(f"{where}.{name} must be a list of strings, got {_brief(prompts)}.")
        setattr(spec, name, prompts or None)
    for name in ("noise_scale", "residual_scale"):
        value_ = getattr(spec, name)
        number = isinstance(value_, (int, float)) and not isinstance(value_, bool)
        if value_ is not None and not (number and 0 <= value_ <= MAX_SCALE):  # (NaN fails every comparison)
            raise MergeConfigError(
                f"{where}.{name} must be a finite number from 0 to {MAX_SCALE:g}, got {_brief(value_)}: the expert's "
                "weights are scaled (or noised) by it, and a value past that makes them overflow to inf and NaN."
            )
    if spec.calibration_data is not None and not isinstance(spec.calibration_data, str):
        raise MergeConfigError(f"{where}.calibration_data must be a path, got {_brief(spec.calibration_data)}.")
    return spec


def _check(c: MergeConfig) -> None:
    if not isinstance(c.gate_mode, str) or c.gate_mode not in GATE_MODES:
        raise MergeConfigError(f"gate_mode={_brief(c.gate_mode)} is not one of {', '.join(GATE_MODES)}.")
    if isinstance(c.experts_per_token, bool) or not isinstance(c.experts_per_token, int) or c.experts_per_token < 1:
        raise MergeConfigError(f"experts_per_token must be an int >= 1, got {_brief(c.experts_per_token)}.")
    if len(c.experts) < c.experts_per_token:
        raise MergeConfigError(
            f"experts_per_token={c.experts_per_token} but only {len(c.experts)} experts: list at least as many experts."
        )
    if c.architecture is not None:
        if not isinstance(c.architecture, str):
            raise MergeConfigError(f"architecture={_brief(c.architecture)} is not one of {', '.join(ARCHITECTURES)}.")
        c.architecture = c.architecture.lower()
        matches = [a for a in ARCHITECTURES if a.startswith(c.architecture) or c.architecture.startswith(a)]
        if not matches:
            raise MergeConfigError(f"architecture={_brief(c.architecture)} is not one of {', '.join(ARCHITECTURES)}.")
        c.architecture = matches[0]
    if len(c.shared_experts) > 1:
        raise MergeConfigError(f"{len(c.shared_experts)} shared_experts: mergekit and hf_moe merge at most one.")
    _check_shared(c)
    if not isinstance(c.non_expert_weights, str) or c.non_expert_weights not in NON_EXPERT_WEIGHTS:
        raise MergeConfigError(
            f"non_expert_weights must be one of {NON_EXPERT_WEIGHTS}, got {_brief(c.non_expert_weights)}."
        )
    if c.layers is not None and c.every is not None:
        raise MergeConfigError("Set either `layers` or `every`, not both.")
    if c.layers is not None and not (isinstance(c.layers, list) and all(isinstance(i, int) for i in c.layers)):
        raise MergeConfigError(f"layers must be a list of ints, got {_brief(c.layers)}.")
    for name, low, high in (("calibration_tokens", 16, None), ("seed", 0, SEED_RANGE)):
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value >= high):
            within = f"from {low} to 2**64 - 1 (torch's seed range)" if high else f">= {low}"
            raise MergeConfigError(f"{name} must be an int {within}, got {_brief(value)}.")
    for name in ("dtype", "hidden_dtype"):
        value = getattr(c, name)
        if value is not None and not _floating_dtype(value):
            raise MergeConfigError(
                f"{name} must name a floating-point torch dtype (float32, bfloat16 or float16), got {_brief(value)}."
            )
    if c.gate_mode in PROMPT_MODES:
        _check_prompts(c)
    if c.gate_mode == "calibration":
        for i, e in enumerate(c.experts):
            if e.calibration_data is None and not e.positive_prompts:
                raise MergeConfigError(
                    f"gate_mode=calibration: experts[{i}] ({e.source_model}) has neither calibration_data (a .txt, "
                    ".json or .jsonl file of its own text) nor positive_prompts to use instead."
                )
            if e.calibration_data is not None and not os.path.isfile(e.calibration_data):
                raise FileNotFoundError(f"experts[{i}].calibration_data {e.calibration_data!r} is not a file.")
            if e.calibration_data is not None and not _has_text(e.calibration_data):
                raise MergeConfigError(f"experts[{i}].calibration_data {e.calibration_data!r} is empty: give it "
                                       f"text of what {e.source_model} was fine-tuned on.")


def _has_text(path: str) -> bool:
    """Whether a calibration file holds more than white space (a large one is taken on trust: it is read later)."""
    with open(path, "rb") as f:  # (the user's text file, not a checkpoint's)
        head = f.read(1 << 16)
    return bool(head.strip()) or len(head) == 1 << 16


def _floating_dtype(name) -> bool:
    """Whether `name` names a floating-point torch dtype ("bfloat16", "torch.float32")."""
    import torch

    value = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    return isinstance(value, torch.dtype) and value.is_floating_point


def _check_shared(c: MergeConfig) -> None:
    shared = c.shared
    arch = c.architecture
    if shared is None:
        if arch == "qwen" and c.gate_mode != "random":
            pass  # Qwen3-MoE (qwen3 sources) has none; Qwen2-MoE needs one, checked against the sources' type
        return
    if arch == "mixtral":
        raise MergeConfigError(
            "architecture=mixtral has no shared expert: remove shared_experts or choose qwen or deepseek."
        )
    if arch is None:
        raise MergeConfigError(
            "shared_experts needs an architecture: qwen (the shared expert scaled by a sigmoid gate from its prompts, "
            "Qwen2-MoE) or deepseek (always on, ungated)."
        )
    prompted = bool(shared.positive_prompts or shared.negative_prompts)
    if arch == "deepseek" and prompted:
        raise MergeConfigError(
            "architecture=deepseek does not gate its shared expert: remove its positive/negative_prompts."
        )
    if arch == "qwen" and c.gate_mode in PROMPT_MODES and not shared.positive_prompts:
        raise MergeConfigError(
            "architecture=qwen gates the shared expert with a sigmoid of its own router row: give shared_experts[0] "
            "positive_prompts (or use gate_mode random or calibration)."
        )


def _check_prompts(c: MergeConfig) -> None:
    """mergekit's checks: every expert has positive prompts, and not all experts have the same ones."""
    for i, e in enumerate(c.experts):
        if not e.positive_prompts:
            raise MergeConfigError(
                f"gate_mode={c.gate_mode}: experts[{i}] ({e.source_model}) has no positive_prompts. Give each expert "
                "prompts that should be routed to it, or use gate_mode random or calibration."
            )
    key = lambda e: (tuple(e.positive_prompts), tuple(e.negative_prompts or ()))  # noqa: E731
    if len(c.experts) > 1 and all(key(e) == key(c.experts[0]) for e in c.experts[1:]):
        raise MergeConfigError(
            "Every expert has the same positive and negative prompts, so the router could not tell them apart. Give "
            "each expert prompts of what should be routed to it."
        )
