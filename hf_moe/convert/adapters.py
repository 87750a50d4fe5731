"""Where a family's MLP lives, and how to read it.

Detection is generic: the decoder layers are the model's `ModuleList` of `num_hidden_layers` modules, and the
MLP is found by the projection names the ecosystem uses (`gate_proj/up_proj/down_proj`, `gate_up_proj`,
`c_fc/c_proj`, `dense_h_to_4h/dense_4h_to_h`, `fc1/fc2`, ...), in a child module (`mlp`, `feed_forward`, ...) or
directly in the decoder layer (OPT). Every extraction is then *verified*: the canonical weights are run through
the expert computation and compared with the original module's own forward on a random input, so a wrong guess
(activation, gate/up order, Conv1D orientation) is an error, never a silently different model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.pytorch_utils import Conv1D

MLP_MODULE_NAMES = ("mlp", "feed_forward", "ffn", "ff", "mlp_block", "feedforward")
# (gate, up, down) of gated MLPs.
GLU_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
# (gate_up, down): gate and up stacked in one projection (Phi-3).
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


class NoMLPFoundError(ValueError):
    """The model has no MLP that hf_moe can turn into experts."""


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
    act: attribute holding the activation, or None to read it from the config.
    """

    module_path: str
    up: str
    down: str
    gate: str | None = None
    fused: bool = False
    act: str | None = None

    @property
    def block_path(self) -> str:
        """Where the MoE block goes: in place of the MLP module, or of the first projection if inline."""
        return self.module_path or self.up

    @property
    def bypassed_paths(self) -> tuple[str, ...]:
        """Inline parts of the MLP that the block replaces, to become identities."""
        if self.module_path:
            return ()
        return tuple(p for p in (self.act, self.down) if p)


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


def find_mlp(layer: nn.Module) -> MLPSpec:
    """Locate the MLP of one decoder layer by the ecosystem's projection names."""
    candidates = [(name, getattr(layer, name)) for name in MLP_MODULE_NAMES if isinstance(getattr(layer, name, None), nn.Module)]
    candidates.append(("", layer))  # projections directly in the layer (OPT)
    for path, owner in candidates:
        act = next((a for a in ACT_ATTR_NAMES if a in owner._modules or callable(owner.__dict__.get(a))), None)
        for gate_up, down in FUSED_GLU_NAMES:
            if _projections(owner, (gate_up, down)):
                return MLPSpec(path, up=gate_up, down=down, fused=True, act=act)
        for gate, up, down in GLU_NAMES:
            if _projections(owner, (gate, up, down)):
                return MLPSpec(path, up=up, down=down, gate=gate, act=act)
        for up, down in PLAIN_NAMES:
            if _projections(owner, (up, down)):
                return MLPSpec(path, up=up, down=down, act=act)
    children = ", ".join(f"{n} ({type(m).__name__})" for n, m in layer.named_children()) or "none"
    raise NoMLPFoundError(
        f"Could not find an MLP to convert in {type(layer).__name__}. Its children are: {children}. hf_moe looks "
        f"for a child named one of {', '.join(MLP_MODULE_NAMES)} (or the layer itself) holding Linear/Conv1D "
        "projections named gate_proj/up_proj/down_proj, gate_up_proj/down_proj, c_fc/c_proj, "
        "dense_h_to_4h/dense_4h_to_h, fc1/fc2, fc_in/fc_out or w1/w2/w3."
    )


def _linear_weight(module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [out, in], bias [out] or None), detached."""
    weight = module.weight.detach()
    if isinstance(module, Conv1D):  # Conv1D stores [in, out]
        weight = weight.t()
    bias = module.bias.detach() if module.bias is not None else None
    return weight, bias


def activation_name(act, config=None) -> str:
    """The ACT2FN key that computes exactly what `act` (a module or function) computes."""
    declared = [getattr(config, n, None) for n in CONFIG_ACT_NAMES] if config is not None else []
    declared = [n for n in declared if isinstance(n, str) and n in ACT2FN]
    if act is None:
        if declared:
            return declared[0]
        raise NoMLPFoundError("The MLP has no activation module and the config names no known activation.")
    probe = torch.linspace(-8, 8, 2001, dtype=torch.float32)
    with torch.no_grad():
        target = act(probe)
        for name in dict.fromkeys([*declared, *ACT2FN.keys()]):
            try:
                if torch.equal(ACT2FN[name](probe), target):
                    return name
            except Exception:  # some entries need extra arguments or optional packages
                continue
    raise NoMLPFoundError(f"The MLP's activation {act!r} matches no entry of transformers' ACT2FN.")


def extract_mlp(layer: nn.Module, spec: MLPSpec, config=None) -> DenseMLP:
    """Read the dense MLP of `layer` into canonical form, and verify it against the layer's own modules."""
    owner = layer.get_submodule(spec.module_path) if spec.module_path else layer
    act_obj = (owner._modules.get(spec.act) or owner.__dict__.get(spec.act)) if spec.act else None
    act = activation_name(act_obj, config)
    up, up_bias = _linear_weight(getattr(owner, spec.up))
    down, down_bias = _linear_weight(getattr(owner, spec.down))
    dropout = max((m.p for m in owner.modules() if isinstance(m, nn.Dropout)), default=0.0) if spec.module_path else 0.0
    if spec.gate is not None:
        gate, gate_bias = _linear_weight(getattr(owner, spec.gate))
        candidates = [DenseMLP(up, down, gate, up_bias, gate_bias, down_bias, act, dropout)]
    elif spec.fused:
        # Stacked [gate; up] (Phi-3, GLM) is the common order; [up; gate] exists too. Verification decides.
        first, second = up.chunk(2, dim=0)
        b1, b2 = up_bias.chunk(2) if up_bias is not None else (None, None)
        candidates = [
            DenseMLP(second, down, first, b2, b1, down_bias, act, dropout),
            DenseMLP(first, down, second, b1, b2, down_bias, act, dropout),
        ]
    else:
        candidates = [DenseMLP(up, down, None, up_bias, None, down_bias, act, dropout)]

    reference = _reference_forward(owner, spec)
    for candidate in candidates:
        error = _verify(candidate, reference)
        if error is None:
            return candidate
    raise NoMLPFoundError(
        f"hf_moe read the MLP of {type(layer).__name__} ({spec}) but could not reproduce its output "
        f"({error}). Its forward computes something beyond act(x W_up) W_down or a GLU."
    )


def _reference_forward(owner: nn.Module, spec: MLPSpec):
    if spec.module_path:
        return owner
    # Inline MLP: compose the layer's own modules in the order the layer applies them.
    up, down = getattr(owner, spec.up), getattr(owner, spec.down)
    act = (owner._modules.get(spec.act) or owner.__dict__.get(spec.act)) if spec.act else (lambda x: x)
    return lambda x: down(act(up(x)))


def expert_forward(mlp: DenseMLP, x: torch.Tensor) -> torch.Tensor:
    """What one upcycled expert computes: [N, H] -> [N, H]."""
    act = ACT2FN[mlp.act]
    h = nn.functional.linear(x, mlp.up, mlp.up_bias)
    if mlp.glu:
        h = act(nn.functional.linear(x, mlp.gate, mlp.gate_bias)) * h
    else:
        h = act(h)
    return nn.functional.linear(h, mlp.down, mlp.down_bias)


@torch.no_grad()
def _verify(mlp: DenseMLP, reference) -> str | None:
    """None if the canonical MLP reproduces `reference` on a random input, else a description of the gap."""
    if mlp.up.device.type == "meta":
        return None
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(8, mlp.hidden_size, generator=generator).to(device=mlp.up.device, dtype=mlp.up.dtype)
    was_training = getattr(reference, "training", False)
    if isinstance(reference, nn.Module):
        reference.eval()
    try:
        expected = reference(x)
    finally:
        if isinstance(reference, nn.Module):
            reference.train(was_training)
    if isinstance(expected, tuple):
        return "the MLP returns a tuple"
    got = expert_forward(mlp, x)
    if got.shape != expected.shape:
        return f"shape {tuple(got.shape)} instead of {tuple(expected.shape)}"
    tol = 1e-4 if x.dtype == torch.float32 else 2e-2
    gap = (got.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    return None if gap <= tol * max(scale, 1.0) else f"max abs difference {gap:.3g} on outputs of size {scale:.3g}"
