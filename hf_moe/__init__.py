"""hf_moe: turn any Hugging Face causal LM into a Mixture-of-Experts model, and train it.

Importing the package registers the `hf_moe` model type with transformers' Auto classes, so
`AutoModelForCausalLM.from_pretrained(dir)` loads a saved MoE model.
"""

__version__ = "0.1.0"

from transformers import AutoConfig, AutoModelForCausalLM
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import MergeModulelist, WeightConverter

from .checkpoint import EXPERT_PARAM_NAMES, CheckpointError
from .configuration import MoEConfig
from .convert.adapters import NoMLPFoundError
from .convert.api import convert_to_moe
from .layers import ROUTERS, Experts, Router, RouterOutput, SparseMoeBlock, TopKRouter, register_router
from .losses import load_balancing_loss, router_z_loss
from .modeling import MoEForCausalLM
from .ops import experts_interface
from .parallel import clip as _clip
from .parallel import expert_parallel
from .training import trainer_compat
from .training.monitor import MoEMonitorCallback
from .training.trainer import MoETrainer

AutoConfig.register(MoEConfig.model_type, MoEConfig, exist_ok=True)
AutoModelForCausalLM.register(MoEConfig, MoEForCausalLM, exist_ok=True)
# On disk each expert has its own tensors (`...experts.3.down_proj`); in memory they are stacked into one
# [E, ...] parameter (`...experts.down_proj`). transformers' loader does the stacking.
register_checkpoint_conversion_mapping(
    MoEConfig.model_type,
    [
        WeightConverter(f"experts.*.{name}", f"experts.{name}", operations=[MergeModulelist(dim=0)])
        for name in EXPERT_PARAM_NAMES
    ],
    overwrite=True,
)
trainer_compat.install()
_clip.install()  # Accelerator.clip_grad_norm_ uses the global norm when experts are sharded across ranks
experts_interface.register()  # experts_implementation="hf_moe" for transformers' native MoE models

__all__ = [
    "ROUTERS",
    "CheckpointError",
    "Experts",
    "MoEConfig",
    "MoEForCausalLM",
    "MoEMonitorCallback",
    "MoETrainer",
    "NoMLPFoundError",
    "Router",
    "RouterOutput",
    "SparseMoeBlock",
    "TopKRouter",
    "__version__",
    "convert_to_moe",
    "expert_parallel",
    "load_balancing_loss",
    "register_router",
    "router_z_loss",
]
