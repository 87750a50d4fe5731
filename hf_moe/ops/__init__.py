"""Dispatch ops, their implementations, and the expert computation built from them.

`experts_forward(experts, hidden_states, top_k_index, top_k_weights)` is the one entry point of the MoE block
(and of transformers' `ExpertsInterface` under the name "hf_moe"). It runs the fused op, or `ExpertsFunction`
(experts.py) composing the ops, of one of three implementations:

  * compiled: `torch.ops.hf_moe.*` from csrc/ (C++ with OpenMP, CPU), built on first use;
  * triton:   `torch.ops.hf_moe_triton.*` from triton/ (GPU; CPU tensors under TRITON_INTERPRET=1), with torch's
              grouped_mm for the GEMMs where it is the fast path (bf16 on sm90/sm100);
  * torch:    `reference.py`, always available, and the oracle the others are tested against.

`HF_MOE_BACKEND` (extension.py): auto (default) runs compiled on CPU and triton on CUDA, falling back to torch
with one warning; compiled makes that fallback an error; triton and torch force one implementation everywhere.
`backend_report()` (and `python -m hf_moe.env`) says which one runs and why.

The first call may be traced (`torch.compile(fullgraph=True)`, `torch.export`): what is decided on the host (loading
or building the extension, picking the variant, naming a transformers experts module's activation) runs outside
the traced region (`torch.compiler.assume_constant_result`, and no tensor is computed to decide), and every op
that reaches a graph has a shape function and a backward formula of its own (extension.py, autograd.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import torch

from . import reference
from .activations import activation_key
from .experts import DispatchOps, ExpertsFunction, run_experts
from .extension import backend_setting, load_extension

__all__ = [
    "DispatchOps", "ExpertsFunction", "backend_report", "dispatch_ops", "experts_forward", "kernel_activation",
    "use_backend",
]

REFERENCE = DispatchOps(
    "torch",
    reference.sort_by_expert,
    reference.permute,
    reference.unpermute,
    reference.grouped_mm,
    reference.grouped_mm_weight_grad,
    reference.expert_act,
    reference.expert_act_backward,
)

# ACT2FN key -> name of the compiled activation that computes the same function.
_KERNEL_NAMES = {
    "silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",  # the tanh GELU with its constants written out (what Bloom's MLP computes)
    "relu": "relu", "relu2": "relu2",
}


def kernel_activation(name: str) -> str:
    """The compiled kernel's name for an ACT2FN activation, or the ACT2FN name if no kernel implements it."""
    return _KERNEL_NAMES.get(name, name)


_loaded: dict[str, object] = {}  # "ops": the compiled DispatchOps or None


@torch.compiler.disable  # loading (maybe building) the extension is never traced
def _load() -> None:
    module, status = load_extension()
    ops = torch.ops.hf_moe if module is not None else None
    _loaded["ops"] = None if ops is None else DispatchOps(
        "compiled", ops.sort_by_expert, ops.permute, ops.unpermute, ops.grouped_mm, ops.grouped_mm_weight_grad,
        ops.expert_act, ops.expert_act_backward, ops.moe_experts_forward, ops.moe_experts_backward,
    )


def _compiled() -> DispatchOps | None:
    """The compiled ops, loading (and on first use building) the extension; None when unavailable."""
    if "ops" not in _loaded:
        _load()
    return _loaded["ops"]


BACKENDS = ("torch", "compiled", "triton")
_forced: list[str] = []


@contextlib.contextmanager
def use_backend(name: str):
    """Run the ops of `name` ("torch", "compiled" or "triton") inside the block, whatever HF_MOE_BACKEND says."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "compiled" and _compiled() is None:
        raise RuntimeError(f"the compiled backend is unavailable: {load_extension()[1].how}")
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()


def _triton_status(device_type: str) -> tuple[bool, str]:
    from . import triton as triton_ops

    return triton_ops.status(device_type)


@torch.compiler.disable  # decided once per device type, outside any trace
def _choose(device_type: str) -> str:
    """The backend HF_MOE_BACKEND selects for tensors on `device_type`; warns (auto) or raises (compiled) when the
    preferred one cannot run."""
    setting = backend_setting()
    if setting in ("torch", "triton"):
        return setting
    if device_type == "cpu":
        return "compiled" if _compiled() is not None else "torch"  # load_extension warned or raised
    if device_type != "cuda":
        return "torch"
    usable, why = _triton_status("cuda")
    if usable:
        return "triton"
    if setting == "compiled":
        raise RuntimeError(f"HF_MOE_BACKEND=compiled, but the Triton kernels cannot run on CUDA: {why}.")
    warnings.warn(f"hf_moe: the Triton kernels cannot run on CUDA ({why}); running the pure-torch ops instead "
                  "(correct, slower). See `python -m hf_moe.env`.", RuntimeWarning, stacklevel=3)
    return "torch"


@torch.compiler.disable  # built once per (backend, device, activation), outside any trace
def _variant(backend: str, device_type: str, activation: str) -> DispatchOps:
    if backend == "torch":
        return REFERENCE
    if backend == "triton":
        usable, why = _triton_status(device_type)
        if not usable:
            raise RuntimeError(f"the Triton backend cannot run on {device_type} tensors: {why}.")
        from . import triton as triton_ops

        return triton_ops.dispatch_ops(activation)
    if device_type != "cpu":
        raise RuntimeError(f"the compiled backend (C++) runs on CPU tensors, not {device_type}; on CUDA use "
                           "'triton' (the default there) or 'torch'.")
    compiled = _compiled()
    if activation not in reference.KERNEL_ACTIVATIONS:
        return dataclasses.replace(
            compiled, name=compiled.name + ", activation in torch", expert_act=reference.expert_act,
            expert_act_backward=reference.expert_act_backward, fused_forward=None, fused_backward=None,
        )
    return compiled


def dispatch_ops(device: torch.device, activation: str) -> DispatchOps:
    """The ops to run on `device` for `activation` (a kernel name, see `kernel_activation`)."""
    key = (_forced[-1] if _forced else None, device.type, activation)
    _select(key)
    return _variants[key]


_chosen: dict[str, str] = {}  # device type -> the backend HF_MOE_BACKEND selects there
_variants: dict[tuple[str | None, str, str], DispatchOps] = {}


@torch.compiler.assume_constant_result  # traced calls run it at trace time: loading and choosing are never traced
def _select(key: tuple[str | None, str, str]) -> bool:
    """Pick the ops for (forced backend or None, device type, activation) into `_variants`, once per key, loading
    (maybe building) the extension on the way."""
    if key not in _variants:
        backend, device_type, activation = key
        if backend is None:
            if device_type not in _chosen:
                _chosen[device_type] = _choose(device_type)
            backend = _chosen[device_type]
        _variants[key] = _variant(backend, device_type, activation)
    return True


def _activation_of(experts: torch.nn.Module) -> str:
    """The ACT2FN name of an experts module's activation: ours store it; transformers' hold an ACT2FN module,
    recognised by its class and settings (never by computing it, so traced calls see the same answer)."""
    name = getattr(experts, "activation", None)
    if name is None:
        name = activation_key(experts.act_fn)
    if name is None:
        raise ValueError(
            f"hf_moe cannot tell which activation {experts.act_fn!r} of {type(experts).__name__} computes: it is "
            "not one that transformers' ACT2FN builds. Give the experts module an `activation` attribute naming "
            "the ACT2FN key that computes the same function."
        )
    return name


def experts_forward(
    experts: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """Run each token through its k experts and combine the outputs with the routing weights.

    `experts` follows transformers' fused-experts layout: `num_experts`, `has_gate`, `act_fn`, and either
    `gate_up_proj` [E, 2I, H] (gate rows first) or `up_proj` [E, I, H], then `down_proj` [E, H, I], with
    optional `*_bias` [E, out].

    Args:
        hidden_states: [N, H]; top_k_index: [N, k] int; top_k_weights: [N, k].
    Returns:
        [N, H] in `hidden_states.dtype`.
    """
    activation = kernel_activation(_activation_of(experts))
    ops = dispatch_ops(hidden_states.device, activation)
    if experts.has_gate:
        w1, b1 = experts.gate_up_proj, getattr(experts, "gate_up_proj_bias", None)
    else:
        w1, b1 = experts.up_proj, getattr(experts, "up_proj_bias", None)
    b2 = getattr(experts, "down_proj_bias", None)
    return run_experts(
        ops, hidden_states, top_k_index, top_k_weights, w1, b1, experts.down_proj, b2, activation, experts.has_gate
    )


def backend_report() -> dict[str, tuple[str, str]]:
    """{op: (implementation, why)} for this process: the ops on CPU, then the experts on CUDA and Triton."""
    setting = backend_setting()
    ops = ["sort_by_expert", "permute", "grouped_mm", "grouped_mm_weight_grad", "expert_act", "unpermute"]
    if setting == "triton":
        usable, why = _triton_status("cpu")
        impl = "triton (interpreter)" if usable else "triton: cannot run here, the ops raise"
        report = {op: (impl, f"HF_MOE_BACKEND=triton; {why}") for op in ops}
        report["experts (whole layer)"] = ("triton: the ops above, permute fused into the GEMMs", why)
    else:
        report = _cpu_report(setting)
    report.update(_cuda_report(setting))
    return report


def _cpu_report(setting: str) -> dict[str, tuple[str, str]]:
    module, status = load_extension()
    ops = ["sort_by_expert", "permute", "grouped_mm", "grouped_mm_weight_grad", "expert_act", "unpermute"]
    if module is None:
        report = {op: ("torch", status.how) for op in ops}
        report["experts (whole layer)"] = ("torch: composed from the ops above", status.how)
        return report
    why = f"{status.how}; HF_MOE_BACKEND={setting}"
    report = {op: ("compiled C++ (OpenMP)", why) for op in ops}
    report["grouped_mm"] = ("compiled C++: one call, a GEMM per expert", why)
    report["expert_act"] = ("compiled C++: silu, gelu, gelu_tanh, relu, relu2", "other activations run in torch")
    report["experts (whole layer)"] = ("compiled C++: fused, one call forward, one backward", "CPU")
    return report


def _cuda_report(setting: str) -> dict[str, tuple[str, str]]:
    report = {}
    usable, why = _triton_status("cuda")
    if setting == "torch":
        report["experts on CUDA"] = ("torch", "HF_MOE_BACKEND=torch")
    elif usable:
        report["experts on CUDA"] = ("triton: every op above, permute fused into the GEMMs", why)
        report["GEMMs on CUDA"] = ("torch grouped_mm for bf16 on sm90/sm100, else triton",
                                   "torch's other grouped_mm paths copy the group sizes to the host")
    else:
        fallback = "none: an error" if setting in ("compiled", "triton") else "torch"
        report["experts on CUDA"] = (fallback, f"Triton not selected: {why}")
    return report
