"""Where an MoE checkpoint keeps what shrinking changes: its routers and experts, in memory and on disk.

Two kinds of checkpoint are read and written, each in its own layout:

    hf_moe   ...{block}.gate.weight [E, H], ...{block}.experts.{e}.gate_up_proj [2I, H] (one file per expert)
    native   transformers' own MoE families, in the layout their `save_pretrained` writes (and the Hub holds):
             mixtral                          ...block_sparse_moe.experts.{e}.w1 / w3 / w2.weight
             qwen2_moe, qwen3_moe, olmoe,     ...mlp.experts.{e}.gate_proj / up_proj / down_proj.weight
             flex_olmo

In memory both are transformers 5.x's fused tensors (`...mlp.experts.gate_up_proj [E, 2I, H]`, gate rows first, and
`down_proj [E, H, I]`): `MoELayout.read` turns an in-memory key into its tensor from the per-expert keys on disk, and
`expert_tensors` turns new fused tensors back into on-disk keys. Everything else (attention, norms, embeddings, a
Qwen2-MoE shared expert and its gate) keeps its key.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedConfig

from ..checkpoint import checkpoint_config, read_json
from ..compat import CONFIG_MAPPING
from ..configuration import MoEConfig
from ..convert.stream import _SafetensorsSource
from ..dense_mlp import all_finite


class ShrinkError(ValueError):
    """The model, the options or the calibration text cannot be shrunk as asked; the message says what to do."""


@dataclass(frozen=True)
class NativeFamily:
    """A transformers MoE family: its on-disk block name, expert projection names and config fields."""

    disk_block: str
    gate: str
    up: str
    down: str
    experts_field: str = "num_experts"


_QWEN_NAMES = dict(disk_block="mlp", gate="gate_proj", up="up_proj", down="down_proj")
NATIVE_FAMILIES = {
    "mixtral": NativeFamily(disk_block="block_sparse_moe", gate="w1", up="w3", down="w2",
                            experts_field="num_local_experts"),
    "qwen2_moe": NativeFamily(**_QWEN_NAMES),
    "qwen3_moe": NativeFamily(**_QWEN_NAMES),
    "olmoe": NativeFamily(**_QWEN_NAMES),
    "flex_olmo": NativeFamily(**_QWEN_NAMES),
}
# hf_moe routers whose rows can be dropped or merged: their routing of a subset of experts is the same router over
# fewer rows. A prototype router splits the experts into fixed groups, which dropping experts breaks.
SHRINKABLE_ROUTERS = ("topk", "noisy_topk", "switch", "gshard", "expert_choice", "aux_free")


@dataclass
class MoELayout:
    """The MoE layers of a checkpoint in directory `source.directory`, and how to read and write their tensors.

    kind: "hf_moe", or the native model_type ("mixtral").
    config: its config (an `MoEConfig` for hf_moe).
    layers_path, block: the decoder layers (`model.layers`) and the MoE block inside one (`mlp`), in memory.
    disk_block: the MoE block's name on disk (`block_sparse_moe` for Mixtral).
    moe_layers: the decoder layers whose block is MoE.
    expert_params: the fused expert parameters in memory (`gate_up_proj`, `down_proj`, biases for hf_moe).
    """

    kind: str
    config: PreTrainedConfig
    source: _SafetensorsSource
    layers_path: str
    block: str
    disk_block: str
    moe_layers: list[int]
    expert_params: tuple[str, ...]
    family: NativeFamily | None = None

    @property
    def is_native(self) -> bool:
        return self.family is not None

    @property
    def num_experts(self) -> int:
        return self.config.num_experts if not self.is_native else getattr(self.config, self.family.experts_field)

    @property
    def top_k(self) -> int:
        return self.config.num_experts_per_tok

    def memory_prefix(self, layer: int) -> str:
        return f"{self.layers_path}.{layer}.{self.block}."

    def disk_prefix(self, layer: int) -> str:
        return f"{self.layers_path}.{layer}.{self.disk_block}."

    # ------------------------------------------------------------------------------------------------ reading
    def read(self, key: str) -> torch.Tensor:
        """The tensor of in-memory key `key` (fused experts stacked from their per-expert keys on disk)."""
        layer, rest = self._moe_part(key)
        if layer is None:
            return self.read_stored(key)
        if rest.startswith("experts.") and rest.count(".") == 1:
            name = rest.split(".", 1)[1]
            return torch.stack([self._read_expert(layer, e, name) for e in range(self.num_experts)])
        return self.read_stored(self.disk_prefix(layer) + rest)

    def read_stored(self, key: str) -> torch.Tensor:
        """The tensor of on-disk key `key`; a `ShrinkError` naming it when it holds a NaN or an infinity, which would
        be chosen from, merged and written as if it were a number."""
        tensor = self.source.read(key)
        if not all_finite(tensor):
            bad = int((~torch.isfinite(tensor)).sum())
            raise ShrinkError(f"{self.source.directory}: {key} holds {bad} NaN or infinite value(s) of "
                              f"{tensor.numel()}: a model computing with it is broken (training diverged, or the file "
                              "is damaged). Shrink an earlier checkpoint whose weights are finite.")
        return tensor

    def _moe_part(self, key: str) -> tuple[int | None, str]:
        """(MoE layer, the key's rest inside the block), or (None, key) outside the MoE blocks."""
        match = re.match(rf"^{re.escape(self.layers_path)}\.(\d+)\.{re.escape(self.block)}\.(.+)$", key)
        if match is None or int(match[1]) not in self.moe_layers:
            return None, key
        return int(match[1]), match[2]

    def _read_expert(self, layer: int, e: int, name: str) -> torch.Tensor:
        prefix = f"{self.disk_prefix(layer)}experts.{e}."
        if not self.is_native:
            return self.read_stored(prefix + name)
        f = self.family
        if name == "gate_up_proj":
            return torch.cat([self.read_stored(f"{prefix}{f.gate}.weight"), self.read_stored(f"{prefix}{f.up}.weight")])
        if name == "down_proj":
            return self.read_stored(f"{prefix}{f.down}.weight")
        raise ShrinkError(f"{self.kind} experts have no parameter {name!r}.")

    # ------------------------------------------------------------------------------------------------ writing
    def expert_tensors(self, layer: int, fused: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """{on-disk key: tensor} of new fused expert tensors {name: [E', ...]} of MoE layer `layer`."""
        out = {}
        for name, tensor in fused.items():
            for e in range(tensor.shape[0]):
                prefix = f"{self.disk_prefix(layer)}experts.{e}."
                if not self.is_native:
                    out[prefix + name] = tensor[e]
                elif name == "gate_up_proj":
                    gate, up = tensor[e].chunk(2, dim=0)
                    out[f"{prefix}{self.family.gate}.weight"], out[f"{prefix}{self.family.up}.weight"] = gate, up
                else:
                    out[f"{prefix}{self.family.down}.weight"] = tensor[e]
        return out

    def is_expert_key(self, key: str, layer: int) -> bool:
        return key.startswith(f"{self.disk_prefix(layer)}experts.")

    def router_key(self, key: str, layer: int) -> bool:
        """Whether on-disk `key` is a router tensor with one row per expert (its weight, an aux_free bias, noise)."""
        if not key.startswith(f"{self.disk_prefix(layer)}gate."):
            return False
        shape = self.source.entries[key].shape
        return len(shape) >= 1 and shape[0] == self.num_experts

    def output_shapes(self, keep: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """{on-disk key: (dtype, shape)} of the shrunk checkpoint: experts 0..keep-1 of every MoE layer, router
        tensors of `keep` rows, everything else as it is."""
        shapes = {}
        for key, entry in self.source.entries.items():
            layer = self._disk_layer(key)
            if layer is not None and self.is_expert_key(key, layer):
                e = int(key[len(f"{self.disk_prefix(layer)}experts."):].split(".", 1)[0])
                if e >= keep:
                    continue
            shape = entry.shape
            if layer is not None and self.router_key(key, layer):
                shape = (keep, *shape[1:])
            shapes[key] = (entry.dtype, tuple(shape))
        return shapes

    def _disk_layer(self, key: str) -> int | None:
        match = re.match(rf"^{re.escape(self.layers_path)}\.(\d+)\.{re.escape(self.disk_block)}\.", key)
        return int(match[1]) if match and int(match[1]) in self.moe_layers else None

    def copied_keys(self) -> list[str]:
        """The on-disk keys written as they are (all but the routers' rows and the experts of the MoE layers)."""
        out = []
        for key in self.source.entries:
            layer = self._disk_layer(key)
            if layer is None or not (self.is_expert_key(key, layer) or self.router_key(key, layer)):
                out.append(key)
        return out

    def shrunk_config(self, keep: int, top_k: int) -> PreTrainedConfig:
        """A copy of the config with `keep` experts and top-`top_k`."""
        config = copy.deepcopy(self.config)
        setattr(config, "num_experts" if not self.is_native else self.family.experts_field, keep)
        config.num_experts_per_tok = top_k
        if isinstance(config, MoEConfig):
            config._validate_moe()
        return config


# ---------------------------------------------------------------------------------------------------- opening
def open_layout(directory: str | Path) -> MoELayout:
    """The `MoELayout` of the checkpoint in `directory`; a `ShrinkError` for a model that is not an MoE of a kind
    this can shrink, naming what it is and what to do."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{directory} has no config.json: it is not a saved Hugging Face model.")
    fields = read_json(directory, "config.json", "the model")
    model_type = fields.get("model_type")
    if model_type == MoEConfig.model_type:
        return _hf_moe_layout(directory)
    if model_type in NATIVE_FAMILIES:
        return _native_layout(directory, model_type, fields)
    raise ShrinkError(_not_moe(directory, model_type, fields))


def _not_moe(directory: Path, model_type, fields: dict) -> str:
    if any(k in fields for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")):
        families = ", ".join(NATIVE_FAMILIES)
        return (f"{directory} is a `{model_type}` MoE model, which `hf-moe shrink` does not read yet: it shrinks "
                f"hf_moe checkpoints and transformers' {families}.")
    return (f"{directory} is not a Mixture-of-Experts model (model_type {model_type!r} has no experts): there is "
            "nothing to shrink. Make it an MoE first with `hf-moe convert` (or `hf-moe merge`).")


def _hf_moe_layout(directory: Path) -> MoELayout:
    config = checkpoint_config(directory)
    adapters = (config.adapter_experts or {}).get("method")
    if adapters == "lora":
        raise ShrinkError(f"{directory} holds lora adapter experts (a frozen MLP plus a low-rank adapter per expert), "
                          "and shrinking reads plain experts: run `hf-moe materialize "
                          f"{directory} MATERIALIZED` (hf_moe.materialize) first, then shrink MATERIALIZED.")
    if adapters is not None:
        raise ShrinkError(f"{directory} holds {adapters} adapter experts, and shrinking reads plain experts, which "
                          f"`hf-moe materialize` makes from lora adapter experts only ({adapters} ones compute "
                          "something no plain expert does). Convert the dense model with method='lora', train, run "
                          "`hf-moe materialize`, then shrink; or shrink an upcycled model.")
    if getattr(config, "expert_quantization", None):
        raise ShrinkError(f"{directory} holds int8 experts: shrink the checkpoint they were quantized from, then "
                          "quantize the result (hf_moe.quantize_experts).")
    if config.router_type not in SHRINKABLE_ROUTERS:
        raise ShrinkError(f"router_type={config.router_type!r} cannot be shrunk: only {', '.join(SHRINKABLE_ROUTERS)} "
                          "route a subset of experts the way they route all of them (a prototype router's experts "
                          "form fixed groups).")
    names = ["gate_up_proj" if config.expert_glu else "up_proj", "down_proj"]
    if config.expert_bias:
        names += [f"{n}_bias" for n in names]
    return MoELayout("hf_moe", config, _SafetensorsSource(directory), config.decoder_layers_path,
                     config.moe_block_path, config.moe_block_path, list(config.moe_layers), tuple(names))


def _native_layout(directory: Path, model_type: str, fields: dict) -> MoELayout:
    family = NATIVE_FAMILIES[model_type]
    config = CONFIG_MAPPING[model_type].from_dict(fields)  # from the file read through the guarded opener
    source = _SafetensorsSource(directory)
    routers = re.compile(rf"^(?P<layers>.+)\.(?P<layer>\d+)\.{re.escape(family.disk_block)}\.gate\.weight$")
    found = [(m["layers"], int(m["layer"])) for m in map(routers.match, source.entries) if m]
    if not found:
        raise ShrinkError(
            f"{directory} is a `{model_type}` config, but its weights hold no MoE router "
            f"(`...{family.disk_block}.gate.weight`): the layout is not transformers' {model_type} layout on disk."
        )
    layers_path = found[0][0]
    layout = MoELayout(model_type, config, source, layers_path, "mlp", family.disk_block,
                       sorted(layer for _, layer in found), ("gate_up_proj", "down_proj"), family)
    e, hidden = layout.num_experts, config.hidden_size
    inner_field = "moe_intermediate_size" if getattr(config, "moe_intermediate_size", None) else "intermediate_size"
    inner = getattr(config, inner_field)  # (Qwen: the experts' own size, beside the dense layers')
    sizes = f"{family.experts_field}={e}, hidden_size={hidden}, {inner_field}={inner}"
    for layer in layout.moe_layers:
        router = f"{layout.disk_prefix(layer)}gate.weight"
        if source.entries[router].shape[0] != e:
            raise ShrinkError(f"{directory}: {router} has {source.entries[router].shape[0]} rows, but config.json "
                              f"says {family.experts_field}={e}: the checkpoint is inconsistent.")
        _check_shape(directory, source, router, (e, hidden), sizes)
        for i in range(e):
            for name, shape in ((family.gate, (inner, hidden)), (family.up, (inner, hidden)),
                                (family.down, (hidden, inner))):
                key = f"{layout.disk_prefix(layer)}experts.{i}.{name}.weight"
                if key not in source.entries:
                    raise ShrinkError(
                        f"{directory} has no tensor {key}: shrinking reads the per-expert layout that transformers' "
                        f"save_pretrained writes for {model_type} (a fused or other layout: load the model and save "
                        "it with transformers 5 first)."
                    )
                _check_shape(directory, source, key, shape, sizes)
    return layout


def _check_shape(directory: Path, source: _SafetensorsSource, key: str, shape: tuple[int, ...], sizes: str) -> None:
    """On-disk tensor `key` is floating point and of `shape`, which config.json's `sizes` imply."""
    entry = source.entries[key]
    if tuple(entry.shape) != shape or not entry.dtype.is_floating_point:
        raise ShrinkError(f"{directory}: {key} is a {str(entry.dtype).removeprefix('torch.')} tensor of shape "
                          f"{list(entry.shape)}, but config.json ({sizes}) implies a floating-point one of shape "
                          f"{list(shape)}: the checkpoint is inconsistent (a damaged or edited file, or another "
                          "model's config.json).")
