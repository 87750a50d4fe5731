"""Every private or internal API of transformers, accelerate and torch that hf_moe uses, in one place.

A name imported from here is one the upstream project may move or change without notice: a leading underscore,
a module its docs do not list, or a private method we override. When a new release breaks one, this file is the
only one to change, and `TESTED` says which releases CI runs (the bounds in pyproject.toml are the same).

Public, documented APIs (`AutoConfig.register`, `PreTrainedModel`, `ACT2FN`, `ModelOutput`, `Trainer`, ...) are
imported where they are used.
"""

from __future__ import annotations

import torch
from transformers import __version__ as TRANSFORMERS_VERSION  # noqa: N812

# The releases CI tests, oldest and newest (pyproject.toml's bounds say the same; scripts/test.sh runs both ends). The
# oldest are the lent GPU's image (scripts/test_oldest.sh; docs/backends.md): torch 2.11, triton 3.6, Python 3.12.
TESTED = {
    "transformers": ("5.17.0", "5.24.0"),
    "torch": ("2.11.0", "2.13.0"),
    "triton": ("3.6.0", "3.9.0"),
    "accelerate": ("1.15.0", "1.15.0"),
    "safetensors": ("0.8.0", "0.8.0"),
}

# --------------------------------------------------------------------------------------------------------------
# transformers: the Auto mappings (module-level objects of `transformers.models.auto`, not exported at the top)
# --------------------------------------------------------------------------------------------------------------
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING,
    MODEL_MAPPING,
)

# --------------------------------------------------------------------------------------------------------------
# transformers: loading (the weight-conversion registry that stacks per-expert tensors; 5.x internals)
# --------------------------------------------------------------------------------------------------------------
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import MergeModulelist, WeightConverter

# --------------------------------------------------------------------------------------------------------------
# transformers: saving and model internals
# --------------------------------------------------------------------------------------------------------------
from transformers.modeling_utils import remove_tied_weights_from_state_dict
from transformers.utils.hub import convert_file_size_to_int
from transformers import initialization as init  # the models' own init functions (5.x)
from transformers.pytorch_utils import Conv1D

# --------------------------------------------------------------------------------------------------------------
# transformers: the experts implementations of native MoE models (`experts_implementation=...`)
# --------------------------------------------------------------------------------------------------------------
from transformers.integrations.moe import (
    ALL_EXPERTS_FUNCTIONS,
    grouped_mm_experts_forward,
)
from transformers.integrations.moe import _default_apply_gate as default_apply_gate


# --------------------------------------------------------------------------------------------------------------
# transformers: names that changed within the TESTED range
# --------------------------------------------------------------------------------------------------------------
# 5.24 renamed the key/value cache of model inputs and outputs from `past_key_values` to `cache` (the old name works
# until 5.40, with a deprecation warning on every use). The name the installed release uses:
from transformers.modeling_outputs import CausalLMOutputWithPast as _CausalLMOutput

CACHE_NAME = "cache" if "cache" in _CausalLMOutput.__dataclass_fields__ else "past_key_values"


def output_cache(outputs):
    """The key/value cache a model output carries (`outputs.cache` from transformers 5.24, `.past_key_values`
    before), or None."""
    return getattr(outputs, CACHE_NAME, None)


def cache_kwargs(cache) -> dict:
    """The keyword argument that passes `cache` to a model's forward: `{"cache": cache}` from transformers 5.24,
    `{"past_key_values": cache}` before."""
    return {CACHE_NAME: cache}


def static_cache_layers(cache) -> list | None:
    """[(keys [B, Hkv, L, D], values, length)] of each layer of a `StaticCache` whose layers are all plain,
    initialised `StaticLayer`s, or None for any other cache. `length` is the layer's 0-dim int64 count of the
    positions written (`cumulative_length`, an internal of 5.24's StaticLayer: it replaced the `cache_position`
    argument that decides where `update` writes); a release without it gives None too."""
    from transformers.cache_utils import StaticCache, StaticLayer

    if not isinstance(cache, StaticCache) or not cache.layers:
        return None
    layers = []
    for layer in cache.layers:
        length = getattr(layer, "cumulative_length", None)
        if type(layer) is not StaticLayer or not layer.is_initialized or not isinstance(length, torch.Tensor):
            return None
        layers.append((layer.keys, layer.values, length))
    return layers


def pad_token_tensor(generation_config):
    """The padding id `generate` gives finished rows (`_pad_token_tensor`, private: set by transformers' `generate`
    from `pad_token_id`, else the first EOS id, before it calls the decoding loop; 5.17 to 5.24), or None."""
    return getattr(generation_config, "_pad_token_tensor", None)


def enable_activation_checkpointing(model, **kwargs) -> None:
    """`model.activation_checkpointing_enable(**kwargs)`: transformers 5.23 renamed `gradient_checkpointing_enable`
    (the old name warns), which 5.17 still uses."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable(**kwargs)


def register_output_recording(model) -> None:
    """Register a model's `_can_record_outputs` under its current class. transformers' output capturing
    (`output_hidden_states`, `output_attentions`) looks them up by class name in a registry filled at
    construction; hf_moe gives the built backbone an MoE subclass (`MoELlamaModel`), which must be found too."""
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

    if type(_CAN_RECORD_REGISTRY) is dict:  # 5.17: a plain dict keyed by str(class)
        _CAN_RECORD_REGISTRY[str(model.__class__)] = model._can_record_outputs
    else:  # 5.23: a registry whose keys are models (it takes the class name itself)
        _CAN_RECORD_REGISTRY[model] = model._can_record_outputs


def can_set_experts_implementation(model_class) -> bool:
    """Whether a model class dispatches its experts through the ExpertsInterface (transformers' own test for
    `experts_implementation="grouped_mm"`: the private classmethod `_can_set_experts_implementation`)."""
    return model_class._can_set_experts_implementation()


def attn_implementation(config) -> str | None:
    """The attention implementation a config runs with (`config._attn_implementation`, private in 5.x)."""
    return getattr(config, "_attn_implementation", None)


def compile_on_every_device(compile_config):
    """Let `generate` compile its decode step on CPU too. transformers compiles it automatically (static cache)
    only on accelerators, unless the `CompileConfig` carries the private flag `_compile_all_devices` (what its own
    compile tests set; 5.17 to 5.23). Returns the config."""
    compile_config._compile_all_devices = True
    return compile_config


# --------------------------------------------------------------------------------------------------------------
# transformers.Trainer: the conventions and private methods MoETrainer relies on (Trainer is imported on use: it is
# slow to import, and `import hf_moe` must not pay for it)
# --------------------------------------------------------------------------------------------------------------
def trainer_supports_sharded_models() -> bool:
    """Whether transformers.Trainer lets a model own its sharding (reads `is_distributed_loading_by_transformers`:
    no DDP wrap, save_pretrained on every process). transformers 5.23 does; 5.17 does not."""
    from transformers import PreTrainedModel

    return hasattr(PreTrainedModel, "is_distributed_loading_by_transformers")


def declare_sharded_at_load(model) -> None:
    """Mark a model that owns its sharding and gradient reduction (FSDP2 applied by `hf_moe.parallelize`), the way
    `from_pretrained(distributed_config=...)` marks its models: transformers.Trainer then neither wraps it in DDP
    nor shards it again, and calls `save_pretrained` on every process. The public read side is
    `PreTrainedModel.is_distributed_loading_by_transformers`; its backing attribute is private (transformers 5.x)."""
    if hasattr(type(model), "_is_distributed_loading_by_transformers"):
        model._is_distributed_loading_by_transformers = True


# MoETrainer overrides these private Trainer methods: _save_optimizer_and_scheduler(output_dir),
# _load_optimizer_and_scheduler(checkpoint), _load_from_checkpoint(resume_from_checkpoint, model=None) (in every
# TESTED release), and _defer_fsdp_gradient_reduction() (a context manager; 5.23, absent and unused in 5.17). It sets
# the Trainer attribute `is_distributed_loading_by_transformers` (5.23), which Trainer.__init__ reads from the model.
# MoEForCausalLM overrides the private classmethod PreTrainedModel._from_config(config, **kwargs), which
# AutoModelForCausalLM.from_config calls.

# --------------------------------------------------------------------------------------------------------------
# triton (optional, imported on use): its interpreter with numpy 2.4 and newer
# --------------------------------------------------------------------------------------------------------------
def _release(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string ("3.6.0+git..." -> (3, 6))."""
    parts = []
    for part in version.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def triton_interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run hf_moe's kernels with the installed triton and numpy, or None.

    numpy 2.4 refuses `int()` of an array with dimensions; triton's interpreter (before 3.7) converts a loop bound
    held in a tensor that way, so every kernel loop with a run-time bound fails (triton-lang/triton#9171, fixed by
    #9172). Read from the installed versions, without importing either."""
    import importlib.metadata

    try:
        triton, numpy = importlib.metadata.version("triton"), importlib.metadata.version("numpy")
    except importlib.metadata.PackageNotFoundError:
        return None
    if _release(triton) < (3, 7) and _release(numpy) >= (2, 4):
        return (f"triton {triton}'s interpreter cannot run kernel loops with numpy {numpy} (numpy 2.4 refuses int() "
                "of an array; triton-lang/triton#9171, fixed in triton 3.7): install numpy<2.4 (or triton>=3.7) to "
                "run the kernels under TRITON_INTERPRET=1; on a GPU the kernels are compiled, and this does not matter")
    return None


# --------------------------------------------------------------------------------------------------------------
# torch: the decomposition table, Dynamo's stance, and DDP's parameters-to-ignore convention
# --------------------------------------------------------------------------------------------------------------
def register_decomposition(op, fn) -> None:
    """Put `fn` in torch's decomposition table as the decomposition of `op` (an OpOverload):
    `torch._decomp.register_decomposition`, private. `torch.onnx.export` decomposes every op found there before it
    translates a program (torch 2.11 to 2.13: `create_onnx_friendly_decomposition_table` chains
    `torch._decomp.decomposition_table`); FakeTensor computes an op's outputs with symbolic sizes from it."""
    from torch._decomp import register_decomposition as register

    register(op)(fn)


def ddp_ignore_parameters(module, names) -> None:
    """Keep the parameters `names` (fully qualified in `module`) out of DistributedDataParallel's buckets and its
    broadcasts, added to those `module` already lists: DDP reads `module._ddp_params_and_buffers_to_ignore` at
    construction, set through its private static helper `_set_params_and_buffers_to_ignore_for_model`."""
    from torch.nn.parallel import DistributedDataParallel

    names = sorted(set(getattr(module, "_ddp_params_and_buffers_to_ignore", ())) | set(names))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)


def skipping_guards():
    """A context in which Dynamo skips guard evaluation (`torch.compiler.set_stance(..., skip_guard_eval_unsafe=True)`,
    public) while keeping the caller's stance ("default", "force_eager", "fail_on_recompile", ...): that stance is
    `torch._dynamo.eval_frame._stance` (private, torch 2.11 to 2.13), which has no public getter."""
    import torch
    from torch._dynamo import eval_frame

    stance = getattr(getattr(eval_frame, "_stance", None), "stance", "default")
    return torch.compiler.set_stance(stance, skip_guard_eval_unsafe=True)


def allow_dtensor_unpickling() -> None:
    """Let weights-only loads (`weights_only=True`) read DTensors sharded with `_StridedShard` (private), as FSDP2 over
    an expert-parallel mesh makes them. torch 2.13 lists it among the safe globals it registers when
    `torch.distributed.tensor` is imported; torch 2.11 lists the other placements only, so Accelerate's
    `load_state` refused the optimizer file it had written itself."""
    import torch
    from torch.distributed.tensor.placement_types import _StridedShard

    if _StridedShard not in torch.serialization.get_safe_globals():
        torch.serialization.add_safe_globals([_StridedShard])


# --------------------------------------------------------------------------------------------------------------
# triton (optional, imported on use): compiling kernels for a GPU target without a GPU (hf_moe/ops/triton/aot.py)
# --------------------------------------------------------------------------------------------------------------
def TritonASTSource(kernel, signature, constexprs, attrs):  # noqa: N802
    """triton.compiler.ASTSource: a kernel plus its specialisation, the input of `triton.compile` (internal)."""
    from triton.compiler import ASTSource

    return ASTSource(kernel, signature, constexprs, attrs)


def TritonGPUTarget(backend: str, arch: int, warp_size: int):  # noqa: N802
    """triton.backends.compiler.GPUTarget: the target `triton.compile` builds for when no GPU says (internal)."""
    from triton.backends.compiler import GPUTarget

    return GPUTarget(backend, arch, warp_size)


def triton_kernel_params(kernel) -> list[tuple[str, bool]]:
    """(name, is_constexpr) of a `@triton.jit` function's parameters (`JITFunction.params`, internal)."""
    return [(p.name, bool(p.is_constexpr)) for p in kernel.params]


def triton_cuobjdump() -> str:
    """The cuobjdump that triton's NVIDIA backend bundles beside its ptxas (its package layout, internal)."""
    import triton.backends.nvidia as nvidia
    from pathlib import Path

    return str(Path(nvidia.__file__).parent / "bin" / "cuobjdump")


__all__ = [
    "ALL_EXPERTS_FUNCTIONS",
    "CACHE_NAME",
    "CONFIG_MAPPING",
    "Conv1D",
    "MODEL_FOR_CAUSAL_LM_MAPPING",
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING",
    "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING",
    "MODEL_MAPPING",
    "MergeModulelist",
    "TESTED",
    "TRANSFORMERS_VERSION",
    "TritonASTSource",
    "TritonGPUTarget",
    "WeightConverter",
    "attn_implementation",
    "cache_kwargs",
    "can_set_experts_implementation",
    "convert_file_size_to_int",
    "ddp_ignore_parameters",
    "declare_sharded_at_load",
    "default_apply_gate",
    "enable_activation_checkpointing",
    "grouped_mm_experts_forward",
    "init",
    "output_cache",
    "register_output_recording",
    "register_checkpoint_conversion_mapping",
    "register_decomposition",
    "remove_tied_weights_from_state_dict",
    "trainer_supports_sharded_models",
    "triton_cuobjdump",
    "triton_interpreter_problem",
    "triton_kernel_params",
]
