"""The MoE models: a base model's head (causal LM, sequence or token classification) over its backbone with MoE
blocks in place of some of its MLPs.

The model *is* the base architecture: `MoEForCausalLM(config)` returns a `MoELlamaForCausalLM`, deriving from
`LlamaForCausalLM`, over a `MoELlamaModel` backbone (docs/architecture.md, "Per-base classes", explains how these
classes are made and registered). Attention, caches, generation, gradient checkpointing and `device_map` are the
base model's own code; only the chosen MLP modules are swapped for `SparseMoeBlock`s. As in transformers' own MoE
models, the backbone returns a `MoeModelOutputWithPast` with each MoE layer's `router_logits` when asked
(`output_router_logits`), and the head adds the load-balancing and z losses in training.

The other heads work the same way (`MoEForSequenceClassification` over `LlamaForSequenceClassification`, ...), so
reward models and classifiers are MoE models too (`moe_model_class`).
"""

from __future__ import annotations

import copy
import inspect
import os
import sys
import warnings
from dataclasses import dataclass

import torch
import transformers
from torch.distributed.tensor import DTensor
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import (
    MoeCausalLMOutputWithPast, SequenceClassifierOutputWithPast, TokenClassifierOutput,
)

from . import parallel
from .backbone import install_moe_blocks, wrap_forward
from .checkpoint import (
    HUB_KWARGS, local_expert_view, missing_keys_error, recover_interrupted_commit, resolve_checkpoint, save_checkpoint,
    validate_checkpoint, reading as checkpoint_reading,  # (hf_moe/checkpoint/snapshot.py)
)
from .checkpoint.adapter_experts import is_adapter_checkpoint, load_adapter_model
from .compat import (
    MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING, MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING,
)
from .configuration import MoEConfig, _base_config_class, check_layout_kwargs, moe_config_class
from .decode import decode_step, reset_decode_steps
from .generation import DecodeCompileConfig, prepare_generate_kwargs
from .layers import SparseMoeBlock
from .layers.adapter_experts import AdapterExperts, check_modules_to_save
from .layers.quantized import int8_expert_targets, int8_lora_message
from .layers.router import AuxFreeRouter
from .losses import attach_aux_loss
from .offload import load_offloaded
from .routing import RoutingStats, moe_blocks, routing_losses, token_mask


# --------------------------------------------------------------------------------------------------------------
# Outputs: transformers' own, plus the routers' losses and logits
# --------------------------------------------------------------------------------------------------------------
@dataclass
class MoECausalLMOutputWithPast(MoeCausalLMOutputWithPast):
    """transformers' `MoeCausalLMOutputWithPast`, plus the router z-loss.

    aux_loss: the load-balancing loss (fp32, averaged over MoE layers; without its coefficient).
    z_loss: the router z-loss (fp32, averaged over MoE layers; without its coefficient).
    """

    z_loss: torch.FloatTensor | None = None


@dataclass
class MoESequenceClassifierOutputWithPast(SequenceClassifierOutputWithPast):
    """transformers' `SequenceClassifierOutputWithPast`, plus `aux_loss`, `z_loss` and `router_logits` (as in
    `MoECausalLMOutputWithPast`)."""

    aux_loss: torch.FloatTensor | None = None
    z_loss: torch.FloatTensor | None = None
    router_logits: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class MoETokenClassifierOutput(TokenClassifierOutput):
    """transformers' `TokenClassifierOutput`, plus `aux_loss`, `z_loss` and `router_logits`."""

    aux_loss: torch.FloatTensor | None = None
    z_loss: torch.FloatTensor | None = None
    router_logits: tuple[torch.FloatTensor, ...] | None = None


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


# --------------------------------------------------------------------------------------------------------------
# What every head shares: construction, loading and saving, the routers' losses
# --------------------------------------------------------------------------------------------------------------
class MoEPreTrainedModel(PreTrainedModel):
    """The part every MoE head shares. Subclasses name the transformers head they wrap (`head_mapping`, e.g.
    `MODEL_FOR_CAUSAL_LM_MAPPING`) and the output they return.

    `MoEForCausalLM(config)`, `MoEForCausalLM.from_pretrained(path)` and `AutoModelForCausalLM.from_pretrained(path)`
    (after `import hf_moe`) all return an instance of the specialised subclass for the base architecture, so
    `isinstance(model, MoEForCausalLM)` always holds; the same for the other heads.
    """

    config_class = MoEConfig
    head_mapping = None  # transformers' mapping from a base config class to this head's class
    output_class = None  # the dataclass `forward` returns
    # The base model's head class; set on the specialised subclasses only.
    base_model_class: type[PreTrainedModel] | None = None

    def __new__(cls, config=None, *args, **kwargs):
        if cls.base_model_class is None:
            cls = moe_model_class_for_config(config, cls)
        return super().__new__(cls)

    def __init__(self, config: MoEConfig, *args, expert_range: tuple[int, int] | None = None, **kwargs):
        """`expert_range` (start, end): build only experts [start, end) of every MoE layer (one process's block
        under expert parallelism; `from_pretrained(expert_parallel=True)` passes it)."""
        super().__init__(config, *args, **kwargs)  # the base architecture, dense MLPs included
        install_moe_blocks(self, config, expert_range=expert_range)  # new blocks initialise themselves
        self.post_init()  # recomputes the tied-weight map and the other per-model properties

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModelForCausalLM"):
        """Does nothing. transformers calls it when it loads a checkpoint's `auto_map` code; marking this class
        would make every later save copy hf_moe's source files into the checkpoint. hf_moe no longer writes
        `auto_map` (checkpoint.format); a checkpoint an older hf_moe saved may carry it, pointing at the small
        `modeling_hf_moe.py` shim that imports the installed package, and still loads through it."""

    # ----------------------------------------------------------------------------------------------------------
    # Construction and loading
    # ----------------------------------------------------------------------------------------------------------
    @classmethod
    def from_dense(cls, model: PreTrainedModel, config: MoEConfig, blocks: dict[int, SparseMoeBlock]):
        """Turn a dense model into an MoE model in place and return it.

        As with FastMoE's `fmoefy` or PEFT's `get_peft_model`, `model` itself becomes the MoE model: its
        attention, embeddings, norms, head, buffers, dtype and device placement are kept as they are, and the MLPs
        of `config.moe_layers` are replaced by `blocks` (layer index -> block).
        """
        moe_class = moe_model_class(type(model))
        old_config = model.config
        model.__class__ = moe_class
        for module in model.modules():
            if getattr(module, "config", None) is old_config:
                module.config = config
        install_moe_blocks(model, config, blocks)
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
        block of experts (see `hf_moe.expert_parallel` for `expert_parallel_size` and `process_group`). With
        `offload_experts="disk"|"cpu"` and `max_expert_memory`, the experts stay in their files and are read on
        demand into a bounded cache (`hf_moe.offload`).

        A checkpoint of adapter experts (`convert_to_moe(..., method="lora" | "pesc")`) holds only what was trained:
        it is loaded onto the base model it records, whose weights must match the fingerprint recorded at conversion;
        `base=` (a path, Hub id or the dense model itself) names the base instead (hf_moe/convert/adapter_experts.py).
        """
        adapter_dir = os.path.normpath(os.path.join(os.fspath(pretrained_model_name_or_path), kwargs.get("subfolder", "")))
        if is_adapter_checkpoint(adapter_dir):
            kwargs.pop("subfolder", None)  # (the checkpoint's, not the base's)
            return load_adapter_model(cls, adapter_dir, *model_args, expert_parallel=expert_parallel, **kwargs)
        if kwargs.get("offload_experts") is not None or kwargs.get("max_expert_memory") is not None:
            check_layout_kwargs(os.fspath(pretrained_model_name_or_path), kwargs)
            return load_offloaded(
                cls, pretrained_model_name_or_path, *model_args, expert_parallel=expert_parallel, **kwargs
            )
        name = os.fspath(pretrained_model_name_or_path)
        if not kwargs.get("_validated"):  # a Hub id: its snapshot in the cache, checked as any directory (hub.py)
            path = resolve_checkpoint(name, **{k: kwargs[k] for k in HUB_KWARGS if k in kwargs})
        else:
            path = name
        local_dir = os.path.join(path, kwargs.get("subfolder") or "")
        verify_checksums = kwargs.pop("verify_checksums", None)
        with checkpoint_reading(local_dir):  # checks and load see one checkpoint: a save into it waits
            if not kwargs.pop("_validated", False) and (os.path.isdir(local_dir) or recover_interrupted_commit(path)):
                # (under expert parallelism each rank hashes only the files it reads: see local_expert_view)
                validate_checkpoint(
                    local_dir, verify_checksums=False if expert_parallel else verify_checksums, model_class=cls
                )
            if expert_parallel:
                return cls._from_pretrained_expert_parallel(
                    local_dir, model_args, kwargs, expert_parallel_size, process_group, verify_checksums
                )
            if isinstance(kwargs.get("config"), MoEConfig):
                kwargs["config"] = _with_config_kwargs(kwargs["config"], kwargs)
            else:
                check_layout_kwargs(local_dir, kwargs)
            cls = cls._specialised_for(path, kwargs)
            output_loading_info = kwargs.pop("output_loading_info", False)
            model, info = super(MoEPreTrainedModel, cls).from_pretrained(
                path, *model_args, output_loading_info=True, **kwargs
            )
        if path != name:
            model.config.name_or_path = name  # (the Hub id, as transformers records it)
        missing = model._missing_saved_keys(info["missing_keys"])
        if missing:
            raise missing_keys_error(path, missing)
        return (model, info) if output_loading_info else model

    def _missing_saved_keys(self, missing_keys) -> list[str]:
        """The missing keys that the checkpoint should have had: all of them when it was saved from this head, else
        those of the backbone (a causal-LM checkpoint loaded as a classifier lacks the new head, as in
        transformers, which initialises it and says so)."""
        if type(self).__name__ in (self.config.architectures or []):
            return list(missing_keys)
        prefix = self.base_model_prefix + "."
        return [k for k in missing_keys if k.startswith(prefix)]

    @classmethod
    def _specialised_for(cls, path, kwargs: dict) -> type[MoEPreTrainedModel]:
        """This class if it is specialised, else the specialised class of the config in `kwargs` or of the
        checkpoint at `path` (only its base type is read; transformers loads the config itself)."""
        config = kwargs.get("config")
        if isinstance(config, MoEConfig):
            return cls if cls.base_model_class is not None else moe_model_class_for_config(config, cls)
        if config is not None and not isinstance(config, (str, os.PathLike)):
            moe_model_class_for_config(config, cls)  # raises: not an MoE config, with what to do instead
        if cls.base_model_class is not None:
            return cls
        hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
        config_dict, _ = MoEConfig.get_config_dict(os.fspath(config if config is not None else path), **hub)
        base_config_class = _base_config_class(config_dict.get("base_model_type"))
        return moe_model_class_for_config(moe_config_class(base_config_class), cls)

    @classmethod
    def _from_pretrained_expert_parallel(
        cls, directory, model_args, kwargs, expert_parallel_size, process_group, verify_checksums=None
    ):
        """Load this rank's experts only: transformers loads from a view of the directory that lists the
        non-expert files and this rank's expert files, into a model whose experts hold this rank's block."""
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"expert_parallel=True loads from a local directory; {directory} is not one.")
        plan = parallel.build_plan(process_group, expert_parallel_size)
        config = MoEConfig.from_pretrained(directory)
        start, end = plan.expert_range(config.num_experts)
        with local_expert_view(directory, start, end, verify_checksums) as view:
            model = cls.from_pretrained(view, *model_args, _validated=True, expert_range=(start, end), **kwargs)
        model.config.name_or_path = directory
        return parallel.finish(model, plan)

    @classmethod
    def _from_config(cls, config, **kwargs):
        if cls.base_model_class is None:
            cls = moe_model_class_for_config(config, cls)
        return super(MoEPreTrainedModel, cls)._from_config(config, **kwargs)

    # ----------------------------------------------------------------------------------------------------------
    # Forward: the base head's forward, with the routers recorded and their losses added in training
    # ----------------------------------------------------------------------------------------------------------
    def _moe_forward(self, base_forward, **kwargs):
        output_router_logits = kwargs.pop("output_router_logits", None)
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        return_dict = kwargs.pop("return_dict", None)
        recorder = self.base_model.router_recorder
        labeled = kwargs.get("labels") is not None
        opened = recorder.start() if output_router_logits or labeled or self.training else False
        try:
            outputs = base_forward(self, **kwargs)
        finally:
            routings = recorder.stop() if opened else []

        fields = {k: v for k, v in outputs.items() if k in self.output_class.__dataclass_fields__}
        aux_loss = z_loss = None
        if routings:
            mask = token_mask(kwargs.get("attention_mask"), routings[0].router_logits.shape[0])
            balance, z = routing_losses(routings, self.config.num_experts, mask)
            if self.training:
                self.base_model.record_routing(routings, balance, z)
            token_choice = [b for b in balance if b is not None]
            aux_loss = torch.stack(token_choice).mean() if token_choice else None
            z_loss = torch.stack(z).mean()
            if self.training:
                self._add_router_losses(fields, aux_loss, z_loss, kwargs)
        result = self.output_class(
            **fields,
            aux_loss=aux_loss,
            z_loss=z_loss,
            router_logits=tuple(r.router_logits for r in routings) if output_router_logits else None,
        )
        return result if return_dict is not False else result.to_tuple()

    def _add_router_losses(self, fields: dict, aux_loss, z_loss, kwargs: dict) -> None:
        """Training: `router_aux_loss_coef * aux_loss + router_z_loss_coef * z_loss` joins the head's loss when the
        head computed one (labels given). Without labels, the caller computes its loss from the outputs itself (TRL's
        RewardTrainer does, from the logits): the routers' losses then reach the gradient through the logits
        (`losses.attach_aux_loss`), so the routers still learn to balance whatever the trainer."""
        c = self.config
        extra = c.router_z_loss_coef * z_loss
        if aux_loss is not None and c.router_aux_loss_coef:
            self._check_aux_loss_has_grad(aux_loss)
            extra = extra + c.router_aux_loss_coef * aux_loss
        if fields.get("loss") is not None:
            fields["loss"] = fields["loss"] + self._aux_loss_weight(kwargs) * extra.to(fields["loss"].dtype)
        elif extra.requires_grad:
            fields["logits"] = attach_aux_loss(fields["logits"], extra)

    def _aux_loss_weight(self, kwargs: dict) -> torch.Tensor | float:
        """The weight of the routers' losses in the head's loss (see `MoEForCausalLM`)."""
        return 1.0

    def _check_aux_loss_has_grad(self, aux_loss: torch.Tensor) -> None:
        if torch.is_grad_enabled() and not aux_loss.requires_grad:
            if any(block.gate.weight.requires_grad for block in moe_blocks(self)):
                warnings.warn(
                    "The load-balancing loss has no gradient, so the routers will not learn to balance. This "
                    "happens with gradient checkpointing in reentrant mode; use the default "
                    "`gradient_checkpointing_enable()` (use_reentrant=False).",
                    stacklevel=4,
                )

    @property
    def peft_config(self) -> dict:
        """The PEFT adapters' configs by name. PEFT sets it on the model it adapts once it has matched its targets
        (`model.peft_config = ...`); as a property, this model checks them then. A LoRA whose `target_parameters`
        name int8 experts (`hf_moe.quantize_experts`), which PEFT skips with only a warning when other targets
        matched, is refused with what to target instead. (With no other target, PEFT raises its own
        "no `target_parameters` found" before this; docs/tools.md explains both.)"""
        try:
            return self.__dict__["_peft_config"]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no PEFT adapter (peft_config)") from None

    @peft_config.setter
    def peft_config(self, configs: dict) -> None:
        for config in configs.values():
            targets = int8_expert_targets(self, getattr(config, "target_parameters", None))
            if targets:
                raise ValueError(int8_lora_message(targets))
        check_modules_to_save(self)
        self.__dict__["_peft_config"] = configs

    @peft_config.deleter
    def peft_config(self) -> None:
        self.__dict__.pop("_peft_config", None)

    @property
    def routing_stats(self) -> RoutingStats:
        """Routing statistics summed over training forwards since the last reset (see `RoutingStats`)."""
        return self.base_model.routing_stats

    def update_router_biases(self) -> None:
        """Move the selection bias of every aux_free router toward balance, from the loads since the last call.

        Runs after each step of the optimizer attached to the model (`MoETrainer`'s, or `hf_moe.attach_aux_free`);
        call it yourself only with an optimizer that is not a `torch.optim.Optimizer`.
        """
        for block in moe_blocks(self):
            if isinstance(block.gate, AuxFreeRouter):
                block.gate.update_bias()

    # ----------------------------------------------------------------------------------------------------------
    # Saving and inspection
    # ----------------------------------------------------------------------------------------------------------
    def save_pretrained(self, save_directory, is_main_process: bool = True, state_dict=None, **kwargs):
        """Save as safetensors with one file per expert index (see `hf_moe.checkpoint`). Atomic."""
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

        def full_numel(p, experts=None) -> int:
            # A DTensor (sharded: FSDP2, expert parallelism) reports its global numel. A plain expert parameter
            # built under expert parallelism holds num_local_experts of num_experts: count them all.
            if isinstance(p, DTensor) or experts is None:
                return p.numel()
            return p.numel() * experts.num_experts // experts.num_local_experts

        blocks = moe_blocks(self)
        expert_params = {id(p) for block in blocks for p in _routed_parameters(block.experts)}
        expert = sum(full_numel(p, block.experts) for block in blocks for p in _routed_parameters(block.experts))
        total = sum(full_numel(p) for p in self.parameters() if id(p) not in expert_params) + expert
        c = self.config
        active = total - expert + expert * c.num_experts_per_tok // c.num_experts
        return {"total": total, "active": active, "expert": expert, "experts_per_token": c.num_experts_per_tok}


# --------------------------------------------------------------------------------------------------------------
# The heads
# --------------------------------------------------------------------------------------------------------------
class MoEForCausalLM(MoEPreTrainedModel, GenerationMixin):
    """A causal LM whose chosen MLP blocks are Mixture-of-Experts blocks. Build one from a dense model with
    `hf_moe.convert_to_moe`.

    With `labels`, in training, its loss is the LM loss plus `router_aux_loss_coef` x the balancing loss (+
    `router_z_loss_coef` x the z-loss), weighted by the micro-batch's share of the label tokens when
    `transformers.Trainer` passes `num_items_in_batch`.
    """

    head_mapping = MODEL_FOR_CAUSAL_LM_MAPPING
    output_class = MoECausalLMOutputWithPast

    def _aux_loss_weight(self, kwargs: dict) -> torch.Tensor | float:
        """Scale of the aux loss so that it is weighted like the LM loss it is added to.

        `transformers.Trainer` passes `num_items_in_batch` (label tokens over all gradient-accumulation
        micro-batches, and over all ranks with `average_tokens_across_devices`). The LM loss is then a sum divided
        by that count, and Trainer neither averages over micro-batches nor over ranks. Weighting each micro-batch's
        aux loss by its share of the label tokens makes the total a token-weighted mean, as for the LM loss, instead
        of a sum that grows with the accumulation steps and the number of ranks.
        """
        num_items_in_batch = kwargs.get("num_items_in_batch")
        if num_items_in_batch is None or kwargs.get("labels") is None:
            return 1.0
        local = kwargs["labels"][..., 1:].ne(-100).sum()
        return local.to(torch.float32) / num_items_in_batch

    def _add_router_losses(self, fields: dict, aux_loss, z_loss, kwargs: dict) -> None:
        if fields.get("loss") is not None:  # without labels a causal LM adds nothing: trainers that compute the
            super()._add_router_losses(fields, aux_loss, z_loss, kwargs)  # LM loss themselves add `aux_loss`

    def get_compiled_call(self, compile_config):
        """The compiled forward `generate` runs for each decoded token (transformers' `get_compiled_call`): with
        hf_moe's decode config (`hf_moe.generation.decode_compile_config`, what a static cache gets by default),
        hf_moe's decode step (`hf_moe.decode`: one-op or attention-block) where the architecture allows it, else
        transformers' own."""
        if not (isinstance(compile_config, DecodeCompileConfig) and compile_config.hf_moe_step):
            return super().get_compiled_call(compile_config)
        step = decode_step(self, compile_config, lambda: super(MoEForCausalLM, self).get_compiled_call(compile_config))
        return step if step is not None else super().get_compiled_call(compile_config)

    def generate(self, *args, **kwargs):
        """`GenerationMixin.generate`. Under expert parallelism every forward exchanges tokens with the other ranks,
        so a rank that has finished must keep running forwards until all have: `synced_gpus` defaults to True
        there, as transformers does for ZeRO-3 and FSDP. With a static cache (`cache_implementation="static"`)
        the decode step is compiled once, on CPU too (`hf_moe.generation`)."""
        kwargs = prepare_generate_kwargs(self, args, kwargs)
        reset_decode_steps(self)  # the call's first step checks every guard (the model may have changed since)
        try:
            if getattr(self, "expert_parallel_plan", None) is not None:
                call = inspect.signature(super().generate).bind_partial(*args, **kwargs)
                if call.arguments.get("synced_gpus") is None:
                    call.arguments["synced_gpus"] = torch.distributed.get_world_size() > 1
                    return super().generate(*call.args, **call.kwargs)
            return super().generate(*args, **kwargs)
        finally:  # the one-op step's references to the weights end with the call (a model quantized next frees them)
            reset_decode_steps(self)


class MoEForSequenceClassification(MoEPreTrainedModel):
    """A sequence classifier (or reward model) over an MoE backbone: the base family's
    `...ForSequenceClassification` head. In training the routers' losses join the head's loss with `labels`, and
    reach the gradient through the logits without (TRL's `RewardTrainer` computes its loss from the logits)."""

    head_mapping = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING
    output_class = MoESequenceClassifierOutputWithPast


class MoEForTokenClassification(MoEPreTrainedModel):
    """A token classifier over an MoE backbone: the base family's `...ForTokenClassification` head."""

    head_mapping = MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING
    output_class = MoETokenClassifierOutput


HEADS = (MoEForCausalLM, MoEForSequenceClassification, MoEForTokenClassification)


def _routed_parameters(experts):
    """The parameters of an experts module that belong to one expert each: all, except the frozen MLP adapter experts
    share (a token runs it whichever experts it is routed to)."""
    return experts.parameters(recurse=not isinstance(experts, AdapterExperts))


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
# Specialised classes: one per base head class
# --------------------------------------------------------------------------------------------------------------
def base_head_class(head: type[MoEPreTrainedModel], base_config_class) -> type[PreTrainedModel] | None:
    """The transformers class of `head` for a base config class (`LlamaForSequenceClassification` for
    `MoEForSequenceClassification` and `LlamaConfig`), or None when the family has no such head."""
    if base_config_class not in head.head_mapping:
        return None
    base_class = head.head_mapping[base_config_class]
    return base_class[0] if isinstance(base_class, (list, tuple)) else base_class


def moe_model_class_for_config(config, head: type[MoEPreTrainedModel] = None) -> type[MoEPreTrainedModel]:
    """The specialised `head` class (default: `MoEForCausalLM`) for an MoE config or specialised config class."""
    config_class = config if isinstance(config, type) else type(config)
    if not issubclass(config_class, MoEConfig):
        raise TypeError(
            f"{(head or MoEForCausalLM).__name__} needs an MoEConfig (model_type='hf_moe'), got "
            f"{config_class.__name__}. To make an MoE model from a dense one, use "
            "`hf_moe.convert_to_moe(model, num_experts, top_k)`."
        )
    head, base_config = _generic(head or MoEForCausalLM), config_class.base_config_class
    base_class = base_head_class(head, base_config)
    if base_class is None:
        raise ValueError(f"transformers has no {head.__name__.removeprefix('MoEFor')} class for model type "
                         f"{base_config.model_type!r}.")
    return moe_model_class(base_class)


_MODEL_CLASSES: dict[type[PreTrainedModel], type[MoEPreTrainedModel]] = {}


def moe_model_class(base_model_class: type[PreTrainedModel]) -> type[MoEPreTrainedModel]:
    """The MoE subclass of a base head class, e.g. `MoELlamaForCausalLM` over `LlamaForCausalLM` (a subclass of
    `MoEForCausalLM`) or `MoELlamaForSequenceClassification` over `LlamaForSequenceClassification`."""
    if base_model_class in _MODEL_CLASSES:
        return _MODEL_CLASSES[base_model_class]
    if issubclass(base_model_class, MoEPreTrainedModel):
        raise ValueError(f"{base_model_class.__name__} is already an MoE model class.")
    config_class = moe_config_class(base_model_class.config_class)  # its hooks may make this very class
    if base_model_class in _MODEL_CLASSES:
        return _MODEL_CLASSES[base_model_class]
    head = head_of(base_model_class)
    name = f"MoE{base_model_class.__name__}"
    namespace = {
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": f"`{head.__name__}` over `{base_model_class.__name__}`.",
        "config_class": config_class,
        "base_model_class": base_model_class,
        "forward": wrap_forward(base_model_class.forward, "_moe_forward"),
    }
    cls = _MODEL_CLASSES[base_model_class] = type(name, (head, base_model_class), namespace)
    setattr(sys.modules[__name__], name, cls)
    return cls


def head_of(base_model_class: type[PreTrainedModel]) -> type[MoEPreTrainedModel]:
    """The MoE head for a base model class: the one whose transformers class it is (or derives from); a causal LM
    for a class transformers does not register (a model class of the user's own)."""
    for head in HEADS:
        base = base_head_class(head, base_model_class.config_class)
        if base is not None and issubclass(base_model_class, base):
            return head
    return MoEForCausalLM


def _generic(head: type[MoEPreTrainedModel]) -> type[MoEPreTrainedModel]:
    """The generic head class of a (maybe specialised) MoE class."""
    return next((h for h in HEADS if issubclass(head, h)), MoEForCausalLM)


def __getattr__(name: str):
    # Lets pickle find a specialised class in a fresh process: `MoELlamaForCausalLM`.
    base = getattr(transformers, name[3:], None) if name.startswith("MoE") else None
    if isinstance(base, type) and issubclass(base, PreTrainedModel):
        return moe_model_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
