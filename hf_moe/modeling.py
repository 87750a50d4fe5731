"""`MoEForCausalLM`: a base causal LM with MoE blocks in place of some of its MLPs.

The model *is* the base architecture: `MoEForCausalLM(config)` returns an instance of a subclass of both
`MoEForCausalLM` and the base model's causal-LM class (`MoELlamaForCausalLM` derives from `LlamaForCausalLM`).
Attention, caches, generation, gradient checkpointing and `device_map` are the base model's own code; only the
chosen MLP modules are swapped for `SparseMoeBlock`s. The forward wraps the base forward to add the
load-balancing loss and return a `MoeCausalLMOutputWithPast`.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import warnings
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import MoeCausalLMOutputWithPast
from transformers import AutoModelForCausalLM

from .compat import MODEL_FOR_CAUSAL_LM_MAPPING
from .configuration import MoEConfig, moe_config_class
from .layers import RouterOutput, SparseMoeBlock
from .layers.router import AuxFreeRouter
from .losses import load_balancing_loss, router_z_loss
from .routing import RouterRecorder, RoutingStats, moe_blocks
from .training import aux_free

@dataclass
class MoECausalLMOutputWithPast(MoeCausalLMOutputWithPast):
    """transformers' `MoeCausalLMOutputWithPast`, plus the router z-loss.

    aux_loss: the load-balancing loss (fp32, averaged over MoE layers; without its coefficient).
    z_loss: the router z-loss (fp32, averaged over MoE layers; without its coefficient).
    """

    z_loss: torch.FloatTensor | None = None


_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")


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
        file, a missing tensor, or a checkpoint from a newer hf_moe is an error that names it.

        With `expert_parallel=True` (under torchrun / accelerate launch) each rank builds and reads only its own
        block of experts (see `hf_moe.expert_parallel` for `expert_parallel_size` and `process_group`).
        """
        from .checkpoint import missing_keys_error, validate_checkpoint

        path = os.fspath(pretrained_model_name_or_path)
        local_dir = os.path.join(path, kwargs.get("subfolder") or "")
        if os.path.isdir(path) and not kwargs.pop("_validated", False):
            validate_checkpoint(local_dir)
        if expert_parallel:
            return cls._from_pretrained_expert_parallel(local_dir, model_args, kwargs, expert_parallel_size, process_group)
        if cls.base_model_class is None:
            config = kwargs.get("config")
            if not isinstance(config, MoEConfig):
                hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
                kwargs["config"] = config = MoEConfig.from_pretrained(path, **hub)
            cls = moe_model_class_for_config(config)
        output_loading_info = kwargs.pop("output_loading_info", False)
        model, info = super(MoEForCausalLM, cls).from_pretrained(
            pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
        )
        if info["missing_keys"]:
            raise missing_keys_error(path, info["missing_keys"])
        return (model, info) if output_loading_info else model

    @classmethod
    def _from_pretrained_expert_parallel(cls, directory, model_args, kwargs, expert_parallel_size, process_group):
        """Load this rank's experts only: transformers loads from a view of the directory that lists the
        non-expert files and this rank's expert files, into a model whose experts hold this rank's block."""
        from . import parallel
        from .checkpoint import local_expert_view

        if not os.path.isdir(directory):
            raise FileNotFoundError(f"expert_parallel=True loads from a local directory; {directory} is not one.")
        plan = parallel.build_plan(process_group, expert_parallel_size)
        config = MoEConfig.from_pretrained(directory)
        start, end = plan.expert_range(config.num_experts)
        with local_expert_view(directory, start, end) as view, parallel.local_experts(plan):
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
        record = output_router_logits or labels is not None or self.training

        with RouterRecorder(self) if record else nullcontext() as recorder:
            outputs = base_forward(self, **kwargs)

        loss = outputs.loss
        aux_loss = z_loss = None
        if recorder is not None and recorder.outputs:
            aux_loss, z_loss = self._router_losses(recorder.outputs, kwargs.get("attention_mask"))
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
            past_key_values=getattr(outputs, "past_key_values", None),
            hidden_states=getattr(outputs, "hidden_states", None),
            attentions=getattr(outputs, "attentions", None),
            router_logits=tuple(r.router_logits for r in recorder.outputs) if output_router_logits else None,
        )
        return result if return_dict is not False else result.to_tuple()

    def _router_losses(self, routings: list[RouterOutput], attention_mask) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(balancing loss averaged over the token-choice layers, or None; z-loss averaged over all layers).

        In training, also adds each layer's numbers to `routing_stats` and the loads to aux_free routers.
        """
        num_experts = self.config.num_experts
        mask = _token_mask(attention_mask, routings[0].router_logits.shape[0])
        balance = [
            None if r.is_expert_choice else load_balancing_loss(r.router_probs, r.top_k_index, num_experts, mask)
            for r in routings
        ]
        z = [router_z_loss(r.router_logits, mask) for r in routings]
        if self.training:
            stats = self.routing_stats
            for layer, (block, routing) in enumerate(zip(moe_blocks(self), routings)):
                stats.add(layer, routing, balance[layer], z[layer])
                if isinstance(block.gate, AuxFreeRouter):
                    block.gate.record_load(routing.expert_load(num_experts))
        token_choice = [b for b in balance if b is not None]
        return (torch.stack(token_choice).mean() if token_choice else None), torch.stack(z).mean()

    @property
    def routing_stats(self) -> RoutingStats:
        """Routing statistics summed over training forwards since the last reset (see `RoutingStats`)."""
        stats = self.__dict__.get("_routing_stats")
        device = moe_blocks(self)[0].gate.weight.device
        if stats is None or stats.load.device != device:
            stats = RoutingStats(len(self.config.moe_layers), self.config.num_experts, device)
            self.__dict__["_routing_stats"] = stats  # a plain attribute: not a buffer, not in the state dict
        return stats

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


def _token_mask(attention_mask: torch.Tensor | None, num_tokens: int) -> torch.Tensor | None:
    """The 2-D padding mask as [N] flags, when it lines up with the routed tokens (not during cached decoding)."""
    if attention_mask is None or attention_mask.dim() != 2 or attention_mask.numel() != num_tokens:
        return None
    return attention_mask.reshape(-1) != 0


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


# --------------------------------------------------------------------------------------------------------------
# Where the MoE blocks go
# --------------------------------------------------------------------------------------------------------------
def install_moe_blocks(model: nn.Module, config: MoEConfig, blocks: dict[int, nn.Module] | None = None) -> None:
    """Put an MoE block in each layer of `config.moe_layers` (new blocks unless `blocks` gives them)."""
    layers = model.get_submodule(config.decoder_layers_path)
    for i in config.moe_layers:
        block = blocks[i] if blocks is not None else SparseMoeBlock(config)
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
    base_config = config.base_config_class
    if base_config not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"transformers has no causal-LM class for model type {config.base_model_type!r}.")
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
        "forward": _wrap_forward(base_model_class.forward),
    }
    cls = _MODEL_CLASSES[base_model_class] = type(name, (MoEForCausalLM, base_model_class), namespace)
    setattr(sys.modules[__name__], name, cls)
    AutoModelForCausalLM.register(config_class, cls, exist_ok=True)
    return cls


def register_model_class(config_class: type[MoEConfig]) -> None:
    """Make the model class of a new specialised config class, if transformers has a causal LM for its base."""
    base = config_class.base_config_class
    if base in MODEL_FOR_CAUSAL_LM_MAPPING:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[base]
        moe_model_class(model_class[0] if isinstance(model_class, (list, tuple)) else model_class)


def _wrap_forward(base_forward):
    """The base forward plus the MoE outputs, with the base forward's signature (Trainer and generate read it)."""
    signature = inspect.signature(base_forward)
    var_kwargs = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    @functools.wraps(base_forward)
    def forward(self, *args, **kwargs):
        if args:
            bound = signature.bind_partial(self, *args, **kwargs).arguments
            bound.pop(next(iter(signature.parameters)))  # self
            kwargs = {**bound.pop(var_kwargs, {}), **bound} if var_kwargs else dict(bound)
        return self._moe_forward(base_forward, **kwargs)

    return forward


def __getattr__(name: str):
    # Lets pickle find a specialised class in a fresh process: `MoELlamaForCausalLM`.
    if name.startswith("MoE"):
        for model_class in MODEL_FOR_CAUSAL_LM_MAPPING.values():
            if isinstance(model_class, type) and model_class.__name__ == name[3:]:
                return moe_model_class(model_class)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
