"""Which implementation of the dispatch ops runs, and why: `HF_MOE_BACKEND`, `use_backend`, `experts_forward`.

`HF_MOE_BACKEND` (read by extension.py):
  * auto (default): on CPU the compiled C++ kernels, falling back to the pure-torch ops with one warning when the
    extension cannot be built; on CUDA, hf_moe's Triton kernels for bf16 experts on sm90, where they passed
    `python -m hf_moe.gpu_check` on an H100 and ran faster than the torch ops, and the pure-torch ops (`reference.py`:
    torch ops, and torch's own grouped GEMM where it is its fast path) everywhere else (`cuda_default`).
  * compiled: as auto, but a failed build of the C++ extension is an error (CUDA tensors run as under auto: the
    extension has no CUDA kernels);
  * triton: the Triton kernels everywhere (CUDA; CPU tensors only under TRITON_INTERPRET=1, for tests);
  * torch: the pure-torch ops everywhere (nothing is built).
`backend_report()` (and `python -m hf_moe.env`) says which one runs and why.

The first call may be traced (`torch.compile(fullgraph=True)`, `torch.export`): what is decided on the host (loading
or building the extension, picking the variant, naming a transformers experts module's activation) runs outside
the traced region (`torch.compiler.assume_constant_result`, and no tensor is computed to decide), and every op
that reaches a graph has a shape function and a backward formula of its own (library.py, autograd.py).
Under `torch.onnx.export` the experts run as standard ops only (dense.py), which every ONNX runtime has.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys

import torch

from . import infer, prefill_linears
from .dense import experts_forward as dense_experts_forward
from .activations import activation_key
from .experts import REFERENCE, DispatchOps, run_experts
from .reference import GROUPED_MM_WHY, KERNEL_ACTIVATIONS
from .extension import backend_setting, load_extension

__all__ = [
    "BACKENDS", "REFERENCE", "autocast_cast", "backend_report", "cuda_default", "dispatch_ops", "expert_weights",
    "experts_forward", "forced_backend", "kernel_activation", "use_backend",
]

# ACT2FN key -> name of the compiled activation that computes the same function.
_KERNEL_NAMES = {
    "silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",  # the tanh GELU with its constants written out (what Bloom's MLP computes)
    "relu": "relu", "relu2": "relu2",
}


def kernel_activation(name: str) -> str:
    """The compiled kernel's name for an ACT2FN activation, or the ACT2FN name if no kernel implements it."""
    return _KERNEL_NAMES.get(name, name)


_loaded: dict[int, DispatchOps] = {}  # id(extension module) -> its DispatchOps


@torch.compiler.disable  # loading (maybe building) the extension is never traced
def _compiled() -> DispatchOps | None:
    """The compiled ops, loading (and on first use building) the extension; None when unavailable (under the current
    HF_MOE_BACKEND, so HF_MOE_BACKEND=torch set after a first use turns them off)."""
    module, _ = load_extension()
    if module is None:
        return None
    if id(module) not in _loaded:
        ops = torch.ops.hf_moe
        _loaded[id(module)] = DispatchOps(
            "compiled", ops.sort_by_expert, ops.permute, ops.unpermute, ops.grouped_mm, ops.grouped_mm_weight_grad,
            ops.expert_act, ops.expert_act_backward, ops.moe_experts_forward, ops.moe_experts_backward,
        )
    return _loaded[id(module)]


BACKENDS = ("torch", "compiled", "triton")
# The backend `use_backend` forces in the caller's context (None: HF_MOE_BACKEND decides). A context variable, not a
# process global: a block in one thread (or asyncio task) does not change what another one runs.
_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("hf_moe_forced_backend", default=None)


@contextlib.contextmanager
def use_backend(name: str):
    """Run the ops of `name` ("torch", "compiled" or "triton") inside the block, whatever HF_MOE_BACKEND says.

    Only the calling thread (or asyncio task) is affected: other threads keep their own choice. A function compiled
    with `torch.compile` keeps the backend it was traced with; compile it inside the block to trace it with `name`.
    """
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "compiled" and _compiled() is None:
        raise RuntimeError(f"the compiled backend is unavailable: {load_extension()[1].how}")
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)


@torch.compiler.assume_constant_result  # a trace keeps the answer it saw (Dynamo cannot read a context variable)
def forced_backend() -> str | None:
    """The backend `use_backend` forces in this thread or task, or None."""
    return _forced.get()


def _triton_status(device_type: str) -> tuple[bool, str]:
    from .triton import status

    return status(device_type)


# The design's rule: what runs by default on a device has executed there. hf_moe's Triton kernels are the CUDA default
# only where `python -m hf_moe.gpu_check` passed on that kind of GPU and measured them faster than the torch ops
# (docs/backends.md, "What has been executed on a GPU"): bf16 experts on compute capability 9.x (an H100, 2026-11-27).
TRITON_DEFAULT_CAPABILITY, TRITON_DEFAULT_DTYPE = 9, torch.bfloat16
CUDA_DEFAULT_WHY = (
    "hf_moe's Triton kernels are the default for bf16 experts on sm90, where they passed "
    "`python -m hf_moe.gpu_check` on an H100 and ran faster than the torch ops; elsewhere on CUDA the torch ops, which "
    "PyTorch itself runs on GPUs (HF_MOE_BACKEND=triton opts in)"
)


def cuda_default(device: torch.device | int | None = None, dtype: torch.dtype = torch.bfloat16) -> tuple[str, str]:
    """(backend, why) for experts in `dtype` on CUDA `device` (None: the current one) under HF_MOE_BACKEND."""
    setting = backend_setting()
    if setting == "triton":
        return "triton", "HF_MOE_BACKEND=triton"
    if setting == "torch":
        return "torch", "HF_MOE_BACKEND=torch"
    if not torch.cuda.is_available():
        return "torch", f"HF_MOE_BACKEND={setting}; no GPU here: {CUDA_DEFAULT_WHY}"
    major, minor = torch.cuda.get_device_capability(device)
    if major != TRITON_DEFAULT_CAPABILITY or dtype != TRITON_DEFAULT_DTYPE:
        return "torch", f"HF_MOE_BACKEND={setting}; {str(dtype).removeprefix('torch.')} on sm{major}{minor}: " \
                        f"{CUDA_DEFAULT_WHY}"
    usable, why = _triton_status("cuda")
    if not usable:
        return "torch", f"HF_MOE_BACKEND={setting}; Triton cannot run here ({why}): {CUDA_DEFAULT_WHY}"
    return "triton", f"HF_MOE_BACKEND={setting}; bf16 on sm{major}{minor}: {CUDA_DEFAULT_WHY}"


@torch.compiler.disable  # decided once per (setting, device type, CUDA device, dtype), outside any trace
def _choose(setting: str, where: tuple[str, int | None, torch.dtype | None]) -> str:
    """The backend HF_MOE_BACKEND=`setting` selects for experts on `where` = (device type, CUDA device index, dtype)
    (load_extension warns, or raises under HF_MOE_BACKEND=compiled, when the C++ extension cannot be built for CPU
    tensors)."""
    device_type, index, dtype = where
    if setting in ("torch", "triton"):
        return setting
    if device_type == "cpu":
        return "compiled" if _compiled() is not None else "torch"
    if device_type != "cuda":
        return "torch"
    return cuda_default(index, dtype if dtype is not None else torch.float32)[0]


@torch.compiler.disable  # built once per (backend, device, activation), outside any trace
def _variant(backend: str, device_type: str, activation: str) -> DispatchOps:
    if backend == "torch":
        return REFERENCE
    if backend == "triton":
        usable, why = _triton_status(device_type)
        if not usable:
            raise RuntimeError(f"the Triton backend cannot run on {device_type} tensors: {why}. Use "
                               "HF_MOE_BACKEND=auto or torch there.")
        from .triton import dispatch_ops as triton_dispatch_ops

        return triton_dispatch_ops(activation)
    if device_type != "cpu":
        raise RuntimeError(f"the compiled backend (C++) runs on CPU tensors, not {device_type}; on CUDA use "
                           "'auto', 'torch' or 'triton'.")
    compiled = _compiled()
    if compiled is None:
        raise RuntimeError(f"the compiled backend is unavailable: {load_extension()[1].how}. Use 'auto' or 'torch'.")
    if activation not in KERNEL_ACTIVATIONS:
        return dataclasses.replace(
            compiled, name=compiled.name + ", activation in torch", expert_act=REFERENCE.expert_act,
            expert_act_backward=REFERENCE.expert_act_backward, whole_forward=None, whole_backward=None,
        )
    return compiled


def dispatch_ops(device: torch.device, activation: str, dtype: torch.dtype | None = None) -> DispatchOps:
    """The ops to run on `device` for `activation` (a kernel name, see `kernel_activation`) with experts computing in
    `dtype` (on CUDA the default backend depends on it, `cuda_default`; None counts as fp32): the backend
    `use_backend` forces in this context, else the one HF_MOE_BACKEND selects (read at each call, so a changed
    setting is honoured; a traced call keeps what it saw)."""
    where = (device.type, device.index, dtype) if device.type == "cuda" else (device.type, None, None)
    key = (forced_backend(), _setting(), where, activation)
    _select(key)
    return _variants[key]


_chosen: dict[tuple, str] = {}  # (setting, (device type, CUDA index, dtype)) -> the backend the setting selects there
_variants: dict[tuple, DispatchOps] = {}


@torch.compiler.assume_constant_result
def _setting() -> str:
    return backend_setting()


@torch.compiler.assume_constant_result  # traced calls run it at trace time: loading and choosing are never traced
def _select(key: tuple) -> bool:
    """Pick the ops for (forced backend or None, HF_MOE_BACKEND, (device type, CUDA index, dtype), activation) into
    `_variants`, once per key, loading (maybe building) the extension on the way."""
    if key not in _variants:
        backend, setting, where, activation = key
        if backend is None:
            if (setting, where) not in _chosen:
                _chosen[setting, where] = _choose(setting, where)
            backend = _chosen[setting, where]
        _variants[key] = _variant(backend, where[0], activation)
    return True


@torch.compiler.assume_constant_result
def _onnx_exporting() -> bool:
    """Whether `torch.onnx.export` is tracing the model (its public flag; torch.onnx is not imported to ask)."""
    onnx = sys.modules.get("torch.onnx")
    return onnx is not None and onnx.is_in_onnx_export()


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
    weights: tuple | None = None,
) -> torch.Tensor:
    """Run each token through its k experts and combine the outputs with the routing weights.

    `experts` follows transformers' fused-experts layout: `num_experts`, `has_gate`, `act_fn`, and either
    `gate_up_proj` [E, 2I, H] (gate rows first) or `up_proj` [E, I, H], then `down_proj` [E, H, I], with
    optional `*_bias` [E, out]. `weights`: (w1, b1, w2, b2) to compute with instead of the module's own
    (`expert_weights`); expert parallelism passes its process's block of them, [E / P, ...].

    Under autocast (`torch.autocast`, as `Trainer(bf16=True)` runs a model whose weights stay fp32) the inputs and
    the expert weights are cast to the autocast dtype first (`autocast_cast`), and the experts run in it; the weights'
    gradients come back in their own dtype through the cast.

    Args:
        hidden_states: [N, H]; top_k_index: [N, k] int; top_k_weights: [N, k].
    Returns:
        [N, H] in `hidden_states.dtype` (the autocast dtype under autocast).
    """
    activation = kernel_activation(_activation_of(experts))
    w1, b1, w2, b2 = expert_weights(experts) if weights is None else weights
    device_type = hidden_states.device.type
    if torch.is_autocast_enabled(device_type):
        hidden_states, w1, b1, w2, b2 = autocast_cast(hidden_states, w1, b1, w2, b2)
        with torch.autocast(device_type, enabled=False):
            return _run(hidden_states, top_k_index, top_k_weights, w1, b1, w2, b2, activation, experts.has_gate)
    return _run(hidden_states, top_k_index, top_k_weights, w1, b1, w2, b2, activation, experts.has_gate)


def autocast_cast(*tensors: torch.Tensor | None) -> tuple:
    """`tensors` (None kept; the first is a tensor) cast to the dtype `torch.autocast` computes `nn.Linear` in on their
    device, as autocast casts a Linear's input and weight; unchanged outside autocast. What the experts compute in
    (`experts_forward`), and what expert parallelism sends the tokens in."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def expert_weights(experts: torch.nn.Module) -> tuple:
    """(w1, b1, w2, b2) of an experts module in transformers' fused layout (`experts_forward`): w1 `gate_up_proj`
    [E, 2I, H] with a gate, else `up_proj` [E, I, H]; w2 `down_proj` [E, H, I]; the biases or None. The one place that
    chooses between the gated and the plain layout's tensors."""
    if experts.has_gate:
        w1, b1 = experts.gate_up_proj, getattr(experts, "gate_up_proj_bias", None)
    else:
        w1, b1 = experts.up_proj, getattr(experts, "up_proj_bias", None)
    return w1, b1, experts.down_proj, getattr(experts, "down_proj_bias", None)


def _run(hidden_states, top_k_index, top_k_weights, w1, b1, w2, b2, activation, glu):
    if _onnx_exporting():
        return dense_experts_forward(hidden_states, top_k_index, top_k_weights, w1, b1, w2, b2, activation, glu)
    ops = dispatch_ops(hidden_states.device, activation, hidden_states.dtype)
    return run_experts(ops, hidden_states, top_k_index, top_k_weights, w1, b1, w2, b2, activation, glu)


_OPS = ["sort_by_expert", "permute", "grouped_mm", "grouped_mm_weight_grad", "expert_act", "unpermute"]


def backend_report() -> dict[str, tuple[str, str]]:
    """{op: (implementation, why)} for this process: the ops on CPU, then the experts on CUDA."""
    setting = backend_setting()
    if setting == "triton":
        usable, why = _triton_status("cpu")
        impl = "triton (interpreter)" if usable else "triton: cannot run here, the ops raise"
        report = {op: (impl, f"HF_MOE_BACKEND=triton; {why}") for op in _OPS}
        report["experts (whole layer)"] = ("triton: the ops above, the permute done inside the GEMMs", why)
    else:
        report = _cpu_report(setting)
    report.update(_cuda_report())
    return report


def _cpu_report(setting: str) -> dict[str, tuple[str, str]]:
    module, status = load_extension()
    if module is None:
        report = {op: ("torch", status.how) for op in _OPS}
        report["experts (whole layer)"] = ("torch: composed from the ops above", status.how)
        return report
    why = f"{status.how}; HF_MOE_BACKEND={setting}"
    report = {op: ("compiled C++ (OpenMP)", why) for op in _OPS}
    report["grouped_mm"] = ("compiled C++: one call, a GEMM per expert", why)
    report["expert_act"] = ("compiled C++: silu, gelu, gelu_tanh, relu, relu2", "other activations run in torch")
    report["experts (whole layer)"] = ("compiled C++: one call forward, one backward", "CPU")
    report["experts, inference"] = _inference_row()
    report["prompt's bf16 linears"] = _prompt_linears_row()
    return report


def _inference_row() -> tuple[str, str]:
    """(implementation, why) of the experts without gradients on CPU (`hf_moe.ops.infer`): which weights the
    inference kernel takes on this CPU, and up to how many tokens a layer call."""
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    taken = ["int8"] + [name for name, dtype in dtypes.items() if infer.serves(dtype)]
    notes = [f"{name} calls of at most {infer.max_tokens(dtype)} tokens (ATen's GEMM beyond)"
             for name, dtype in dtypes.items() if infer.serves(dtype) and infer.max_tokens(dtype) is not None]
    left = [name for name in dtypes if name not in taken]
    if left:
        notes.append(f"{' and '.join(left)} weights keep ATen's GEMMs with these kernels")
    why = "; ".join(notes) or "any number of tokens per layer call"
    return f"compiled C++ ({infer.kernel_isa()} kernels): {', '.join(taken)} weights", why


def _prompt_linears_row() -> tuple[str, str]:
    """(implementation, why) of a prompt's bf16 `nn.Linear`s in hf_moe's own generate loop (`prefill_linears`)."""
    if prefill_linears.applies():
        return ("hf_moe::linear_infer: the same bf16 values multiplied in fp32, rounded to bf16 once",
                "avx2 kernels: ATen's bf16 GEMM has no fast path without AVX-512 BF16 (the plain generate's own loop "
                "only; a forward of your own stays on ATen)")
    return "ATen", f"{infer.kernel_isa()} kernels: ATen's bf16 GEMM is kept"


def _cuda_report() -> dict[str, tuple[str, str]]:
    """The experts on CUDA in bf16 and in the other dtypes (on this process's GPU, if any), and their GEMMs."""
    report = {}
    for label, dtype in (("bf16", torch.bfloat16), ("other", torch.float32)):
        backend, why = cuda_default(dtype=dtype)
        if backend == "torch":
            report[f"experts on CUDA, {label}"] = ("torch ops (reference.py)", why)
            continue
        usable, status = _triton_status("cuda")
        report[f"experts on CUDA, {label}"] = ("triton kernels, the permute done inside the GEMMs" if usable else
                                               "triton: cannot run here, the ops raise", f"{why}; {status}")
    report["GEMMs on CUDA"] = ("torch grouped_mm for bf16 on sm90 (16-byte aligned); else a torch.mm per expert "
                               "(one host sync) on the torch ops, a Triton kernel on the Triton ones", GROUPED_MM_WHY)
    return report
