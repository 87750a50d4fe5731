"""hf_moe: turn any Hugging Face causal LM into a Mixture-of-Experts model, and train it.

Importing the package registers the `hf_moe` model type with transformers' Auto classes, so
`AutoModelForCausalLM.from_pretrained(dir)` loads a saved MoE model.
"""

from . import auto
from .checkpoint import CheckpointError
from .configuration import MoEConfig
from .convert.api import convert_to_moe
from .convert.stream import StreamingUnsupported, convert_checkpoint
from .dense_mlp import NoMLPFoundError
from .export import NativeExport, NativeExportError, export_native
from .generation import generate
from .layers import ROUTERS, Experts, Router, RouterOutput, SparseMoeBlock, TopKRouter, register_router
from .losses import load_balancing_loss, router_z_loss
from .modeling import MoEForCausalLM, MoEForSequenceClassification, MoEForTokenClassification
from .parallel import expert_parallel, parallelize
from .shrink import ShrinkError, ShrinkResult, shrink  # (the function shadows the subpackage's name here, on purpose)
from .training.aux_free import attach_aux_free
from .version import __version__

auto.register()  # the `hf_moe` model type, its weight conversion and experts implementation, with transformers

# Loaded on first use, not with `import hf_moe`: the training classes import transformers.Trainer, merging reads
# YAML, adapters need PEFT, int8 experts their kernels.
_LAZY = {
    "MoETrainer": "hf_moe.training.trainer",
    "MoEMonitorCallback": "hf_moe.training.monitor",
    "merge_to_moe": "hf_moe.convert.merge",
    "convert_adapter": "hf_moe.convert.lora",
    "materialize": "hf_moe.convert.materialize",
    "AdapterConversionError": "hf_moe.convert.lora",
    "quantize_experts": "hf_moe.quantize",
    "save_quantized": "hf_moe.quantize",
    "load_quantized": "hf_moe.quantize",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_moe' has no attribute {name!r}")


__all__ = [
    "ROUTERS",
    "AdapterConversionError",
    "CheckpointError",
    "Experts",
    "MoEConfig",
    "MoEForCausalLM",
    "MoEForSequenceClassification",
    "MoEForTokenClassification",
    "MoEMonitorCallback",
    "MoETrainer",
    "NativeExport",
    "NativeExportError",
    "NoMLPFoundError",
    "Router",
    "RouterOutput",
    "ShrinkError",
    "ShrinkResult",
    "SparseMoeBlock",
    "StreamingUnsupported",
    "TopKRouter",
    "__version__",
    "attach_aux_free",
    "convert_adapter",
    "convert_checkpoint",
    "convert_to_moe",
    "expert_parallel",
    "parallelize",
    "export_native",
    "generate",
    "load_balancing_loss",
    "load_quantized",
    "materialize",
    "merge_to_moe",
    "quantize_experts",
    "register_router",
    "router_z_loss",
    "save_quantized",
    "shrink",
]
