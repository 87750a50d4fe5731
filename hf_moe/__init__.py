"""hf_moe: turn any Hugging Face causal LM into a Mixture-of-Experts model, and train it.

Importing the package registers the `hf_moe` model type with transformers' Auto classes, so
`AutoModelForCausalLM.from_pretrained(dir)` loads a saved MoE model.
"""

__version__ = "0.1.0"

from transformers import AutoConfig, AutoModelForCausalLM

from .compat import MergeModulelist, WeightConverter, register_checkpoint_conversion_mapping
from .checkpoint import EXPERT_PARAM_NAMES, CheckpointError
from .configuration import MoEConfig
from .convert.adapters import NoMLPFoundError
from .convert.api import convert_to_moe
from .convert.stream import StreamingUnsupported, convert_checkpoint
from .export import NativeExport, NativeExportError, export_native
from .layers import ROUTERS, Experts, Router, RouterOutput, SparseMoeBlock, TopKRouter, register_router
from .losses import load_balancing_loss, router_z_loss
from .modeling import MoEForCausalLM
from .ops import experts_interface
from .parallel import expert_parallel, parallelize

AutoConfig.register(MoEConfig.model_type, MoEConfig, exist_ok=True)
AutoModelForCausalLM.register(MoEConfig, MoEForCausalLM, exist_ok=True)
# On disk each expert has its own tensors (`...experts.3.down_proj`); in memory they are stacked into one
# [E, ...] parameter (`...experts.down_proj`). transformers' loader does the stacking. (A pattern is a regex whose
# `*` is `.*`: the digit keeps it off `shared_experts.*` and PEFT's `experts.base_layer.lora_*`, which PEFT's adapter
# loader runs through these rules too -- issue 22, deploy branch.)
register_checkpoint_conversion_mapping(
    MoEConfig.model_type,
    [
        WeightConverter(f"experts.[0-9]*.{name}", f"experts.{name}", operations=[MergeModulelist(dim=0)])
        for name in EXPERT_PARAM_NAMES
    ],
    overwrite=True,
)
experts_interface.register()  # experts_implementation="hf_moe" for transformers' native MoE models

_LAZY = {"MoETrainer": "hf_moe.training.trainer", "MoEMonitorCallback": "hf_moe.training.monitor"}


def __getattr__(name: str):
    # The training classes import transformers.Trainer: loaded on first use, not with `import hf_moe`.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_moe' has no attribute {name!r}")


__all__ = [
    "ROUTERS",
    "CheckpointError",
    "Experts",
    "MoEConfig",
    "MoEForCausalLM",
    "MoEMonitorCallback",
    "MoETrainer",
    "NativeExport",
    "NativeExportError",
    "NoMLPFoundError",
    "Router",
    "RouterOutput",
    "SparseMoeBlock",
    "StreamingUnsupported",
    "TopKRouter",
    "__version__",
    "convert_checkpoint",
    "convert_to_moe",
    "expert_parallel",
    "parallelize",
    "export_native",
    "load_balancing_loss",
    "register_router",
    "router_z_loss",
]
