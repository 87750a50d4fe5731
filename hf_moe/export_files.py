"""The files of a native export, written tensor by tensor.

An hf_moe checkpoint stores each expert's fused tensors (`...mlp.experts.{e}.gate_up_proj [2I, H]`,
`...down_proj [H, I]`); a native MoE checkpoint stores each expert's projections under its family's names
(Mixtral's `...block_sparse_moe.experts.{e}.w1.weight`, Qwen3-MoE's `...mlp.experts.{e}.gate_proj.weight`), the
layout of the Hub's checkpoints that transformers converts on load. Every other tensor keeps its name.

The writer never holds the model: the output files' headers are laid out from the source's headers, then each
source tensor is read on its own (with `pread`, into fresh memory, so the file is not mapped and left resident),
split, and written at its place. Peak memory is one source tensor, whatever the size of the model; the files are
those `save_pretrained` of the native model writes (same names, shards, index and tensor bytes; tests/test_export.py
compares them).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .compat import convert_file_size_to_int
from .convert.stream import _SafetensorsSource, _ShardWriter

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class NativeLayout:
    """On-disk names of a native MoE family: its MoE block in a decoder layer (`block`), an expert's gate, up
    and down projections, and its one shared expert's module where it has one (Qwen2-MoE's `shared_expert`, beside
    its `shared_expert_gate`)."""

    block: str
    gate: str
    up: str
    down: str
    shared_expert: str | None = None


@dataclass(frozen=True)
class Output:
    """One tensor of the export: `key` holds rows [start, stop) (all rows if None) of the source tensor `source`."""

    key: str
    source: str
    rows: tuple[int, int] | None
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class ModelSource:
    """The tensors of an in-memory hf_moe model under their on-disk names (experts split per expert, as views)."""

    def __init__(self, model):
        from .checkpoint import checkpoint_state_dict

        self.tensors = {k: t.detach() for k, t in checkpoint_state_dict(model).items()}
        self.shapes = {k: (t.dtype, tuple(t.shape)) for k, t in self.tensors.items()}

    def read(self, key: str) -> torch.Tensor:
        return self.tensors[key].cpu()


class DirectorySource:
    """The tensors of a saved hf_moe checkpoint, each read on its own (its headers checked; see `convert.stream`)."""

    def __init__(self, directory: Path):
        self.reader = _SafetensorsSource(Path(directory))
        self.shapes = {k: (e.dtype, tuple(e.shape)) for k, e in self.reader.entries.items()}

    def read(self, key: str) -> torch.Tensor:
        return self.reader.read(key)


Shapes = dict[str, tuple[torch.dtype, tuple[int, ...]]]  # {on-disk key: (dtype, shape)}


def native_outputs(shapes: Shapes, config, layout: NativeLayout) -> list[Output]:
    """The export's tensors, from the source's {on-disk key: (dtype, shape)}, in the order transformers writes them
    (natural order of the native names).

    In the MoE layers, the router `gate.weight` moves to `layout.block`, and each expert's `gate_up_proj` [2I, H]
    becomes its gate (rows :I) and up (rows I:) projections, `down_proj` its down projection.
    """
    moe_block = re.compile(
        rf"^(?P<layers>{re.escape(config.decoder_layers_path)})\.(?P<layer>\d+)\.{re.escape(config.moe_block_path)}\."
        r"(?P<rest>.+)$"
    )
    moe_layers = set(config.moe_layers)
    outputs = []
    for key, (dtype, shape) in shapes.items():
        match = moe_block.match(key)
        if match is None or int(match["layer"]) not in moe_layers:
            outputs.append(Output(key, key, None, dtype, shape))
            continue
        block = f"{match['layers']}.{match['layer']}.{layout.block}"
        rest = match["rest"]
        expert = re.fullmatch(r"experts\.(\d+)\.(gate_up_proj|down_proj)", rest)
        if rest == "gate.weight":
            outputs.append(Output(f"{block}.gate.weight", key, None, dtype, shape))
        elif expert and expert[2] == "gate_up_proj":
            rows = shape[0] // 2
            for name, span in ((layout.gate, (0, rows)), (layout.up, (rows, 2 * rows))):
                native = f"{block}.experts.{expert[1]}.{name}.weight"
                outputs.append(Output(native, key, span, dtype, (rows, *shape[1:])))
        elif expert:
            outputs.append(Output(f"{block}.experts.{expert[1]}.{layout.down}.weight", key, None, dtype, shape))
        elif layout.shared_expert and rest.startswith(("shared_experts.", "shared_expert_gate.")):
            native = rest.replace("shared_experts.", f"{layout.shared_expert}.", 1)
            outputs.append(Output(f"{block}.{native}", key, None, dtype, shape))
        else:
            raise ValueError(
                f"{key} has no place in the native layout (an exportable MoE block holds only the router weight, "
                "the experts' gate_up_proj and down_proj, and a gated shared expert where the family has one). This "
                "is a bug in hf_moe's export; please report it."
            )
    return sorted(outputs, key=lambda o: _natural(o.key))


def write_weights(source, outputs: list[Output], directory: Path, max_shard_size: int | str) -> None:
    """Write `outputs` from `source` into `directory` as transformers shards them: `model.safetensors`, or
    `model-0000k-of-0000n.safetensors` files of at most `max_shard_size` (a tensor never split) and the index."""
    shards = _shards(outputs, convert_file_size_to_int(max_shard_size))
    layout = {o.key: (o.dtype, o.shape) for o in outputs}
    total = sum(o.nbytes for o in outputs)
    with _ShardWriter(directory, shards, layout) as writer, tqdm(
        total=total, unit="B", unit_scale=True, desc="Writing the native export", leave=False
    ) as bar:
        writer.on_write = bar.update
        for tensor, output in _tensors(source, outputs):
            writer.write(output.key, tensor)
        writer.close()
    if len(shards) > 1:
        weight_map = {key: filename for filename, keys in shards.items() for key in keys}
        parameters = sum(math.prod(o.shape) for o in outputs)
        index = {"metadata": {"total_parameters": parameters, "total_size": total}, "weight_map": weight_map}
        (directory / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _shards(outputs: list[Output], max_bytes: int) -> dict[str, dict[str, None]]:
    """{filename: {key: None}} in order: a new file when the next tensor would take this one past `max_bytes`."""
    groups: list[list[str]] = [[]]
    size = 0
    for output in outputs:
        if groups[-1] and size + output.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(output.key)
        size += output.nbytes
    if len(groups) == 1:
        return {SAFE_WEIGHTS_NAME: dict.fromkeys(groups[0])}
    n = len(groups)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": dict.fromkeys(keys) for i, keys in enumerate(groups)}


def _tensors(source, outputs: list[Output]) -> Iterator[tuple[torch.Tensor, Output]]:
    """(tensor, output) for every output, each source tensor read once (an expert's gate and up come from one)."""
    by_source: dict[str, list[Output]] = {}
    for output in outputs:
        by_source.setdefault(output.source, []).append(output)
    for key, parts in by_source.items():
        tensor = source.read(key)
        for output in parts:
            yield (tensor if output.rows is None else tensor[output.rows[0]:output.rows[1]]), output
        del tensor


def check_written(source, outputs: list[Output], directory: Path) -> list[str]:
    """Read every tensor of the export back from `directory` and compare it with its source, bit for bit (one
    source tensor and one written tensor in memory at a time). Returns the keys that differ."""
    written = _SafetensorsSource(Path(directory))
    wrong = []
    total = sum(o.nbytes for o in outputs)
    with tqdm(total=total, unit="B", unit_scale=True, desc="Reading the export back", leave=False) as bar:
        for tensor, output in _tensors(source, outputs):
            back = written.read(output.key)
            same = back.dtype == tensor.dtype and back.shape == tensor.shape
            if not (same and torch.equal(_bytes(back), _bytes(tensor))):
                wrong.append(output.key)
            bar.update(output.nbytes)
    return wrong


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def parameter_counts(shapes: Shapes, config) -> dict[str, int]:
    """`MoEForCausalLM.parameter_counts()` from a checkpoint's tensor shapes (tied duplicates are not stored)."""
    expert = sum(math.prod(s) for k, (_, s) in shapes.items() if re.search(r"\.experts\.\d+\.", k))
    total = sum(math.prod(s) for _, s in shapes.values())
    k, e = config.num_experts_per_tok, config.num_experts
    return {"total": total, "active": total - expert + expert * k // e, "expert": expert, "experts_per_token": k}


def _natural(key: str):
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split(".")]
