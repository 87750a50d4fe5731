"""`MoEForCausalLM`: a base causal LM with MoE blocks in place of some of its MLPs.

The model *is* the base architecture: `MoEForCausalLM(config)` returns an instance of a subclass of both
`MoEForCausalLM` and the base model's causal-LM class (`MoELlamaForCausalLM` derives from `LlamaForCausalLM`), and
its backbone is an instance of a subclass of the base backbone (`MoELlamaModel` derives from `LlamaModel`).
Attention, caches, generation, gradient checkpointing and `device_map` are the base model's own code; only the
chosen MLP modules are swapped for `SparseMoeBlock`s. As in transformers' own MoE models, the backbone returns a
`MoeModelOutputWithPast` with each MoE layer's `router_logits` when asked (`output_router_logits`), and the
causal-LM head adds the load-balancing and z losses and returns a `MoeCausalLMOutputWithPast`.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
import sys
import warnings
from dataclasses import dataclass

import torch
from torch import nn
import transformers
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast

from .compat import CACHE_NAME, MODEL_FOR_CAUSAL_LM_MAPPING, output_cache, register_output_recording
from .configuration import MoEConfig, _base_config_class, moe_config_class
from .layers import RouterOutput, SparseMoeBlock
from .layers.dense_keys import warn_on_replaced_mlp_keys  # issue 22 (deploy branch)
from .layers.router import AuxFreeRouter
from .routing import RouterRecorder, RoutingStats, moe_blocks, routing_losses, token_mask
from .training import aux_free

@dataclass
class MoECausalLMOutputWithPast(MoeCausalLMOutputWithPast):
    """transformers' `MoeCausalLMOutputWithPast`, plus the router z-loss.

    aux_loss: the load-balancing loss (fp32, averaged over MoE layers; without its coefficient).
    z_loss: the router z-loss (fp32, averaged over MoE layers; without its coefficient).
    """

    z_loss: torch.FloatTensor | None = None


_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")
# Keyword arguments of `PreTrainedModel.from_pretrained` that are about loading, not config fields, although some
# share a name with a config attribute (`dtype`). Every other keyword naming a config attribute sets it.
_LOADING_KWARGS = frozenset(inspect.signature(PreTrainedModel.from_pretrained).parameters) | {
    "_commit_hash", "_from_auto", "_from_pipeline", "adapter_kwargs", "adapter_name", "allow_all_kernels",
    "attn_implementation", "device_map", "device_mesh", "distributed_config", "dtype", "experts_implementation",
    "generation_config", "gguf_file", "kernel_config", "key_mapping", "max_memory", "offload_buffers",
    "offload_folder", "output_loading_info", "proxies", "quantization_config", "state_dict", "subfolder",
    "torch_dtype", "tp_plan", "tp_size", "tqdm_class", "trust_remote_code", "use_kernels", "variant",
}


class MoEForCausalLM(PreTrainedModel, GenerationMixin):
    """A causal LM whose chosen MLP blocks are Mixture-of-Experts blocks.

    `MoEForCausalLM(config)`, `MoEForCausalLM.from_pretrained(path)` and
    `AutoModelForCausalLM.from_pretrained(path)` (after `import hf_moe`) all return an instance of the
    specialised subclass for the base architecture, so `isinstance(model, MoEForCausalLM)` always holds.

    Build one from a dense model with `hf_moe.convert_to_moe`.
    """

    config_class = MoEConfig
    # The base model's causal-LM class; set on the specialised subclasses only.
    base_model_class: type[PreTrainedModel] | None = None

    def __new__(cls, config=None, *args, **kwargs):
        if cls.base_model_class is None:
            cls = moe_model_class_for_config(config)
        return super().__new__(cls)

    def __init__(self, config: MoEConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)  # the base architecture, dense MLPs included
        install_moe_blocks(self, config)  # new blocks initialise themselves (see `reset_parameters`)
        self.post_init()  # recomputes the tied-weight map and the other per-model properties
        aux_free.track(self)

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModelForCausalLM"):
        """Does nothing. transformers calls it when it loads a checkpoint's `auto_map` code; marking this class
        would make every later save copy hf_moe's source files into the checkpoint. An hf_moe checkpoint's
        `auto_map` always points at the small shim `hf_moe.checkpoint` writes, which imports the installed package."""

    # ----------------------------------------------------------------------------------------------------------
    # Construction
    # ----------------------------------------------------------------------------------------------------------
    @classmethod
    def from_dense(cls, model: PreTrainedModel, config: MoEConfig, blocks: dict[int, SparseMoeBlock]):
        """Turn a dense causal LM into an MoE model in place and return it.

        As with FastMoE's `fmoefy` or PEFT's `get_peft_model`, `model` itself becomes the MoE model: its
        attention, embeddings, norms, buffers, dtype and device placement are kept as they are, and the MLPs of
        `config.moe_layers` are replaced by `blocks` (layer index -> block).
        """
        moe_class = moe_model_class(type(model))
        old_config = model.config
        model.__class__ = moe_class
        for module in model.modules():
            if getattr(module, "config", None) is old_config:
                module.config = config
        install_moe_blocks(model, config, blocks)
        aux_free.track(model)
        return model

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path,
        *model_args,
        expert_parallel: bool = False,
        expert_parallel_size: int | None = None,
        process_group=None,
        **kwargs,
    ):
        """`PreTrainedModel.from_pretrained`, with the checkpoint checked first: a missing, truncated or corrupt
        file, a tensor of the wrong dtype or shape, a router holding NaN, a file outside the directory, or a
        checkpoint from a newer hf_moe is an error that names it.

        `verify_checksums`: hash every file and compare with the checksums recorded at save time (True), or only
        the sizes and headers (False); the default (None) verifies checkpoints that record checksums (see
        `hf_moe.checkpoint.VERIFY_CHECKSUMS_BY_DEFAULT`).

        Keyword arguments that name a config field (`output_router_logits=True`, `router_aux_loss_coef=0.0`,
        `num_experts_per_tok=1`, or any field of the base config) set it, as in transformers; unlike transformers,
        they do so also when an explicit `config=` is passed (on a copy of it).

        With `expert_parallel=True` (under torchrun / accelerate launch) each rank builds and reads only its own
        block of experts (see `hf_moe.expert_parallel` for `expert_parallel_size` and `process_group`).
        """
        from .checkpoint import missing_keys_error, recover_interrupted_commit, validate_checkpoint

        if kwargs.get("offload_experts") is not None or kwargs.get("max_expert_memory") is not None:
            from .offload import load_offloaded  # experts read on demand into a bounded cache (hf_moe/offload)

            return load_offloaded(cls, pretrained_model_name_or_path, *model_args, expert_parallel=expert_parallel, **kwargs)
        path = os.fspath(pretrained_model_name_or_path)
        local_dir = os.path.join(path, kwargs.get("subfolder") or "")
        verify_checksums = kwargs.pop("verify_checksums", None)
        if not kwargs.pop("_validated", False) and (os.path.isdir(local_dir) or recover_interrupted_commit(path)):
            # (under expert parallelism each rank hashes only the files it reads: see local_expert_view)
            validate_checkpoint(local_dir, verify_checksums=False if expert_parallel else verify_checksums)
        if expert_parallel:
            return cls._from_pretrained_expert_parallel(
                local_dir, model_args, kwargs, expert_parallel_size, process_group, verify_checksums
            )
        config = kwargs.get("config")
        if isinstance(config, MoEConfig):
            kwargs["config"] = config = _with_config_kwargs(config, kwargs)
            if cls.base_model_class is None:
                cls = moe_model_class_for_config(config)
        elif config is not None and not isinstance(config, (str, os.PathLike)):
            moe_model_class_for_config(config)  # raises: not an MoE config, with what to do instead
        elif cls.base_model_class is None:  # transformers loads the config; we only need its base type
            hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
            config_dict, _ = MoEConfig.get_config_dict(os.fspath(config) if config is not None else path, **hub)
            cls = moe_model_class_for_config_class(moe_config_class(_base_config_class(config_dict.get("base_model_type"))))
        output_loading_info = kwargs.pop("output_loading_info", False)
        model, info = super(MoEForCausalLM, cls).from_pretrained(
            pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
        )
        if info["missing_keys"]:
            raise missing_keys_error(path, info["missing_keys"])
        return (model, info) if output_loading_info else model

    @classmethod
    def _from_pretrained_expert_parallel(
        cls, directory, model_args, kwargs, expert_parallel_size, process_group, verify_checksums=None
    ):
        """Load this rank's experts only: transformers loads from a view of the directory that lists the
        non-expert files and this rank's expert files, into a model whose experts hold this rank's block."""
        from . import parallel
        from .checkpoint import local_expert_view

        if not os.path.isdir(directory):
            raise FileNotFoundError(f"expert_parallel=True loads from a local directory; {directory} is not one.")
        plan = parallel.build_plan(process_group, expert_parallel_size)
        config = MoEConfig.from_pretrained(directory)
        start, end = plan.expert_range(config.num_experts)
        with local_expert_view(directory, start, end, verify_checksums) as view, parallel.local_experts(plan):
            model = cls.from_pretrained(view, *model_args, _validated=True, **kwargs)
        model.config.name_or_path = directory
        return parallel.finish(model, plan)

    @classmethod
    def _from_config(cls, config, **kwargs):
        if cls.base_model_class is None:
            cls = moe_model_class_for_config(config)
        return super(MoEForCausalLM, cls)._from_config(config, **kwargs)

    # ----------------------------------------------------------------------------------------------------------
    # Forward
    # ----------------------------------------------------------------------------------------------------------
    def _moe_forward(self, base_forward, **kwargs) -> MoECausalLMOutputWithPast | tuple:
        output_router_logits = kwargs.pop("output_router_logits", None)
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        return_dict = kwargs.pop("return_dict", None)
        labels = kwargs.get("labels")
        recorder = self.base_model.router_recorder
        opened = recorder.start() if output_router_logits or labels is not None or self.training else False
        try:
            outputs = base_forward(self, **kwargs)
        finally:
            routings = recorder.stop() if opened else []

        loss = outputs.loss
        aux_loss = z_loss = None
        if routings:
            mask = token_mask(kwargs.get("attention_mask"), routings[0].router_logits.shape[0])
            balance, z = routing_losses(routings, self.config.num_experts, mask)
            if self.training:
                self.base_model.record_routing(routings, balance, z)
            token_choice = [b for b in balance if b is not None]
            aux_loss = torch.stack(token_choice).mean() if token_choice else None
            z_loss = torch.stack(z).mean()
            if labels is not None and loss is not None and self.training:
                c = self.config
                extra = c.router_z_loss_coef * z_loss
                if aux_loss is not None and c.router_aux_loss_coef:
                    self._check_aux_loss_has_grad(aux_loss)
                    extra = extra + c.router_aux_loss_coef * aux_loss
                loss = loss + _aux_loss_weight(labels, kwargs.get("num_items_in_batch")) * extra.to(loss.dtype)

        result = MoECausalLMOutputWithPast(
            loss=loss,
            aux_loss=aux_loss,
            z_loss=z_loss,
            logits=outputs.logits,
            **{CACHE_NAME: output_cache(outputs)},  # issue 22 (deploy branch): `cache` from transformers 5.24
            hidden_states=getattr(outputs, "hidden_states", None),
            attentions=getattr(outputs, "attentions", None),
            router_logits=tuple(r.router_logits for r in routings) if output_router_logits else None,
        )
        return result if return_dict is not False else result.to_tuple()

    @property
    def routing_stats(self) -> RoutingStats:
        """Routing statistics summed over training forwards since the last reset (see `RoutingStats`)."""
        return self.base_model.routing_stats

    def update_router_biases(self) -> None:
        """Move the selection bias of every aux_free router toward balance, from the loads since the last call.

        Called after each optimizer step automatically (hf_moe/training/aux_free.py); call it yourself only with
        an optimizer that is not a `torch.optim.Optimizer`.
        """
        for block in moe_blocks(self):
            if isinstance(block.gate, AuxFreeRouter):
                block.gate.update_bias()

    def _check_aux_loss_has_grad(self, aux_loss: torch.Tensor) -> None:
        if torch.is_grad_enabled() and not aux_loss.requires_grad:
            if any(block.gate.weight.requires_grad for block in moe_blocks(self)):
                warnings.warn(
                    "The load-balancing loss has no gradient, so the routers will not learn to balance. This "
                    "happens with gradient checkpointing in reentrant mode; use the default "
                    "`gradient_checkpointing_enable()` (use_reentrant=False).",
                    stacklevel=3,
                )

    def generate(self, *args, **kwargs):
        """`GenerationMixin.generate`. Under expert parallelism every forward exchanges tokens with the other ranks,
        so a rank that has finished must keep running forwards until all have: `synced_gpus` defaults to True
        there, as transformers does for ZeRO-3 and FSDP."""
        if getattr(self, "expert_parallel_plan", None) is not None:
            call = inspect.signature(super().generate).bind_partial(*args, **kwargs)
            if call.arguments.get("synced_gpus") is None:
                call.arguments["synced_gpus"] = torch.distributed.get_world_size() > 1
                return super().generate(*call.args, **call.kwargs)
        return super().generate(*args, **kwargs)

    # ----------------------------------------------------------------------------------------------------------
    # Checkpoints and inspection
    # ----------------------------------------------------------------------------------------------------------
    def save_pretrained(self, save_directory, is_main_process: bool = True, state_dict=None, **kwargs):
        """Save as safetensors with one file per expert index (see `hf_moe.checkpoint`). Atomic."""
        from .checkpoint import save_checkpoint

        if kwargs.pop("push_to_hub", False):
            raise NotImplementedError(
                "push_to_hub is not supported by hf_moe's per-expert writer: save locally, then upload the folder "
                "with `hf upload <repo> <folder>`."
            )
        save_checkpoint(
            self,
            save_directory,
            is_main_process=is_main_process,
            state_dict=state_dict,
            max_shard_size=kwargs.pop("max_shard_size", "5GB"),
        )

    def parameter_counts(self) -> dict[str, int]:
        """{"total", "active", "expert", "experts_per_token"}: parameters, and those a token uses."""
        from torch.distributed.tensor import DTensor

        def full_numel(p, experts=None) -> int:
            # A DTensor (sharded: FSDP2, expert parallelism) reports its global numel. A plain expert parameter
            # built under expert parallelism holds num_local_experts of num_experts: count them all.
            if isinstance(p, DTensor) or experts is None:
                return p.numel()
            return p.numel() * experts.num_experts // experts.num_local_experts

        blocks = moe_blocks(self)
        expert_params = {id(p) for block in blocks for p in block.experts.parameters()}
        expert = sum(full_numel(p, block.experts) for block in blocks for p in block.experts.parameters())
        total = sum(full_numel(p) for p in self.parameters() if id(p) not in expert_params) + expert
        c = self.config
        active = total - expert + expert * c.num_experts_per_tok // c.num_experts
        return {"total": total, "active": active, "expert": expert, "experts_per_token": c.num_experts_per_tok}


def _aux_loss_weight(labels: torch.Tensor, num_items_in_batch) -> torch.Tensor | float:
    """Scale of the aux loss so that it is weighted like the LM loss it is added to.

    `transformers.Trainer` passes `num_items_in_batch` (label tokens over all gradient-accumulation
    micro-batches, and over all ranks with `average_tokens_across_devices`). The LM loss is then a sum divided
    by that count, and Trainer neither averages over micro-batches nor over ranks. Weighting each micro-batch's
    aux loss by its share of the label tokens makes the total a token-weighted mean, as for the LM loss, instead
    of a sum that grows with the accumulation steps and the number of ranks.
    """
    if num_items_in_batch is None:
        return 1.0
    local = labels[..., 1:].ne(-100).sum()
    return local.to(torch.float32) / num_items_in_batch


def _with_config_kwargs(config: MoEConfig, kwargs: dict) -> MoEConfig:
    """`config`, or a copy with the config fields named in `kwargs` set (and popped from `kwargs`)."""
    fields = [k for k in kwargs if k not in _LOADING_KWARGS and hasattr(config, k)]
    if not fields:
        return config
    config = copy.deepcopy(config)
    for name in fields:
        setattr(config, name, kwargs.pop(name))
    config._validate_moe()
    return config


# --------------------------------------------------------------------------------------------------------------
# The backbone: router logits on its output, routing statistics in training
# --------------------------------------------------------------------------------------------------------------
class MoEBackboneMixin:
    """The base model's backbone with MoE blocks: `MoELlamaModel` derives from this and `LlamaModel`.

    Its forward is the base forward, plus: with `output_router_logits` (argument or config) it returns a
    `MoeModelOutputWithPast` whose `router_logits` holds each MoE layer's router logits [N, E] (N = batch * seq),
    as Mixtral's and Qwen3-MoE's backbones do, so tools that run the backbone alone (TRL's fused LM head) find
    them; in training it adds each layer's routing to `routing_stats` and to the aux_free routers' loads.

    `router_recorder` (a `hf_moe.routing.RouterRecorder`) is shared with the model's MoE blocks.
    """

    router_recorder: RouterRecorder

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


# --------------------------------------------------------------------------------------------------------------
# Where the MoE blocks go
# --------------------------------------------------------------------------------------------------------------
def install_moe_blocks(model: nn.Module, config: MoEConfig, blocks: dict[int, nn.Module] | None = None) -> None:
    """Put an MoE block in each layer of `config.moe_layers` (new blocks unless `blocks` gives them), and make the
    backbone an MoE backbone (`MoEBackboneMixin`) whose recorder the blocks share."""
    backbone = model.base_model
    if backbone is model:
        raise ValueError(
            f"{type(model).__name__} has no backbone module (`{model.base_model_prefix}`) for hf_moe to return the "
            "router logits from; this layout is not supported."
        )
    if not isinstance(backbone, MoEBackboneMixin):
        backbone.__class__ = moe_backbone_class(type(backbone))
        register_output_recording(backbone)  # transformers looks up what to record by the class name
        backbone.router_recorder = RouterRecorder()
        backbone._routing_stats = RoutingStats(len(config.moe_layers), config.num_experts)
        # issue 22 (deploy branch): a dense LoRA loaded by PEFT (strict=False) would drop its MLP part silently
        backbone.register_load_state_dict_pre_hook(warn_on_replaced_mlp_keys)
    if config.decoder_layers_path is None:  # a config made with MoEConfig.from_base rather than by conversion
        from .convert.adapters import find_decoder_layers

        config.decoder_layers_path = find_decoder_layers(model)[0]
    layers = model.get_submodule(config.decoder_layers_path)
    for i in config.moe_layers:
        block = blocks[i] if blocks is not None else SparseMoeBlock(config)
        block.router_recorder = backbone.router_recorder
        _set_submodule(layers[i], config.moe_block_path, block)
        for path in config.moe_bypassed_paths:
            _set_submodule(layers[i], path, nn.Identity())


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, module)


# --------------------------------------------------------------------------------------------------------------
# Specialised classes
# --------------------------------------------------------------------------------------------------------------
def moe_model_class_for_config(config) -> type[MoEForCausalLM]:
    if not isinstance(config, MoEConfig):
        raise TypeError(
            f"MoEForCausalLM needs an MoEConfig (model_type='hf_moe'), got {type(config).__name__}. "
            "To make an MoE model from a dense one, use `hf_moe.convert_to_moe(model, num_experts, top_k)`."
        )
    return moe_model_class_for_config_class(type(config))


def moe_model_class_for_config_class(config_class: type[MoEConfig]) -> type[MoEForCausalLM]:
    base_config = config_class.base_config_class
    if base_config not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"transformers has no causal-LM class for model type {base_config.model_type!r}.")
    base_class = MODEL_FOR_CAUSAL_LM_MAPPING[base_config]
    if isinstance(base_class, (list, tuple)):
        base_class = base_class[0]
    return moe_model_class(base_class)


_MODEL_CLASSES: dict[type[PreTrainedModel], type[MoEForCausalLM]] = {}


def moe_model_class(base_model_class: type[PreTrainedModel]) -> type[MoEForCausalLM]:
    """The `MoEForCausalLM` subclass over `base_model_class` (e.g. `MoELlamaForCausalLM`), registered with
    `AutoModelForCausalLM`."""
    if base_model_class in _MODEL_CLASSES:
        return _MODEL_CLASSES[base_model_class]
    if issubclass(base_model_class, MoEForCausalLM):
        raise ValueError(f"{base_model_class.__name__} is already an MoE model class.")
    config_class = moe_config_class(base_model_class.config_class)  # may register this very class
    if base_model_class in _MODEL_CLASSES:
        return _MODEL_CLASSES[base_model_class]
    name = f"MoE{base_model_class.__name__}"
    namespace = {
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": f"`MoEForCausalLM` over `{base_model_class.__name__}`.",
        "config_class": config_class,
        "base_model_class": base_model_class,
        "forward": _wrap_forward(base_model_class.forward, "_moe_forward"),
    }
    cls = _MODEL_CLASSES[base_model_class] = type(name, (MoEForCausalLM, base_model_class), namespace)
    setattr(sys.modules[__name__], name, cls)
    AutoModelForCausalLM.register(config_class, cls, exist_ok=True)
    return cls


_BACKBONE_CLASSES: dict[type[nn.Module], type[MoEBackboneMixin]] = {}


def moe_backbone_class(base_backbone_class: type[nn.Module]) -> type[MoEBackboneMixin]:
    """The `MoEBackboneMixin` subclass over a base model's backbone class (e.g. `MoELlamaModel`)."""
    if base_backbone_class not in _BACKBONE_CLASSES:
        name = f"MoE{base_backbone_class.__name__}"
        namespace = {
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"`{base_backbone_class.__name__}` with MoE blocks (see `MoEBackboneMixin`).",
            "forward": _wrap_forward(base_backbone_class.forward, "_moe_backbone_forward"),
        }
        cls = type(name, (MoEBackboneMixin, base_backbone_class), namespace)
        _BACKBONE_CLASSES[base_backbone_class] = cls
        setattr(sys.modules[__name__], name, cls)
    return _BACKBONE_CLASSES[base_backbone_class]


def register_model_class(config_class: type[MoEConfig]) -> None:
    """Make the model class of a new specialised config class, if transformers has a causal LM for its base."""
    if config_class.base_config_class in MODEL_FOR_CAUSAL_LM_MAPPING:
        moe_model_class_for_config_class(config_class)


def _wrap_forward(base_forward, method: str):
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
    # Lets pickle find a specialised class in a fresh process: `MoELlamaForCausalLM`, `MoELlamaModel`.
    if name.startswith("MoE"):
        for model_class in MODEL_FOR_CAUSAL_LM_MAPPING.values():
            if isinstance(model_class, type) and model_class.__name__ == name[3:]:
                return moe_model_class(model_class)
        base = getattr(transformers, name[3:], None)
        if isinstance(base, type) and issubclass(base, PreTrainedModel):
            return moe_backbone_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
