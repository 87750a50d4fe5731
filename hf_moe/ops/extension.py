"""Finding or building the compiled extension (csrc/), and saying why it is or is not used.

Order of preference:
  1. `hf_moe._C`, built ahead of time by `HF_MOE_BUILD_EXT=1 pip install --no-build-isolation -e .`;
  2. a build of csrc/ with `torch.utils.cpp_extension.load` (ninja), made on first use and cached in
     `$HF_MOE_CACHE/ext/<hash>` (default ~/.cache/hf_moe); the hash covers the sources, torch and Python;
  3. nothing: the pure-torch ops run, after one warning that says why.

`HF_MOE_BACKEND=torch` skips 1 and 2; `HF_MOE_BACKEND=compiled` makes a failure an error.
CUDA kernels are compiled when torch has CUDA, a GPU is visible and nvcc is found; otherwise only the C++ ones.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import logging
import os
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("hf_moe")

_HERE = Path(__file__).resolve()
# csrc/ at the top of a source checkout (and of editable installs); inside the package (hf_moe/csrc) in a wheel.
CSRC = _HERE.parents[2] / "csrc" if (_HERE.parents[2] / "csrc" / "ops.cpp").is_file() else _HERE.parents[1] / "csrc"
CPU_SOURCES = ["ops.cpp", "cpu/dispatch_cpu.cpp", "cpu/experts_cpu.cpp", "cpu/fused_cpu.cpp"]
HEADERS = ["hf_moe.h", "cpu/activation_cpu.h"]
CUDA_SOURCES = ["cuda/dispatch_cuda.cu", "cuda/experts_cuda.cu"]
CXX_FLAGS = ["-O3", "-fopenmp"]
NVCC_FLAGS = ["-O3", "--use_fast_math", "-DHF_MOE_WITH_CUDA"]


@dataclass(frozen=True)
class ExtensionStatus:
    loaded: bool
    cuda: bool
    how: str  # "prebuilt hf_moe._C", "built in <dir>", or why not


def backend_setting() -> str:
    value = os.environ.get("HF_MOE_BACKEND", "auto").lower()
    if value not in ("auto", "torch", "compiled"):
        raise ValueError(f"HF_MOE_BACKEND must be auto, torch or compiled, got {value!r}.")
    return value


def _cache_dir() -> Path:
    return Path(os.environ.get("HF_MOE_CACHE", Path.home() / ".cache" / "hf_moe")) / "ext"


def _want_cuda() -> bool:
    return torch.version.cuda is not None and torch.cuda.is_available() and shutil.which("nvcc") is not None


def source_hash(with_cuda: bool) -> str:
    h = hashlib.sha256()
    files = [*(CSRC / s for s in HEADERS), *(CSRC / s for s in CPU_SOURCES)] + ([CSRC / s for s in CUDA_SOURCES] if with_cuda else [])
    for path in files:
        h.update(path.read_bytes())
    h.update(f"{torch.__version__} {sys.version_info[:2]} {with_cuda} {CXX_FLAGS} {NVCC_FLAGS}".encode())
    return h.hexdigest()[:16]


def build(verbose: bool = False):
    """Compile csrc/ with ninja into the cache (or reuse a previous build) and import it."""
    from torch.utils.cpp_extension import load

    with_cuda = _want_cuda()
    sources = [str(CSRC / s) for s in CPU_SOURCES] + ([str(CSRC / s) for s in CUDA_SOURCES] if with_cuda else [])
    digest = source_hash(with_cuda)
    build_dir = _cache_dir() / digest
    build_dir.mkdir(parents=True, exist_ok=True)
    if not (build_dir / f"hf_moe_ext_{digest}.so").exists():
        logger.warning("hf_moe: compiling the C++%s extension (once; about a minute). "
                       "HF_MOE_BACKEND=torch skips it.", "/CUDA" if with_cuda else "")
    module = load(
        name=f"hf_moe_ext_{digest}",
        sources=sources,
        build_directory=str(build_dir),
        extra_cflags=CXX_FLAGS + (["-DHF_MOE_WITH_CUDA"] if with_cuda else []),
        extra_cuda_cflags=NVCC_FLAGS,
        extra_ldflags=["-fopenmp"],
        with_cuda=with_cuda,
        verbose=verbose,
    )
    return module, f"built in {build_dir}"


def _prebuilt():
    """hf_moe._C if it was built from the current sources, else None (a stale one is not even imported)."""
    spec = importlib.util.find_spec("hf_moe._C")
    if spec is None or spec.origin is None:
        return None
    data = Path(spec.origin).read_bytes()
    marker = b"hf_moe_source_hash="
    at = data.find(marker)
    stamp = data[at + len(marker) : at + len(marker) + 16].decode(errors="replace") if at >= 0 else ""
    if stamp not in (source_hash(False), source_hash(True)):
        logger.warning("hf_moe: the prebuilt hf_moe._C was built from other sources; building the current ones "
                       "on first use. Rebuild it with `HF_MOE_BUILD_EXT=1 pip install --no-build-isolation -e .`.")
        return None
    return importlib.import_module("hf_moe._C")


@functools.cache
def load_extension() -> tuple[object | None, ExtensionStatus]:
    """The extension module (or None) and how it was found. Warns once when it cannot be used."""
    setting = backend_setting()
    if setting == "torch":
        return None, ExtensionStatus(False, False, "disabled by HF_MOE_BACKEND=torch")
    module = _prebuilt()
    how = "prebuilt hf_moe._C (HF_MOE_BUILD_EXT=1 pip install)"
    if module is None:
        try:
            module, how = build()
        except Exception as err:  # a compiler problem must not stop the model from running
            reason = f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"
            if setting == "compiled":
                raise RuntimeError(f"HF_MOE_BACKEND=compiled, but the extension failed to build ({reason}).") from err
            warnings.warn(
                f"hf_moe: the compiled extension could not be built ({reason}); running the pure-torch ops "
                "instead (correct, slower). Set HF_MOE_BACKEND=torch to silence this, or see "
                "`python -m hf_moe.env`.",
                RuntimeWarning,
                stacklevel=3,
            )
            return None, ExtensionStatus(False, False, f"build failed: {reason}")
    register_fake_kernels()
    register_autograd_formulas()
    return module, ExtensionStatus(True, bool(module.build_info()["cuda"]), how)


@functools.cache
def register_autograd_formulas() -> None:
    """Backward formulas of the compiled ops (autograd.py), so that each op is differentiable by itself: an
    exported program runs them with gradients (torch.export records them, not the autograd.Function around them)."""
    from .autograd import register_composable, register_experts

    register_experts("hf_moe::moe_experts_forward", torch.ops.hf_moe.moe_experts_backward)
    register_composable("hf_moe")


@functools.cache
def register_fake_kernels() -> None:
    """Shape functions of the compiled ops, so `torch.compile` can trace through them."""
    lib = "hf_moe::"

    @torch.library.register_fake(lib + "sort_by_expert")
    def _(top_k_index, num_experts):
        m = top_k_index.numel()
        new = top_k_index.new_empty
        return new(m, dtype=torch.int64), new(m, dtype=torch.int64), new(num_experts, dtype=torch.int64)

    @torch.library.register_fake(lib + "permute")
    def _(hidden_states, sorted_slots, top_k):
        return hidden_states.new_empty(sorted_slots.shape[0], hidden_states.shape[1])

    @torch.library.register_fake(lib + "unpermute")
    def _(rows, slot_to_row, top_k_weights, top_k):
        return rows.new_empty(slot_to_row.shape[0] // top_k, rows.shape[1])

    @torch.library.register_fake(lib + "grouped_mm")
    def _(x, weight, tokens_per_expert, bias, bias_scale, transpose_weight):
        return x.new_empty(x.shape[0], weight.shape[1] if transpose_weight else weight.shape[2])

    @torch.library.register_fake(lib + "grouped_mm_weight_grad")
    def _(grad_out, x, tokens_per_expert):
        return x.new_empty(tokens_per_expert.shape[0], grad_out.shape[1], x.shape[1])

    @torch.library.register_fake(lib + "expert_act")
    def _(h, row_scale, activation, glu):
        return h.new_empty(h.shape[0], h.shape[1] // 2 if glu else h.shape[1])

    @torch.library.register_fake(lib + "expert_act_backward")
    def _(grad, h, row_scale, activation, glu, return_output):
        scale_dtype = (row_scale if row_scale is not None else h).dtype
        scale = h.new_empty(h.shape[0] if row_scale is not None else 0, dtype=scale_dtype)
        return torch.empty_like(h), scale, h.new_empty(h.shape[0] if return_output else 0, grad.shape[1])

    @torch.library.register_fake(lib + "moe_experts_forward")
    def _(hidden_states, top_k_index, top_k_weights, w1, b1, w2, b2, activation, glu, save_h):
        m, new = top_k_index.numel(), hidden_states.new_empty
        long = dict(dtype=torch.int64)
        return (
            new(hidden_states.shape), new(m if save_h else 0, w1.shape[1]), new(m, **long), new(m, **long),
            new(w1.shape[0], **long), new(m),
        )

    @torch.library.register_fake(lib + "moe_experts_backward")
    def _(grad_out, x, h, sorted_slots, slot_to_row, tokens_per_expert, row_weight, w1, b1, w2, b2, activation,
          glu, need_x, need_weights, need_params):
        empty = x.new_empty(0)
        top_k = sorted_slots.shape[0] // x.shape[0] if x.shape[0] else 1
        return (
            x.new_empty(x.shape) if need_x else empty,
            row_weight.new_empty(x.shape[0], top_k) if need_weights else empty,
            torch.empty_like(w1) if need_params else empty,
            torch.empty_like(b1) if need_params and b1 is not None else empty,
            torch.empty_like(w2) if need_params else empty,
            torch.empty_like(b2) if need_params and b2 is not None else empty,
        )
