"""Writing the shrunk checkpoint: the same kind as the input, its files laid out before any tensor is written.

    hf_moe   one file per expert index (`model-expert-0000e.safetensors`, e < keep), the others in
             `model-0000k-of-0000n.safetensors`, the index with every file's checksum, config, generation config,
             model card (`hf_moe.checkpoint.save.finish`: no `auto_map` or shim), the tokenizer files copied;
    native   transformers' files (`model.safetensors`, or `model-0000k-of-0000n.safetensors` and the index), the
             source's config.json with the expert count (and top-k) changed and nothing else, its generation config
             and tokenizer files copied byte for byte.

Both get `shrink.json`, what was kept and merged in every layer. Tensors are written one at a time as they are made
(`convert.stream._ShardWriter`); everything lands in a staging directory that replaces OUT in one rename at the end.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from accelerate import init_empty_weights
from transformers import GenerationConfig

from ..checkpoint import TOKENIZER_FILES, copy_files, read_json
from ..checkpoint.commit import commit
from ..checkpoint.layout import _split_by_size, plan_shards
from ..checkpoint.save import finish
from ..compat import convert_file_size_to_int
from ..convert.stream import _ShardWriter
from ..modeling import HEADS, MoEForCausalLM
from .layer import GATE
from .layout import MoELayout

REPORT_NAME = "shrink.json"


class ShrunkWriter:
    """The output files of a shrink into `staging`: `copy_unchanged`, then `write_layer` for every MoE layer, then
    `finish_hf_moe` or `finish_native` (which commit)."""

    def __init__(self, layout: MoELayout, staging: Path, keep: int, max_shard_size: int | str):
        self.layout, self.staging, self.keep = layout, staging, keep
        self.shapes = layout.output_shapes(keep)
        metas = {k: torch.empty(s, dtype=d, device="meta") for k, (d, s) in self.shapes.items()}
        max_bytes = convert_file_size_to_int(max_shard_size)
        self.shards = plan_shards(metas, max_bytes) if not layout.is_native else _native_shards(metas, max_bytes)
        self.writer = _ShardWriter(staging, self.shards, self.shapes)

    def __enter__(self):
        self.writer.__enter__()
        return self

    def __exit__(self, *exc):
        self.writer.__exit__(*exc)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        self.writer.write(key, tensor.to(self.shapes[key][0]))

    def copy_unchanged(self) -> None:
        """Every tensor that shrinking does not touch, read from the source and written as it is."""
        for key in self.layout.copied_keys():
            self.writer.write(key, self.layout.read_stored(key))

    def write_layer(self, layer: int, router: dict[str, torch.Tensor], experts: dict[str, torch.Tensor]) -> None:
        """MoE layer `layer`'s router state ({name: [keep, ...]}) and fused expert tensors ({name: [keep, ...]}),
        each cast to the source's dtype."""
        prefix = self.layout.disk_prefix(layer) + GATE
        for name, tensor in router.items():
            if prefix + name in self.shapes:
                self.write(prefix + name, tensor)
        for key, tensor in self.layout.expert_tensors(layer, experts).items():
            self.write(key, tensor)

    # ------------------------------------------------------------------------------------------------ finishing
    def finish_hf_moe(self, config, target: Path, report: dict) -> None:
        """config.json (`config`), the index with checksums, model card, shim, tokenizer and report; commit."""
        self.writer.close()
        source = self.layout.source
        with init_empty_weights():
            model = head_class(config)(config)
        model.to(source.float_dtype() if not isinstance(getattr(config, "dtype", None), torch.dtype)
                 else config.dtype)
        if (source.directory / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_dict(
                read_json(source.directory, "generation_config.json", "the model"))
        finish(model, self.staging, target, [self.writer.weight_map],
               extra=lambda staging: self._extra(staging, report))

    def finish_native(self, config_fields: dict, target: Path, report: dict) -> None:
        """The source's config.json with `config_fields` changed, the index where there are several files, the
        generation config, tokenizer and report; commit."""
        self.writer.close()
        directory = self.layout.source.directory
        config = read_json(directory, "config.json", "the model")
        aliases = getattr(type(self.layout.config), "attribute_map", {})
        for name, value in config_fields.items():  # under whichever name the file uses (Qwen3-MoE's num_experts is
            names = [n for n in (name, aliases.get(name)) if n and n in config]  # num_local_experts in 5.x)
            config.update(dict.fromkeys(names or [aliases.get(name, name)], value))
        (self.staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if len(self.shards) > 1:
            total = sum(math.prod(s) * d.itemsize for d, s in self.shapes.values())
            parameters = sum(math.prod(s) for _, s in self.shapes.values())
            index = {"metadata": {"total_parameters": parameters, "total_size": total},
                     "weight_map": dict(sorted(self.writer.weight_map.items()))}
            (self.staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        copy_files(directory, ("generation_config.json",), self.staging, "the model")
        self._extra(self.staging, report)
        commit(self.staging, target)

    def _extra(self, staging: Path, report: dict) -> None:
        copy_files(self.layout.source.directory, TOKENIZER_FILES, staging, "the model")
        (staging / REPORT_NAME).write_text(json.dumps(report, indent=1) + "\n")


def head_class(config) -> type:
    """The hf_moe head a checkpoint was saved from (config.architectures), causal LM by default."""
    architecture = (getattr(config, "architectures", None) or [""])[0]
    return next((h for h in HEADS if architecture.endswith(h.__name__.removeprefix("MoE"))), MoEForCausalLM)


def _native_shards(metas: dict[str, torch.Tensor], max_bytes: int) -> dict[str, dict[str, torch.Tensor]]:
    """transformers' file names for the tensors: `model.safetensors`, or `model-0000k-of-0000n.safetensors`."""
    groups = _split_by_size(metas, max_bytes)
    if len(groups) == 1:
        return {"model.safetensors": groups[0]}
    return {f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors": g for i, g in enumerate(groups)}
