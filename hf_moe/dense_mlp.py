"""Where a family keeps its decoder layers and MLP, and how to read the MLP's weights (a leaf: imports only compat).

Detection is generic, so that any Hugging Face causal LM whose MLP is `act(x W_up) W_down` or a GLU converts
without code of its own for the family:

* the decoder layers are the model's `ModuleList` of `num_hidden_layers` modules;
* the MLP is a child named `mlp`, `feed_forward`, `ffn`, ... (or the decoder layer itself, as in OPT), and its
  projections are found by the ecosystem's names (`gate_proj/up_proj/down_proj`, `gate_up_proj`, `c_fc/c_proj`,
  `dense_h_to_4h/dense_4h_to_h`, `fc1/fc2`, ...) or, failing that, by their shapes (H -> I -> H, two H -> I
  projections and one I -> H, or a fused H -> 2I);
* the activation is the module the MLP names `act_fn`/`act`/... (or its one parameter-free child), matched
  numerically against transformers' `ACT2FN`; when the forward calls a function instead (`F.silu(...)`), it is
  read from what the forward computes: the input of the down projection against the projections' outputs.
* an MLP whose forward takes more than the hidden states (Bloom and MPT add the residual inside it) keeps its
  forward: the block replaces its up projection, and its activation and down projection become identities.

Every extraction is then *verified*: the canonical weights are run through the expert computation and compared
with the original module's own forward on a random input, so a wrong guess (activation, gate/up order, Conv1D
orientation) is an error, never a silently different model.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers.activations import ACT2FN

from .compat import Conv1D

MLP_MODULE_NAMES = ("mlp", "feed_forward", "ffn", "ff", "mlp_block", "feedforward")
# (gate, up, down) of gated MLPs.
GLU_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
# (gate_up, down): gate and up stacked in one projection (Phi-3, GLM).
FUSED_GLU_NAMES = (("gate_up_proj", "down_proj"),)
# (up, down) of plain MLPs.
PLAIN_NAMES = (
    ("up_proj", "down_proj"),
    ("c_fc", "c_proj"),
    ("dense_h_to_4h", "dense_4h_to_h"),
    ("fc1", "fc2"),
    ("fc_in", "fc_out"),
    ("w1", "w2"),
)
ACT_ATTR_NAMES = ("act_fn", "act", "activation_fn", "activation", "act_func", "activation_func")
CONFIG_ACT_NAMES = ("hidden_act", "hidden_activation", "activation_function", "activation")
_SEARCHED = (
    "Linear/Conv1D projections named gate_proj/up_proj/down_proj, gate_up_proj/down_proj, c_fc/c_proj, "
    "dense_h_to_4h/dense_4h_to_h, fc1/fc2, fc_in/fc_out or w1/w2/w3, or projections shaped H->I->H, "
    "(H->I, H->I, I->H) or (H->2I, I->H)"
)


class NoMLPFoundError(ValueError):
    """The model has no MLP that hf_moe can turn into experts."""


class NonFiniteWeightsError(ValueError):
    """An MLP to convert holds NaN or infinite weights: every expert made from it would compute NaN."""


@dataclass
class DenseMLP:
    """One dense MLP in canonical form. Weights use the `nn.Linear` layout [out, in].

    gate, up: [I, H] (gate is None for plain MLPs); down: [H, I]; biases [I] / [H] or None.
    """

    up: torch.Tensor
    down: torch.Tensor
    gate: torch.Tensor | None
    up_bias: torch.Tensor | None
    gate_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    act: str
    dropout: float = 0.0

    @property
    def glu(self) -> bool:
        return self.gate is not None

    @property
    def has_bias(self) -> bool:
        return any(b is not None for b in (self.up_bias, self.gate_bias, self.down_bias))

    @property
    def kind(self) -> tuple:
        """What the MLPs converted into one model must share: (glu, has_bias, act, hidden_size, intermediate_size)."""
        return (self.glu, self.has_bias, self.act, self.hidden_size, self.intermediate_size)

    @property
    def hidden_size(self) -> int:
        return self.up.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.up.shape[0]


@dataclass(frozen=True)
class MLPSpec:
    """Where the MLP of a decoder layer is, relative to the layer.

    module_path: the MLP module ("mlp"), or "" when the projections sit in the layer itself.
    up/gate/down: projection names inside that module; `fused` when `up` holds [gate; up] (or [up; gate]).
    act: attribute holding the activation, or None when the forward calls a function (or only the config names it).
    inline: the MoE block replaces the up projection, and the activation and down projection become identities,
        instead of the block replacing the whole MLP module. True when the projections sit in the decoder layer
        (OPT) or when the MLP's forward does more than the MLP (Bloom and MPT add the residual inside it).
    """

    module_path: str
    up: str
    down: str
    gate: str | None = None
    fused: bool = False
    act: str | None = None
    inline: bool = False

    @property
    def block_path(self) -> str:
        """Where the MoE block goes: in place of the MLP module, or of its up projection if inline."""
        return _join(self.module_path, self.up) if self.inline else self.module_path

    @property
    def bypassed_paths(self) -> tuple[str, ...]:
        """Inline parts of the MLP that the block replaces, to become identities."""
        if not self.inline:
            return ()
        return tuple(_join(self.module_path, p) for p in (self.act, self.down) if p)


def _join(*names: str) -> str:
    return ".".join(n for n in names if n)


# ----------------------------------------------------------------------------------------------------------------
# Finding the layers and the MLP
# ----------------------------------------------------------------------------------------------------------------
def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's decoder layers: the first ModuleList with `num_hidden_layers` entries."""
    num_layers = model.config.get_text_config().num_hidden_layers
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers and name:
            return name, module
    raise NoMLPFoundError(
        f"Could not find the decoder layers of {type(model).__name__}: it has no ModuleList of "
        f"num_hidden_layers={num_layers} modules."
    )


def _is_projection(module) -> bool:
    return isinstance(module, (nn.Linear, Conv1D))


def _projections(owner: nn.Module, names) -> bool:
    return all(_is_projection(getattr(owner, n, None)) for n in names)


def _in_out(module) -> tuple[int, int]:
    """(in_features, out_features) of a Linear or Conv1D (which stores its weight as [in, out])."""
    rows, cols = module.weight.shape
    return (rows, cols) if isinstance(module, Conv1D) else (cols, rows)


def find_mlp(layer: nn.Module) -> MLPSpec:
    """Locate the MLP of one decoder layer: by the ecosystem's projection names, then by projection shapes."""
    for path in MLP_MODULE_NAMES:
        owner = getattr(layer, path, None)
        if isinstance(owner, nn.Module):
            spec = _named_spec(owner, path) or _shaped_spec(owner, path)
            if spec is not None:
                return spec
    spec = _named_spec(layer, "")  # projections directly in the layer (OPT); never by shape: attention has some too
    if spec is not None:
        return spec
    children = ", ".join(f"{n} ({type(m).__name__})" for n, m in layer.named_children()) or "none"
    raise NoMLPFoundError(
        f"Could not find an MLP to convert in {type(layer).__name__}. Its children are: {children}. hf_moe looks "
        f"for a child named one of {', '.join(MLP_MODULE_NAMES)} (or the layer itself) holding {_SEARCHED}."
    )


def _named_spec(owner: nn.Module, path: str) -> MLPSpec | None:
    for gate_up, down in FUSED_GLU_NAMES:
        if _projections(owner, (gate_up, down)):
            return _spec(owner, path, up=gate_up, down=down, fused=True)
    for gate, up, down in GLU_NAMES:
        if _projections(owner, (gate, up, down)):
            return _spec(owner, path, up=up, down=down, gate=gate)
    for up, down in PLAIN_NAMES:
        if _projections(owner, (up, down)):
            return _spec(owner, path, up=up, down=down)
    return None


def _shaped_spec(owner: nn.Module, path: str) -> MLPSpec | None:
    """An MLP recognised by the shapes of its direct projections, whatever their names (CTRL's `nn.Sequential`,
    ModernBERT's fused `Wi`/`Wo`). Definition order breaks ties; verification catches a wrong reading."""
    shapes = {n: _in_out(m) for n, m in owner.named_children() if _is_projection(m)}
    names = list(shapes)
    if len(names) == 2:
        for up, down in (names, names[::-1]):
            (hidden, inner), (inner_in, out) = shapes[up], shapes[down]
            if out == hidden and inner == inner_in:
                return _spec(owner, path, up=up, down=down)
            if out == hidden and inner == 2 * inner_in:
                return _spec(owner, path, up=up, down=down, fused=True)
    if len(names) == 3:
        for down in reversed(names):
            gate, up = (n for n in names if n != down)
            inner, hidden = shapes[down]
            if shapes[gate] == shapes[up] == (hidden, inner):
                return _spec(owner, path, up=up, down=down, gate=gate)
    return None


def _spec(owner: nn.Module, path: str, up: str, down: str, gate: str | None = None, fused: bool = False) -> MLPSpec:
    act = _activation_attr(owner, in_layer=not path, projections=(up, down, gate))
    return MLPSpec(path, up, down, gate, fused, act, inline=not path or _extra_inputs(owner) > 0)


def _activation_attr(owner: nn.Module, in_layer: bool, projections) -> str | None:
    """The attribute holding the activation: one of ACT_ATTR_NAMES or, inside an MLP module, its one child that
    has no parameters and is no projection or dropout (Bloom's `gelu_impl`, the `1` of an `nn.Sequential`)."""
    named = next(
        (a for a in ACT_ATTR_NAMES if owner._modules.get(a) is not None or callable(owner.__dict__.get(a))), None
    )
    if named is not None or in_layer:  # a decoder layer has other parameter-free children (dropouts, rotary, ...)
        return named
    others = [
        n for n, m in owner.named_children()
        if n not in projections and not isinstance(m, (nn.Dropout, nn.Identity)) and next(m.parameters(), None) is None
    ]
    return others[0] if len(others) == 1 else None


def _extra_inputs(owner: nn.Module) -> int:
    """How many required inputs the module's forward takes besides the hidden states (Bloom's MLP: the residual)."""
    params = list(inspect.signature(owner.forward).parameters.values())[1:]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.default is inspect.Parameter.empty and p.kind in positional for p in params)


# ----------------------------------------------------------------------------------------------------------------
# Activations
# ----------------------------------------------------------------------------------------------------------------
def _declared_activations(config) -> list[str]:
    declared = [getattr(config, n, None) for n in CONFIG_ACT_NAMES] if config is not None else []
    return [n for n in declared if isinstance(n, str) and n in ACT2FN]


def _closest_activation(compute: Callable[[Callable], torch.Tensor], target: torch.Tensor, preferred) -> str | None:
    """The ACT2FN key for which `compute(activation)` equals `target`: an exact match, preferring `preferred` keys,
    else the closest within a few roundings of `target`'s dtype (another formula of the same function, as the tanh
    GELU through a sigmoid). None if none.

    Keys whose activation has parameters are skipped: an expert applies a fixed function.
    """
    tolerance = 4 * torch.finfo(target.dtype).eps  # relative to 1 + |target|, element by element
    best, best_gap = None, math.inf
    for name in dict.fromkeys([*preferred, *ACT2FN.keys()]):
        try:
            fn = ACT2FN[name]
            if isinstance(fn, nn.Module) and next(fn.parameters(), None) is not None:
                continue
            got = compute(fn)
        except Exception:  # some entries need optional packages
            continue
        if got.shape != target.shape:
            continue
        if torch.equal(got, target):
            return name
        gap = ((got.float() - target.float()).abs() / (1 + target.float().abs())).max().item()
        if gap < best_gap:
            best, best_gap = name, gap
    return best if best_gap <= tolerance else None


def activation_name(act, config=None) -> str:
    """The ACT2FN key that computes what `act` (a module or function) computes, exactly or to fp32 rounding."""
    declared = _declared_activations(config)
    if act is None:
        if declared:
            return declared[0]
        raise NoMLPFoundError("The MLP has no activation module and the config names no known activation.")
    params = [n for n, _ in act.named_parameters()] if isinstance(act, nn.Module) else []
    if params:
        raise NoMLPFoundError(
            f"The MLP's activation {type(act).__name__} has learnable parameters ({', '.join(params)}): hf_moe's "
            "experts apply a fixed ACT2FN activation, so they cannot reproduce it."
        )
    buffer = next(act.buffers(), None) if isinstance(act, nn.Module) else None
    probe = torch.linspace(-8, 8, 2001, dtype=torch.float32, device=buffer.device if buffer is not None else "cpu")
    with torch.no_grad():
        try:
            target = act(probe)
        except Exception as err:
            raise NoMLPFoundError(f"The MLP's activation {act!r} is not an elementwise function: {err}") from err
        name = _closest_activation(lambda fn: fn(probe), target, declared)
    if name is None:
        raise NoMLPFoundError(f"The MLP's activation {act!r} matches no entry of transformers' ACT2FN.")
    return name


# ----------------------------------------------------------------------------------------------------------------
# Reading and verifying
# ----------------------------------------------------------------------------------------------------------------
Weights = tuple[torch.Tensor, "torch.Tensor | None"]


def _linear_weight(module) -> Weights:
    """(weight [out, in], bias [out] or None), detached."""
    weight = module.weight.detach()
    if isinstance(module, Conv1D):  # Conv1D stores [in, out]
        weight = weight.t()
    bias = module.bias.detach() if module.bias is not None else None
    return weight, bias


def _layouts(owner: nn.Module, spec: MLPSpec) -> list[tuple[Weights | None, Weights]]:
    """The (gate, up) readings to try, most likely first. Names are conventions, so a GLU is tried both ways round,
    and a fused projection both as [gate; up] (Phi-3, GLM) and as [up; gate]. Verification decides."""
    up = _linear_weight(getattr(owner, spec.up))
    if spec.gate is not None:
        gate = _linear_weight(getattr(owner, spec.gate))
        return [(gate, up), (up, gate)]
    if spec.fused:
        (first, second), bias = up[0].chunk(2, dim=0), up[1]
        b1, b2 = bias.chunk(2) if bias is not None else (None, None)
        return [((first, b1), (second, b2)), ((second, b2), (first, b1))]
    return [(None, up)]


def _attr(owner: nn.Module, name: str | None):
    """A child module or a plain attribute (a function) of `owner`; None if absent."""
    if name is None:
        return None
    module = owner._modules.get(name)
    return module if module is not None else owner.__dict__.get(name)


def extract_mlp(layer: nn.Module, spec: MLPSpec, config=None) -> DenseMLP:
    """Read the dense MLP of `layer` into canonical form, and verify it against the layer's own modules."""
    owner = layer.get_submodule(spec.module_path) if spec.module_path else layer
    _check_replaceable(owner, spec)
    down, down_bias = _linear_weight(getattr(owner, spec.down))
    replaces_module = bool(spec.module_path) and not spec.inline
    dropout = max((m.p for m in owner.modules() if isinstance(m, nn.Dropout)), default=0.0) if replaces_module else 0.0
    layouts = _layouts(owner, spec)
    act_obj = _attr(owner, spec.act)
    probe = None if down.device.type == "meta" else _Probe(owner, spec, layouts[0][1][0])
    known_act = activation_name(act_obj, config) if act_obj is not None or probe is None else None

    if probe is not None:
        _check_finite(type(layer).__name__, spec, down, down_bias, layouts)
    errors = []
    for gate, (up, up_bias) in layouts:
        act = known_act or probe.observed_activation(gate, (up, up_bias), _declared_activations(config))
        if act is None:
            errors.append("no activation in ACT2FN turns its projections' outputs into its down projection's input")
            continue
        gate_w, gate_b = gate if gate is not None else (None, None)
        candidate = DenseMLP(up, down, gate_w, up_bias, gate_b, down_bias, act, dropout)
        if probe is None:
            return candidate
        errors.append(probe.check(candidate))
        if errors[-1] is None:
            return candidate
    raise NoMLPFoundError(  # the first reading is the likeliest: its gap says most
        f"hf_moe read the MLP of {type(layer).__name__} ({spec}) but could not reproduce its output ({errors[0]}). "
        f"Its forward computes something beyond act(x W_up) W_down or a GLU{_unexplained(owner, spec)}. If only "
        "some layers are like this, convert the others with `layers=[...]`."
    )


def _check_finite(layer_name: str, spec: MLPSpec, down, down_bias, layouts) -> None:
    """The MLP's weights are finite (else its outputs are NaN, which no reading of it reproduces: say so)."""
    gate, (up, up_bias) = layouts[0]
    tensors = [t for t in (down, down_bias, up, up_bias, *(gate or ())) if t is not None]
    if not all(all_finite(t) for t in tensors):
        bad = sum(int((~torch.isfinite(t)).sum()) for t in tensors if t.is_floating_point())
        raise NonFiniteWeightsError(
            f"The MLP of {layer_name} ({spec.module_path or 'inline'}) holds {bad} NaN or infinite weight(s): every "
            "expert made from it would compute NaN. The model's training diverged, or its files are damaged: use an "
            "earlier checkpoint."
        )


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN and no infinity, with no temporary of its size (`isfinite` makes two): NaN
    propagates through max and min, and an infinity is one of them."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    return math.isfinite(float(tensor.amax())) and math.isfinite(float(tensor.amin()))


def _check_replaceable(owner: nn.Module, spec: MLPSpec) -> None:
    """An MLP whose forward does more than the MLP can only be converted piecewise: up -> block, act and down ->
    identities. That needs a plain MLP whose activation is a module (a function call cannot become an identity)."""
    if not (spec.inline and spec.module_path):
        return
    if spec.gate is not None or spec.fused or not isinstance(_attr(owner, spec.act), nn.Module):
        raise NoMLPFoundError(
            f"The forward of {type(owner).__name__} takes more than the hidden states "
            f"({', '.join(list(inspect.signature(owner.forward).parameters)[1:])}), so hf_moe must keep it and "
            "replace its projections one by one; that needs a plain MLP (up, activation module, down), and this "
            f"one is {'gated' if spec.gate or spec.fused else 'without an activation module'} ({spec})."
        )


def _unexplained(owner: nn.Module, spec: MLPSpec) -> str:
    """The MLP module's children that an expert has no counterpart for (BitNet's `ffn_sub_norm`)."""
    if not spec.module_path:
        return ""
    used = {spec.up, spec.down, spec.gate, spec.act}
    others = [
        f"{n} ({type(m).__name__})" for n, m in owner.named_children()
        if n not in used and not isinstance(m, (nn.Dropout, nn.Identity))
    ]
    return f"; besides its projections and activation it holds {', '.join(others)}" if others else ""


def expert_forward(mlp: DenseMLP, x: torch.Tensor) -> torch.Tensor:
    """What one upcycled expert computes: [N, H] -> [N, H]."""
    act = ACT2FN[mlp.act]
    h = nn.functional.linear(x, mlp.up, mlp.up_bias)
    if mlp.glu:
        h = act(nn.functional.linear(x, mlp.gate, mlp.gate_bias)) * h
    else:
        h = act(h)
    return nn.functional.linear(h, mlp.down, mlp.down_bias)


class _Expert(nn.Module):
    """A canonical MLP as a module, to stand in for an MLP's up projection during verification."""

    def __init__(self, mlp: DenseMLP):
        super().__init__()
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return expert_forward(self.mlp, x)


class _Probe:
    """A random input to one MLP, what the MLP computes on it, and what it computes with a candidate in its place.

    The input is scaled so that the first projection's outputs are O(1): there activations differ (GELU vs its
    tanh approximation), even when the weights are small. Runs in eval mode (no dropout), without gradients.
    """

    def __init__(self, owner: nn.Module, spec: MLPSpec, up_weight: torch.Tensor):
        self.owner, self.spec = owner, spec
        generator = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(8, up_weight.shape[1], generator=generator).to(device=up_weight.device, dtype=up_weight.dtype)
        self.x = x * (2.0 / nn.functional.linear(x, up_weight).float().std().clamp_min(1e-6)).to(x.dtype)
        # Inputs beyond the hidden states (Bloom's residual) are random too: the forward must match whatever they do.
        extra = _extra_inputs(owner) if spec.module_path and spec.inline else 0
        self.extras = [torch.randn(x.shape, generator=generator).to(self.x) for _ in range(extra)]
        self.down_input: torch.Tensor | None = None
        hook = getattr(owner, spec.down).register_forward_pre_hook(self._record_down_input)
        try:
            self.expected = self._run(self._dense_forward())
        finally:
            hook.remove()

    def _record_down_input(self, module, args):
        self.down_input = args[0]

    def _dense_forward(self) -> Callable:
        if self.spec.module_path:
            return self.owner
        # MLP written in the decoder layer: compose the layer's own modules in the order the layer applies them.
        up, down = getattr(self.owner, self.spec.up), getattr(self.owner, self.spec.down)
        act = _attr(self.owner, self.spec.act)
        return lambda x: down(act(up(x)) if act is not None else up(x))

    @torch.no_grad()
    def _run(self, forward: Callable):
        was_training = self.owner.training
        self.owner.eval()
        try:
            return forward(self.x, *self.extras)
        finally:
            self.owner.train(was_training)

    @torch.no_grad()
    def observed_activation(self, gate: Weights | None, up: Weights, preferred) -> str | None:
        """The ACT2FN key that turns this (gate, up) reading's outputs into what the down projection received."""
        if self.down_input is None:
            return None
        pre = nn.functional.linear(self.x, *(gate or up))
        mul = nn.functional.linear(self.x, *up) if gate is not None else None
        return _closest_activation(lambda fn: fn(pre) if mul is None else fn(pre) * mul, self.down_input, preferred)

    def check(self, mlp: DenseMLP) -> str | None:
        """None if `mlp` in the MLP's place reproduces its output, else a description of the gap."""
        if isinstance(self.expected, tuple):
            return "the MLP returns a tuple"
        if self.extras:
            with _substituted(self.owner, self.spec, mlp):
                got = self._run(self.owner)
        else:
            got = self._run(lambda x: expert_forward(mlp, x))
        if got.shape != self.expected.shape:
            return f"shape {tuple(got.shape)} instead of {tuple(self.expected.shape)}"
        tol = 1e-4 if got.dtype == torch.float32 else 2e-2
        gap = (got.float() - self.expected.float()).abs().max().item()
        scale = self.expected.float().abs().max().item()
        return None if gap <= tol * max(scale, 1.0) else f"max abs difference {gap:.3g} on outputs of size {scale:.3g}"


@contextmanager
def _substituted(owner: nn.Module, spec: MLPSpec, mlp: DenseMLP):
    """The MLP module with `mlp` in place of its up projection and identities for its activation and down
    projection, as `install_moe_blocks` will leave it; restored on exit."""
    saved = {name: owner._modules[name] for name in (spec.up, spec.act, spec.down)}
    owner._modules.update({spec.up: _Expert(mlp), spec.act: nn.Identity(), spec.down: nn.Identity()})
    try:
        yield
    finally:
        owner._modules.update(saved)
