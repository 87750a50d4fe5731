"""The base model's backbone with MoE blocks in place of the chosen MLPs: where the blocks go, and the router logits
on the backbone's output.

`install_moe_blocks` puts a `SparseMoeBlock` in each MoE layer and gives the backbone a subclass of its own class
(`MoELlamaModel` derives from `MoEBackboneMixin` and `LlamaModel`), whose forward is the base forward plus the
router logits: every head of `hf_moe.modeling` runs on it.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys

import torch
import transformers
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import MoeModelOutputWithPast

from .checkpoint import CheckpointError, validate_checkpoint
from .checkpoint.adapter_experts import is_adapter_checkpoint
from .compat import register_output_recording
from .configuration import MoEConfig, moe_config_class
from .dense_mlp import find_decoder_layers
from .layers import RouterOutput, SparseMoeBlock
from .layers.dense_keys import warn_on_replaced_mlp_keys
from .layers.router import AuxFreeRouter
from .routing import RouterRecorder, RoutingStats, moe_blocks, routing_losses, token_mask


class MoEBackboneMixin:
    """The base model's backbone with MoE blocks: `MoELlamaModel` derives from this and `LlamaModel`.

    Its forward is the base forward, plus: with `output_router_logits` (argument or config) it returns a
    `MoeModelOutputWithPast` whose `router_logits` holds each MoE layer's router logits [N, E] (N = batch * seq),
    as Mixtral's and Qwen3-MoE's backbones do, so tools that run the backbone alone (TRL's fused LM head) find
    them; in training it adds each layer's routing to `routing_stats` and to the aux_free routers' loads.

    `router_recorder` (a `hf_moe.routing.RouterRecorder`) is shared with the model's MoE blocks.

    A head gets its backbone in one of two ways, and both end with the same module: the causal LMs build the dense
    backbone class, whose instance `install_moe_blocks` then gives this class; transformers' generic classification
    heads build theirs with `AutoModel.from_config`, which `hf_moe.auto` points at this class, so it installs its
    own blocks (and `AutoModel.from_pretrained(moe_dir)` gives the MoE backbone alone, checked like every load).
    """

    router_recorder: RouterRecorder

    def __init__(self, config: MoEConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        install_moe_blocks(self, config)
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """`PreTrainedModel.from_pretrained` of the backbone alone, with the checks of `validate_checkpoint` first."""
        local_dir = os.path.join(os.fspath(pretrained_model_name_or_path), kwargs.get("subfolder") or "")
        verify_checksums = kwargs.pop("verify_checksums", None)
        if is_adapter_checkpoint(local_dir):  # (it holds the adapters only: the causal LM loads them onto the base)
            raise CheckpointError(
                f"{local_dir} holds adapter experts, loaded onto their base model by the model class: "
                "AutoModelForCausalLM / MoEForCausalLM.from_pretrained, then take its `.model`."
            )
        if os.path.isdir(local_dir):
            validate_checkpoint(local_dir, verify_checksums=verify_checksums)
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    def _moe_backbone_forward(self, base_forward, output_router_logits: bool | None = None, **kwargs):
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        return_dict = kwargs.pop("return_dict", None)
        recorder = self.router_recorder
        opened = recorder.start() if output_router_logits or self.training else False
        try:
            outputs = base_forward(self, **kwargs)
            routings = recorder.outputs if recorder.outputs is not None else []  # an outer recording: the head's
        finally:
            if opened:
                recorder.stop()
        if opened and self.training and routings:  # called alone; under the head, the head records them
            mask = token_mask(kwargs.get("attention_mask"), routings[0].router_logits.shape[0])
            self.record_routing(routings, *routing_losses(routings, self.config.num_experts, mask))
        router_logits = tuple(r.router_logits for r in routings) if output_router_logits else None
        outputs = _moe_model_output(outputs, router_logits)
        return outputs.to_tuple() if return_dict is False and not isinstance(outputs, tuple) else outputs

    def record_routing(
        self, routings: list[RouterOutput], balance: list[torch.Tensor | None], z: list[torch.Tensor]
    ) -> None:
        """Add one training forward's routing (and its per-layer losses) to `routing_stats` and to the aux_free
        routers' loads."""
        stats = self.routing_stats
        for layer, (block, routing) in enumerate(zip(moe_blocks(self), routings)):
            stats.add(layer, routing, balance[layer], z[layer])
            if isinstance(block.gate, AuxFreeRouter):
                block.gate.record_load(routing.expert_load(self.config.num_experts))

    @property
    def routing_stats(self) -> RoutingStats:
        """Routing statistics summed over training forwards since the last reset (see `RoutingStats`). A plain
        attribute made with the blocks, not buffers: nothing in the state dict, and no cast by `model.to(dtype)`;
        it follows the routers to their device."""
        stats = self._routing_stats
        device = moe_blocks(self)[0].gate.weight.device
        if stats.load.device != device:
            stats.to(device)
        return stats


_MOE_MODEL_OUTPUT_FIELDS = frozenset(MoeModelOutputWithPast.__dataclass_fields__)


def _moe_model_output(outputs, router_logits: tuple[torch.Tensor, ...] | None):
    """The backbone's output as a `MoeModelOutputWithPast` with `router_logits`. An output type with fields
    `MoeModelOutputWithPast` lacks (GPT-2's `cross_attentions`) keeps its type and gains the key, since the base
    head reads those fields; a tuple output (a config with return_dict=False) gains an element."""
    if isinstance(outputs, tuple):
        return outputs + (router_logits,) if router_logits is not None else outputs
    if type(outputs).__dataclass_fields__.keys() <= _MOE_MODEL_OUTPUT_FIELDS:
        return MoeModelOutputWithPast(**dict(outputs.items()), router_logits=router_logits)
    if router_logits is not None:
        outputs["router_logits"] = router_logits
    return outputs


def install_moe_blocks(
    model: nn.Module,
    config: MoEConfig,
    blocks: dict[int, nn.Module] | None = None,
    expert_range: tuple[int, int] | None = None,
) -> None:
    """Put an MoE block in each layer of `config.moe_layers` of `model` (a head, or a backbone built alone), and make
    the backbone an MoE backbone (`MoEBackboneMixin`) whose recorder the blocks share.

    The blocks are `blocks` (layer index -> block) when given; else new ones, of experts `expert_range` only when
    given. A layer that already holds a new block of the same experts (the backbone built its own) keeps it.
    """
    backbone = model.base_model
    if backbone is model and not isinstance(model, MoEBackboneMixin):
        raise ValueError(
            f"{type(model).__name__} has no backbone module (`{model.base_model_prefix}`) for hf_moe to return the "
            "router logits from; this layout is not supported."
        )
    if not isinstance(backbone, MoEBackboneMixin):
        backbone.__class__ = moe_backbone_class(type(backbone))
    if getattr(backbone, "router_recorder", None) is None:
        register_output_recording(backbone)  # transformers looks up what to record by the class name
        backbone.router_recorder = RouterRecorder()
        backbone._routing_stats = RoutingStats(len(config.moe_layers), config.num_experts)
        # a dense LoRA loaded by PEFT (strict=False) would otherwise drop its MLP part silently
        backbone.register_load_state_dict_pre_hook(warn_on_replaced_mlp_keys)
    if config.decoder_layers_path is None and backbone is not model:  # a config from MoEConfig.from_base
        config.decoder_layers_path = find_decoder_layers(model)[0]
    layers_path = config.decoder_layers_path
    if backbone is model:  # a backbone built alone: the path from the head, less the head's attribute for it
        prefix = model.base_model_prefix + "."
        layers_path = (
            layers_path.removeprefix(prefix) if layers_path and layers_path.startswith(prefix)
            else find_decoder_layers(model)[0]
        )
    layers = model.get_submodule(layers_path)
    for i in config.moe_layers:
        current = layers[i].get_submodule(config.moe_block_path)
        if blocks is None and isinstance(current, SparseMoeBlock) and _holds(current, expert_range):
            continue
        block = blocks[i] if blocks is not None else SparseMoeBlock(config, expert_range)
        block.router_recorder = backbone.router_recorder
        # (setattr, not torch's set_submodule: a bypassed activation may be a plain function, not a module)
        for path, module in ((config.moe_block_path, block), *((p, nn.Identity()) for p in config.moe_bypassed_paths)):
            parent, _, name = path.rpartition(".")
            setattr(layers[i].get_submodule(parent), name, module)


def _holds(block: SparseMoeBlock, expert_range: tuple[int, int] | None) -> bool:
    experts = block.experts
    start, end = expert_range if expert_range is not None else (0, experts.num_experts)
    return (experts.expert_offset, experts.num_local_experts) == (start, end - start)


_BACKBONE_CLASSES: dict[type[nn.Module], type[MoEBackboneMixin]] = {}


def moe_backbone_class(base_backbone_class: type[nn.Module]) -> type[MoEBackboneMixin]:
    """The `MoEBackboneMixin` subclass over a base model's backbone class (e.g. `MoELlamaModel`)."""
    if base_backbone_class not in _BACKBONE_CLASSES:
        name = f"MoE{base_backbone_class.__name__}"
        namespace = {
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"`{base_backbone_class.__name__}` with MoE blocks (see `MoEBackboneMixin`).",
            "config_class": moe_config_class(base_backbone_class.config_class),
            "forward": wrap_forward(base_backbone_class.forward, "_moe_backbone_forward"),
        }
        cls = type(name, (MoEBackboneMixin, base_backbone_class), namespace)
        _BACKBONE_CLASSES[base_backbone_class] = cls
        setattr(sys.modules[__name__], name, cls)
    return _BACKBONE_CLASSES[base_backbone_class]


def wrap_forward(base_forward, method: str):
    """A forward that calls `self.<method>(base_forward, **kwargs)`, with the base forward's signature (Trainer,
    generate and PEFT read it). Positional arguments are passed on by name."""
    signature = inspect.signature(base_forward)
    names = [p.name for p in signature.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    @functools.wraps(base_forward)
    def forward(self, *args, **kwargs):
        if len(args) > len(names) - 1:
            raise TypeError(f"{type(self).__name__}.forward takes at most {len(names) - 1} positional arguments.")
        for name, value in zip(names[1:], args):  # names[0] is self
            if name in kwargs:
                raise TypeError(f"{type(self).__name__}.forward got multiple values for argument {name!r}.")
            kwargs[name] = value
        return getattr(self, method)(base_forward, **kwargs)

    return forward


def __getattr__(name: str):
    # Lets pickle find a specialised backbone class in a fresh process: `MoELlamaModel`.
    base = getattr(transformers, name[3:], None) if name.startswith("MoE") else None
    if isinstance(base, type) and issubclass(base, PreTrainedModel):
        return moe_backbone_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
