"""`MoEConfig`: the base model's config, plus the MoE fields.

A converted model keeps its base architecture, so its config must keep every field (and every property and
`attribute_map` entry) of the base config class. `MoEConfig` is therefore specialised per base config class:
`MoEConfig(base_model_type="llama", ...)` returns a `MoELlamaConfig`, deriving from `MoEConfig` and `LlamaConfig`
(`moe_config_class`; docs/architecture.md, "Per-base classes", explains these classes and their registration).

The MoE fields use transformers' names (`num_experts`, `num_experts_per_tok`, `norm_topk_prob`,
`router_aux_loss_coef`, `output_router_logits`, `moe_intermediate_size`).
"""

from __future__ import annotations

import math
import numbers
import os
import reprlib
import sys
from collections.abc import Callable
from typing import Any, ClassVar

from transformers import PreTrainedConfig
from transformers.activations import ACT2FN

from .compat import CONFIG_MAPPING, attn_implementation
from .layers.adapter_experts import check_adapter_spec
from .layers.router import ROUTERS
from .version import __version__

# Version of the on-disk layout (`hf_moe.checkpoint.format`). A reader refuses a checkpoint with a newer format.
CHECKPOINT_FORMAT_VERSION = 1
# Fields of a saved config that are no field of the base model's: the note to processes without hf_moe
# (`checkpoint.format.PACKAGE_FIELD`) and the `auto_map` older checkpoints carry.
_NOT_BASE = ("base_model_type", "auto_map", "hf_moe_package")


class MoEConfig(PreTrainedConfig):
    r"""
    Configuration of a [`MoEForCausalLM`]: every field of the base model's config, plus:

    Args:
        num_experts (`int`): routed experts per MoE layer.
        num_experts_per_tok (`int`): experts each token is sent to (top-k).
        norm_topk_prob (`bool`): renormalise the top-k router probabilities so they sum to one. With upcycled
            experts this makes the MoE reproduce the dense model.
        router_aux_loss_coef (`float`): weight of the Switch load-balancing loss added to the LM loss in training.
            The loss is on transformers' scale (k when routing is uniform), so TRL's trainers weigh it the same.
        output_router_logits (`bool`): return each MoE layer's router logits in the model output.
        moe_layers (`list[int]`): indices of the decoder layers whose MLP is an MoE block.
        moe_intermediate_size (`int`): intermediate size of each expert.
        expert_glu (`bool`): experts are gated (`act(x W_gate) * x W_up`) rather than plain MLPs.
        expert_bias (`bool`): experts have biases on both projections.
        expert_hidden_act (`str`): activation, a key of `transformers.activations.ACT2FN`.
        moe_output_dropout (`float`): dropout on the block output, when the dense MLP had one inside.
        router_type (`str`): a registered router (`hf_moe.layers.router`): topk, noisy_topk, switch, gshard,
            prototype, expert_choice, aux_free, or one registered with `hf_moe.register_router`.
        capacity_factor (`float`): each expert takes at most ceil(factor * tokens * k / E) (token, slot) pairs in
            training; the rest are dropped (zero output; the residual carries the token). None: dropless.
        eval_capacity_factor (`float`): the same outside training; None uses `capacity_factor`.
        router_jitter_noise (`float`): multiplicative jitter on the router input in training (switch).
        router_z_loss_coef (`float`): weight of the router z-loss (ST-MoE) added in training.
        num_prototypes (`int`): prototypes of the prototype router (default: top-k).
        router_bias_update_rate (`float`): step of the aux_free router's bias update.
        router_weights (`str`): "softmax" (the router's probabilities, the default) or "unit": every chosen expert
            counts fully, as in MoEfication (the router still learns through the straight-through gradient of
            log w).
        num_shared_experts (`int`): always-active experts (Qwen-MoE / DeepSeek style), stored as one dense MLP
            `shared_experts` of intermediate size num_shared_experts * shared_expert_intermediate_size.
        shared_expert_intermediate_size (`int`): intermediate size of one shared expert (default:
            moe_intermediate_size).
        shared_expert_gate (`bool`): scale the shared experts' output by sigmoid(x W_g), W_g [1, H]
            (`shared_expert_gate`), as Qwen2-MoE does (what `hf-moe merge` with `architecture: qwen` builds).
        moe_output_bias (`bool`): the block adds a bias `bias` [H] to its output (neuron-split conversions of MLPs
            with an output bias and no shared expert, where the bias must be added once whatever the routing).
        router_skip_threshold (`float`): dynamic skipping at inference (Lu et al. 2024), off at 0 (the default). Outside
            training, a chosen expert whose weight is below `router_skip_threshold` x the token's largest weight is not
            computed; with `norm_topk_prob` the weights of the experts computed are renormalised to sum to one.
        router_init_std (`float`): std of the normal init of routers (and of experts built from scratch); `None`
            uses the base model's `initializer_range` (or `init_std`).
        decoder_layers_path (`str`): attribute path from the model to its list of decoder layers.
        moe_block_path (`str`): attribute path, inside a decoder layer, where the MoE block sits.
        moe_bypassed_paths (`list[str]`): parts of a dense MLP that the MoE block replaces when it sits in place
            of the up projection rather than of the whole MLP: OPT's `activation_fn` and `fc2` (written in the
            decoder layer), Bloom's `mlp.gelu_impl` and `mlp.dense_4h_to_h` (its MLP's forward also adds the
            residual). They become identities.
        moe_conversion (`dict`): how the model was made (base model, method, options), for the model card.
        adapter_experts (`dict`): set for adapter experts (`convert_to_moe(..., method="lora" | "pesc")`): every expert
            is the frozen dense MLP plus a small trainable adapter (`hf_moe.layers.adapter_experts`). Holds the method,
            `r`, `lora_alpha`, `lora_dropout`, `target_modules` (lora) or `adapter_act` (pesc), and `base_model`:
            the dense checkpoint the frozen weights come from, with a fingerprint of them (a checkpoint holds only
            the trained tensors; `from_pretrained` reads the rest from the base). None for ordinary experts.
        hf_moe_format (`int`): checkpoint layout version.
    """

    model_type = "hf_moe"
    # The base config class; set on the specialised subclasses only.
    base_config_class: ClassVar[type[PreTrainedConfig] | None] = None
    # An MoE config needs its base type and an expert size: transformers must not build one without arguments to
    # find the defaults (5.17 does so when saving a config, and the build fails validation).
    has_no_defaults_at_init: ClassVar[bool] = True

    num_experts: int = 8
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.01
    output_router_logits: bool = False
    moe_layers: list[int] | None = None
    moe_intermediate_size: int | None = None
    expert_glu: bool = True
    expert_bias: bool = False
    expert_hidden_act: str = "silu"
    moe_output_dropout: float = 0.0
    router_type: str = "topk"
    capacity_factor: float | None = None
    eval_capacity_factor: float | None = None
    router_jitter_noise: float = 0.0
    router_z_loss_coef: float = 0.0
    num_prototypes: int | None = None
    router_bias_update_rate: float = 0.001
    router_weights: str = "softmax"
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int | None = None
    shared_expert_gate: bool = False  # (merge) shared experts scaled by sigmoid(x W_g), as Qwen2-MoE
    moe_output_bias: bool = False
    router_skip_threshold: float = 0.0  # (shrink) dynamic skipping of small-weight experts; 0: off
    router_init_std: float | None = None
    decoder_layers_path: str | None = None
    moe_block_path: str = "mlp"
    moe_bypassed_paths: list[str] | None = None
    moe_conversion: dict | None = None
    adapter_experts: dict | None = None  # experts = a frozen MLP + per-expert adapters
    hf_moe_format: int = CHECKPOINT_FORMAT_VERSION

    def __new__(cls, *args, **kwargs):
        if cls.base_config_class is None:
            cls = moe_config_class(_base_config_class(kwargs.get("base_model_type")))
        return super().__new__(cls)

    def __post_init__(self, **kwargs):
        base_model_type = kwargs.pop("base_model_type", None)
        if base_model_type is not None and base_model_type != self.base_model_type:
            raise ValueError(
                f"{type(self).__name__} wraps `{self.base_model_type}`, but the config says "
                f"base_model_type={base_model_type!r}."
            )
        kwargs.pop("model_type", None)  # always "hf_moe"; a stale base value must not shadow it
        _check_fields(self)
        self.moe_bypassed_paths = list(self.moe_bypassed_paths or [])
        super().__post_init__(**kwargs)
        if self.moe_layers is None:
            self.moe_layers = list(range(self.get_text_config().num_hidden_layers))
        self.moe_layers = sorted(set(self.moe_layers))
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = getattr(self, "intermediate_size", None)
        if self.shared_expert_intermediate_size is None and self.num_shared_experts:
            self.shared_expert_intermediate_size = self.moe_intermediate_size
        self._validate_moe()

    def _validate_moe(self):
        """Every MoE field alone (`_check_field`), then what depends on several fields or on the base config."""
        _check_fields(self)
        num_layers = self.get_text_config().num_hidden_layers
        if not self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok (top_k) must be between 1 and num_experts={self.num_experts}, "
                f"got {self.num_experts_per_tok}."
            )
        bad = [i for i in self.moe_layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(
                f"moe_layers {_brief(bad)} are out of range: the model has layers 0..{num_layers - 1}."
            )
        if not self.moe_layers:
            raise ValueError("moe_layers is empty: choose at least one decoder layer to make an MoE layer.")
        if self.moe_intermediate_size is None:
            raise ValueError(f"moe_intermediate_size must be a positive int, got {self.moe_intermediate_size}.")
        if self.adapter_experts is not None:
            check_adapter_spec(self.adapter_experts, self.expert_glu)
            if self.num_shared_experts:
                raise ValueError("adapter_experts with num_shared_experts: every adapter expert already holds the "
                                 "whole dense MLP; shared experts are for upcycled or merged experts.")

    def __setattr__(self, key, value):
        # A value set after construction (`from_pretrained(path, router_skip_threshold=...)` sets its keyword
        # arguments this way, and so does user code) is checked like one read from config.json: otherwise it is
        # refused only by the next load of the checkpoint it was saved in, or fails in the first forward.
        if key in _FIELD_TYPES or key in _LIST_FIELDS or key in _DICT_FIELDS:
            _check_field(key, value)
        super().__setattr__(key, value)

    def validate(self):
        """The base config's checks (transformers runs them in `save_pretrained`), then every MoE field's: a config
        that a load would refuse is never written."""
        super().validate()
        self._validate_moe()

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        # transformers sets the keyword arguments of `from_pretrained` one by one after construction: each is checked
        # alone by __setattr__, and what ties fields together (top_k <= num_experts, moe_layers) is checked here.
        out = super().from_dict(config_dict, **kwargs)
        (out[0] if isinstance(out, tuple) else out)._validate_moe()
        return out

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig"):
        """Does nothing. transformers calls it when it loads a checkpoint's `auto_map` code; marking this class
        would make every later save copy hf_moe's source files into the checkpoint. hf_moe no longer writes
        `auto_map` (checkpoint.format); a checkpoint an older hf_moe saved may carry it, pointing at the small
        `modeling_hf_moe.py` shim that imports the installed package, and still loads through it."""

    @property
    def moe_init_std(self) -> float:
        """Std of the normal init of new MoE weights: `router_init_std`, else the base model's init std."""
        if self.router_init_std is not None:
            return self.router_init_std
        for name in ("initializer_range", "init_std"):
            value = getattr(self, name, None)
            if isinstance(value, float):
                return value
        return 0.02

    @property
    def base_model_type(self) -> str:
        return self.base_config_class.model_type

    @classmethod
    def from_base(cls, base_config: PreTrainedConfig, **moe_fields) -> MoEConfig:
        """The MoE config of `base_config` (a dense model's config) with `moe_fields` set."""
        if isinstance(base_config, MoEConfig):
            raise ValueError("This config is already an MoE config (model_type='hf_moe').")
        fields = base_config.to_dict()
        for key in ("model_type", "transformers_version", "architectures"):
            fields.pop(key, None)
        # to_dict() drops the attention implementation; keep what the dense model runs with.
        fields["attn_implementation"] = attn_implementation(base_config)
        fields.update(moe_fields)
        return moe_config_class(type(base_config))(**fields)

    def to_base_config(self) -> PreTrainedConfig:
        """The dense base config, without the MoE fields."""
        own = set(MoEConfig.__dataclass_fields__) - set(PreTrainedConfig.__dataclass_fields__)
        fields = {k: v for k, v in self.to_dict().items() if k not in own and k not in _NOT_BASE}
        fields.pop("model_type", None)
        return self.base_config_class(**fields)

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        output["base_model_type"] = self.base_model_type
        return output

    def __reduce__(self):
        # By base type rather than by class, so a fresh process can rebuild the specialised class.
        return (_empty_config, (self.base_model_type,), self.__dict__.copy())


# The type of each MoE field: values come from config.json, and a wrong type must be an error that names the field,
# not a TypeError deep inside the model (or, worse, a silent coercion).
_INT, _FLOAT, _BOOL, _STR = "an int", "a number", "a bool", "a string"
_FIELD_TYPES = {
    "num_experts": _INT, "num_experts_per_tok": _INT, "norm_topk_prob": _BOOL, "router_aux_loss_coef": _FLOAT,
    "output_router_logits": _BOOL, "moe_intermediate_size": _INT, "expert_glu": _BOOL, "expert_bias": _BOOL,
    "expert_hidden_act": _STR, "moe_output_dropout": _FLOAT, "router_type": _STR, "capacity_factor": _FLOAT,
    "eval_capacity_factor": _FLOAT, "router_jitter_noise": _FLOAT, "router_z_loss_coef": _FLOAT,
    "num_prototypes": _INT, "router_bias_update_rate": _FLOAT, "router_weights": _STR, "num_shared_experts": _INT,
    "shared_expert_intermediate_size": _INT, "shared_expert_gate": _BOOL, "moe_output_bias": _BOOL,
    "router_init_std": _FLOAT, "router_skip_threshold": _FLOAT,
    "decoder_layers_path": _STR, "moe_block_path": _STR, "hf_moe_format": _INT,
}
_NULLABLE = {
    "moe_layers", "moe_intermediate_size", "capacity_factor", "eval_capacity_factor", "num_prototypes",
    "shared_expert_intermediate_size", "router_init_std", "decoder_layers_path", "moe_bypassed_paths",
    "moe_conversion", "adapter_experts",
}


def _cut(text: str, limit: int = 500) -> str:
    """`text` cut to about `limit` characters: values read from files go into messages, and must not flood them."""
    return text if len(text) <= limit else f"{text[: limit - 25]}... ({len(text)} characters)"


class _BoundedRepr(reprlib.Repr):
    """repr with bounded cost: a few items per container, a few levels deep, no huge int spelled out. A value read
    from a file may be an expanded YAML alias bomb or a list nested a thousand deep: its full repr would not end."""

    def __init__(self):
        super().__init__()
        self.maxlevel, self.maxlist, self.maxtuple, self.maxdict, self.maxset = 3, 8, 8, 8, 8
        self.maxstring = self.maxother = 500

    def repr_int(self, x, level):
        return repr(x) if x.bit_length() <= 256 else f"<an int of {x.bit_length()} bits>"


_REPR = _BoundedRepr()


def _brief(value, limit: int = 120) -> str:
    """repr(value), cut to about `limit` characters (its cost bounded too: `_BoundedRepr`)."""
    return _cut(_REPR.repr(value), limit)


def _is(value, kind: str) -> bool:
    if kind == _INT:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if kind == _FLOAT:  # NaN and infinities are caught by the range checks
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if kind == _BOOL:
        return isinstance(value, bool)
    return isinstance(value, str)


# The MoE fields that fix a checkpoint's tensors (which there are, and their shapes): a load may not change them.
LAYOUT_FIELDS = (
    "num_experts", "moe_layers", "moe_intermediate_size", "expert_glu", "expert_bias", "num_shared_experts",
    "shared_expert_intermediate_size", "shared_expert_gate", "moe_output_bias", "num_prototypes",
)
_LIST_FIELDS = {"moe_layers": _INT, "moe_bypassed_paths": _STR}
_DICT_FIELDS = ("moe_conversion", "adapter_experts")


_FINITE_NONNEGATIVE = (lambda v: 0 <= v < math.inf, "must be a finite number >= 0")
# The range of each MoE field on its own (what ties fields together is in `MoEConfig._validate_moe`). Each test is
# written so that NaN fails it. name -> (test, what the value must be).
_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "num_experts": (lambda v: v >= 1, "must be at least 1"),
    "num_experts_per_tok": (lambda v: v >= 1, "must be at least 1 (and at most num_experts)"),
    "moe_intermediate_size": (lambda v: v >= 1, "must be a positive int"),
    "num_shared_experts": (lambda v: v >= 0, "must be 0 or more"),
    "num_prototypes": (lambda v: v >= 1, "must be at least 1 (or None for the default)"),
    "shared_expert_intermediate_size": (lambda v: v >= 1, "must be at least 1 (or None for the default)"),
    "capacity_factor": (lambda v: 0 < v < math.inf, "must be positive and finite (or None for dropless)"),
    "eval_capacity_factor": (lambda v: 0 < v < math.inf, "must be positive and finite (or None for dropless)"),
    "router_aux_loss_coef": _FINITE_NONNEGATIVE,
    "router_z_loss_coef": _FINITE_NONNEGATIVE,
    "router_bias_update_rate": _FINITE_NONNEGATIVE,
    # The input is scaled by a factor drawn from [1 - noise, 1 + noise]: from 1 on, it can be zero or flip sign.
    "router_jitter_noise": (lambda v: 0 <= v < 1, "must be in [0, 1) (a multiplicative jitter; 0: off)"),
    "moe_output_dropout": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "router_skip_threshold": (
        lambda v: 0 <= v <= 1,
        ("must be in [0, 1] (0: off): an expert is skipped when its weight is below the threshold times the "
         "token's largest weight"),
    ),
    "router_init_std": (lambda v: 0 < v < math.inf, "must be a positive finite number (or None)"),
    "router_weights": (lambda v: v in ("softmax", "unit"), "must be 'softmax' or 'unit'"),
    "hf_moe_format": (lambda v: v >= 0, "must be 0 or more"),
}


def _check_field(name: str, value) -> None:
    """`value` has the type and range of the MoE field `name` (a ValueError that names the field and the fix)."""
    if value is None and name in _NULLABLE:
        return
    if name in _FIELD_TYPES:
        kind = _FIELD_TYPES[name]
        if not _is(value, kind):
            raise ValueError(f"{name} must be {kind}, got {_brief(value)} ({type(value).__name__}).")
    elif name in _LIST_FIELDS:
        kind = _LIST_FIELDS[name]
        if not (isinstance(value, (list, tuple)) and all(_is(v, kind) for v in value)):
            raise ValueError(f"{name} must be a list of {'ints' if kind == _INT else 'strings'}, got {_brief(value)}.")
        return
    elif name in _DICT_FIELDS:
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be an object, got {_brief(value)}.")
        return
    if name in _RANGES and not _RANGES[name][0](value):
        raise ValueError(f"{name} {_RANGES[name][1]}, got {_brief(value)}.")
    if name == "hf_moe_format" and value > CHECKPOINT_FORMAT_VERSION:
        raise ValueError(
            f"This config was written by a newer hf_moe (checkpoint format {value}); "
            f"hf_moe {__version__} reads format {CHECKPOINT_FORMAT_VERSION} and older. "
            "Upgrade hf_moe: `pip install -U hf-moe`."
        )
    if name == "router_type" and value not in ROUTERS:
        raise ValueError(
            f"Unknown router_type {_brief(value)}. Registered routers: {', '.join(sorted(ROUTERS))}. "
            "A custom router must be registered (@hf_moe.register_router) before the config is created."
        )
    if name == "expert_hidden_act" and value not in ACT2FN:
        raise ValueError(
            f"expert_hidden_act {_brief(value)} is not an activation of transformers "
            "(a key of transformers.activations.ACT2FN, e.g. 'silu', 'gelu')."
        )


def _check_fields(config) -> None:
    """Every MoE field of `config` has its type and range: `num_experts: "4"` or `moe_layers: ["0"]` is an error
    that names the field."""
    for name in (*_FIELD_TYPES, *_LIST_FIELDS, *_DICT_FIELDS):
        _check_field(name, getattr(config, name))


def check_layout_kwargs(directory: str, kwargs: dict) -> None:
    """A keyword argument of `from_pretrained` may change how the loaded model runs (`num_experts_per_tok`,
    `router_skip_threshold`, ...), not which tensors it has: a larger `num_experts` would be allocated in full before
    the checkpoint's tensors are compared with it. Refused, naming the saved value, before anything is built."""
    asked = [name for name in LAYOUT_FIELDS if name in kwargs]
    if not asked or not os.path.isfile(os.path.join(directory, "config.json")):
        return
    saved, _ = MoEConfig.get_config_dict(directory)
    differ = [name for name in asked if name in saved and kwargs[name] != saved[name]]
    if differ:
        said = ", ".join(f"{name}={_brief(kwargs[name])} (the checkpoint's: {_brief(saved[name])})" for name in differ)
        raise ValueError(
            f"from_pretrained({said}): the checkpoint's tensors fix these fields, so a load cannot change them. Leave "
            "them out; to change the experts, convert again (hf_moe.convert_to_moe) or shrink (hf_moe.shrink)."
        )


def _empty_config(base_model_type: str) -> MoEConfig:
    cls = moe_config_class(_base_config_class(base_model_type))
    return object.__new__(cls)


def _base_config_class(base_model_type: str | None) -> type[PreTrainedConfig]:
    if base_model_type is None:
        raise ValueError(
            "MoEConfig needs the base model's type (`base_model_type`, e.g. 'llama'). Build it from a dense "
            "config with `MoEConfig.from_base(config, num_experts=..., num_experts_per_tok=...)`, or convert a "
            "model with `hf_moe.convert_to_moe`."
        )
    if base_model_type == MoEConfig.model_type or base_model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"Unknown base_model_type {base_model_type!r}: it is not a model type of transformers "
            f"{__import__('transformers').__version__}. Is the checkpoint from a newer transformers?"
        )
    return CONFIG_MAPPING[base_model_type]


_CONFIG_CLASSES: dict[type[PreTrainedConfig], type[MoEConfig]] = {}
_CONFIG_CLASS_HOOKS: list[Callable[[type[MoEConfig]], None]] = []


def add_config_class_hook(hook: Callable[[type[MoEConfig]], None]) -> None:
    """Call `hook(cls)` for every specialised config class, those made so far and each new one.

    The one extension point of this module: it lets `hf_moe.auto` register the model classes of a new base with
    transformers' Auto classes, while this module stays below the model code (it imports nothing of it).
    """
    if hook in _CONFIG_CLASS_HOOKS:
        return
    _CONFIG_CLASS_HOOKS.append(hook)
    for cls in list(_CONFIG_CLASSES.values()):
        hook(cls)


def moe_config_class(base_config_class: type[PreTrainedConfig]) -> type[MoEConfig]:
    """The `MoEConfig` subclass that also derives from `base_config_class` (e.g. `MoELlamaConfig`), made on first
    use and announced to the hooks of `add_config_class_hook`."""
    if base_config_class in _CONFIG_CLASSES:
        return _CONFIG_CLASSES[base_config_class]
    if issubclass(base_config_class, MoEConfig):
        raise ValueError(f"{base_config_class.__name__} is already an MoE config class.")
    name = f"MoE{base_config_class.__name__}"
    namespace = {
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": f"`MoEConfig` over `{base_config_class.__name__}`.",
        "model_type": MoEConfig.model_type,
        "base_config_class": base_config_class,
    }
    cls = _CONFIG_CLASSES[base_config_class] = type(name, (MoEConfig, base_config_class), namespace)
    setattr(sys.modules[__name__], name, cls)
    for hook in _CONFIG_CLASS_HOOKS:
        hook(cls)
    return cls


def __getattr__(name: str):
    # Lets pickle find a specialised class in a fresh process: `MoELlamaConfig` -> moe_config_class(LlamaConfig).
    if name.startswith("MoE"):
        for config_class in CONFIG_MAPPING.values():
            if config_class.__name__ == name[3:] and not issubclass(config_class, MoEConfig):
                return moe_config_class(config_class)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
