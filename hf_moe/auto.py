"""hf_moe's one edge with transformers' registries: the `hf_moe` model type with the Auto classes, the per-expert
key conversion of the loader, and the "hf_moe" experts implementation. `import hf_moe` runs it; nothing else in
the package registers anything.

The per-base classes (`MoELlamaForCausalLM` for a Llama base) are registered here as their config class is made
(`add_config_class_hook`); docs/architecture.md, "Per-base classes", explains them.
"""

from __future__ import annotations

from transformers import (
    AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification,
)

from .backbone import moe_backbone_class

from .checkpoint import EXPERT_PARAM_NAMES
from .compat import MODEL_MAPPING, MergeModulelist, WeightConverter, register_checkpoint_conversion_mapping
from .configuration import MoEConfig, add_config_class_hook
from .modeling import (
    MoEForCausalLM, MoEForSequenceClassification, MoEForTokenClassification, base_head_class, moe_model_class,
)
from .ops import experts_interface

# Each MoE head, and the Auto class that builds it.
AUTO_CLASSES = {
    MoEForCausalLM: AutoModelForCausalLM,
    MoEForSequenceClassification: AutoModelForSequenceClassification,
    MoEForTokenClassification: AutoModelForTokenClassification,
}


def _register_model_classes(config_class: type[MoEConfig]) -> None:
    """Register the model classes of a new specialised config class: one per head transformers has for its base,
    and the backbone (transformers' generic classification heads build theirs with `AutoModel`)."""
    base_config = config_class.base_config_class
    classes = {}
    if base_config in MODEL_MAPPING:
        backbone = MODEL_MAPPING[base_config]
        classes[AutoModel] = moe_backbone_class(backbone[0] if isinstance(backbone, (list, tuple)) else backbone)
    for head, auto_class in AUTO_CLASSES.items():
        base_class = base_head_class(head, base_config)
        if base_class is not None:
            classes[auto_class] = moe_model_class(base_class)
    for auto_class, model_class in classes.items():
        # A family that reuses another's classes (internlm3 runs LlamaForCausalLM) is registered under the config
        # class those classes name, when that one is made.
        if model_class.config_class is config_class:
            auto_class.register(config_class, model_class, exist_ok=True)


def register() -> None:
    """Register hf_moe with transformers (idempotent; run by `import hf_moe`)."""
    AutoConfig.register(MoEConfig.model_type, MoEConfig, exist_ok=True)
    for head, auto_class in AUTO_CLASSES.items():
        auto_class.register(MoEConfig, head, exist_ok=True)
    add_config_class_hook(_register_model_classes)
    # On disk each expert has its own tensors (`...experts.3.down_proj`); in memory they are stacked into one
    # [E, ...] parameter (`...experts.down_proj`). transformers' loader does the stacking. (A pattern is a regex
    # whose `*` is `.*`: the digit keeps it off `shared_experts.*` and PEFT's `experts.base_layer.lora_*`, which
    # PEFT's adapter loader runs through these rules too.)
    register_checkpoint_conversion_mapping(
        MoEConfig.model_type,
        [
            WeightConverter(f"experts.[0-9]*.{name}", f"experts.{name}", operations=[MergeModulelist(dim=0)])
            for name in EXPERT_PARAM_NAMES
        ],
        overwrite=True,
    )
    experts_interface.register()  # experts_implementation="hf_moe" for transformers' native MoE models
