"""Streaming conversion: a dense safetensors checkpoint on disk -> an MoE checkpoint on disk, tensor by tensor.

`convert_checkpoint` never holds the model: it reads one tensor (or one MLP) at a time from the source files
and writes it at its place in the output files, whose headers are laid out before any data is written. Peak
memory is the Python/torch baseline plus one MLP and the MoE block made from it (E expert copies for upcycling,
the MLP's own size for splitting), whatever the size of the model. The output is the same directory,
byte for byte in its tensors, that `convert_to_moe(...).save_pretrained(...)` writes: same keys, same files,
same index, same config and model card.

What the in-memory path checks on the whole model (logits against the dense model), streaming checks per layer:
every MoE block is run on a random probe against the dense MLP it replaces (`max_abs_block_diff`).
"""

from __future__ import annotations

import copy
import json
import math
import os
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig


from ..compat import convert_file_size_to_int
from ..checkpoint import (
    SAFETENSORS_DTYPES,
    CheckpointError,
    checkpoint_state_dict,
    fused_key,
    read_index,
    read_json,
    resolve_output_directory,
    same_directory,
    split_experts,
    staging_directory,
)
from ..checkpoint.guard import checkpoint_file, open_fd
from ..checkpoint.headers import read_header
from ..checkpoint.layout import plan_shards
from ..checkpoint.save import finish
from ..configuration import MoEConfig
from ..dense_mlp import DenseMLP, NoMLPFoundError, extract_mlp, find_decoder_layers, find_mlp
from ..modeling import MoEForCausalLM
from ..ops.extension import load_extension
from .estimate import check_disk, estimate_conversion
from .api import (
    _check_model_type,
    _dtype,
    _expert_sizes,
    _license,
    _select_layers,
    convert_block,
    moe_fields,
    progress_text,
    resolve_options,
)

_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


class StreamingUnsupported(ValueError):
    """This source or these options need the whole model in memory; use `convert_to_moe` instead."""


def convert_checkpoint(
    src: str | os.PathLike,
    out: str | os.PathLike,
    num_experts: int,
    top_k: int,
    method: str = "upcycle",
    layers: list[int] | None = None,
    *,
    max_shard_size: int | str = "5GB",
    progress: bool = True,
    extra=None,
    **options,
) -> MoEForCausalLM:
    """Convert the dense safetensors checkpoint in directory `src` into an MoE checkpoint in `out`, streaming.

    Takes the arguments and options of `convert_to_moe`, except `partition="coactivation"` (it runs the model
    on calibration text) and `tokenizer`. Atomic like `save_pretrained`: `out` appears only when complete;
    `extra(staging)`, if given, writes more files into it before that (`hf-moe convert` copies the tokenizer).

    Returns:
        The MoE model on the meta device (config, parameter counts; no weights), for reporting.
    Raises:
        StreamingUnsupported: when the source cannot be streamed (no safetensors, tensor names that differ from
            the model's, options that need the model); `convert_to_moe` handles those.
    """
    plan = plan_conversion(src, out, num_experts, top_k, method, layers, max_shard_size, options)
    write_conversion(plan, progress, extra)
    return plan.moe


@dataclass
class ConversionPlan:
    """What a streaming conversion writes and where each tensor comes from, decided and checked before anything is
    written (`plan_conversion`); `write_conversion` carries it out.

    `layout` {key: (dtype, shape)} is every output tensor; `copied` the keys read from the source (`names[key]` in
    `source`), cast to their layout dtype; every other key is a tensor of an MoE block, made from the dense MLP of
    decoder layer i (`moe_layers`) and written under `block_prefix[i]`. The first layer's MLP and block are already
    made (`first`: they fix the expert shape, so the config); the others are made in order with `generator`.
    """

    source: _SafetensorsSource
    names: dict[str, str]  # model key -> checkpoint key
    base_config: Any
    config: Any  # the MoEConfig
    moe: MoEForCausalLM  # on the meta device: what `finish` saves the config, card and index of
    method: str
    opts: dict[str, Any]
    num_experts: int
    working_dtype: torch.dtype
    layers_path: str
    decoder_layers: Any  # the dense model's decoder layers, on the meta device
    spec: Any  # where the MLP sits in a decoder layer (`dense_mlp.find_mlp`)
    moe_layers: list[int]
    block_prefix: dict[int, str]
    layout: dict[str, tuple[torch.dtype, torch.Size]]
    copied: list[str]
    shards: dict[str, dict[str, Any]]  # file name -> its tensors (`checkpoint.layout.plan_shards`)
    target: Path
    generator: torch.Generator
    first: tuple[DenseMLP, nn.Module] | None  # the first MoE layer's MLP and block; None once written


def plan_conversion(src, out, num_experts: int, top_k: int, method: str, layers: list[int] | None,
                    max_shard_size: int | str, options: dict) -> ConversionPlan:
    """Every check of a streaming conversion that needs no output written: options, source, disk space, the
    output's tensors and files. Reads the source's headers and its first converted MLP."""
    opts = resolve_options(num_experts, top_k, method, layers, options)
    if method == "split" and opts["partition"] == "coactivation":
        raise StreamingUnsupported("partition='coactivation' runs the whole model on calibration text.")
    src = Path(src)
    if same_directory(src, out):
        raise ValueError(
            f"The output directory {out} is the source {src}: the conversion would replace the dense model it reads. "
            "Choose another output directory."
        )
    source = _SafetensorsSource(src)
    base_config = AutoConfig.from_pretrained(src)
    _check_model_type(base_config, str(src))

    dtype = _dtype(opts["dtype"])
    working_dtype = dtype or source.float_dtype()
    with torch.device("meta"):
        dense = AutoModelForCausalLM.from_config(base_config, dtype=working_dtype)
    layers_path, decoder_layers = find_decoder_layers(dense)
    moe_layers = _select_layers(layers, opts["every"], len(decoder_layers))
    spec = find_mlp(decoder_layers[moe_layers[0]])
    names = source.match(dense)

    # The first MLP fixes the expert shape (and so the config); the others must match it.
    first = _read_mlp(
        source, names, decoder_layers[moe_layers[0]], spec, layers_path, moe_layers[0], working_dtype, base_config
    )
    check_disk(out, estimate_conversion(  # before anything grows with the number of experts (estimate.py)
        sum(p.numel() for p in dense.parameters()) * working_dtype.itemsize, first,
        _expert_sizes(method, first, num_experts, opts["num_shared_experts"]), num_experts, len(moe_layers),
        opts["num_shared_experts"], working_dtype.itemsize, convert_file_size_to_int(max_shard_size)))
    config = MoEConfig.from_base(base_config, **moe_fields(
        num_experts, top_k, method, opts, moe_layers, first, layers_path, spec, source=str(src), license=_license(src),
    ))
    generator = torch.Generator().manual_seed(opts["seed"])
    first_block = convert_block(method, first, config, opts, None, generator, share_identical=True)
    with torch.device("meta"):  # from_dense converts in place: a second meta model, `dense` keeps its MLPs
        dense = AutoModelForCausalLM.from_config(base_config, dtype=working_dtype)
        moe = MoEForCausalLM.from_dense(dense, config, None)
    if os.path.lexists(src / "generation_config.json"):  # (read through the guarded opener: not a link out of src)
        moe.generation_config = GenerationConfig.from_dict(read_json(src, "generation_config.json", "the source"))

    # The output layout: save_pretrained's files and keys; dtypes of the source (cast as asked) and of the block.
    block_prefix = {i: f"{layers_path}.{i}.{config.moe_block_path}." for i in moe_layers}
    block_dtypes = {k: t.dtype for k, t in first_block.state_dict().items()}
    keep_fp32 = set(getattr(dense, "_keep_in_fp32_modules", None) or ()) | set(
        getattr(dense, "_keep_in_fp32_modules_strict", None) or ()
    )
    layout: dict[str, tuple[torch.dtype, torch.Size]] = {}
    copied: list[str] = []
    for key, meta in checkpoint_state_dict(moe).items():
        owner = next((i for i, p in block_prefix.items() if key.startswith(p)), None)
        if owner is not None:  # (a block's `bias` may share its name with the dense MLP's: it is the block's)
            layout[key] = (block_dtypes[fused_key(key)[len(block_prefix[owner]) :]], meta.shape)
        elif key in names:
            src_dtype, shape = source.dtype_shape(names[key])
            source.check(names[key], meta.dtype, meta.shape)
            layout[key] = (_cast_dtype(key, src_dtype, dtype, keep_fp32), shape)
            copied.append(key)
        else:
            raise StreamingUnsupported(f"the model has a tensor {key!r} that the checkpoint does not hold.")

    shards = plan_shards({k: torch.empty(s, dtype=d, device="meta") for k, (d, s) in layout.items()},
                         convert_file_size_to_int(max_shard_size))
    target = resolve_output_directory(out, "Cannot write the MoE checkpoint to")
    return ConversionPlan(source, names, base_config, config, moe, method, opts, num_experts, working_dtype,
                          layers_path, decoder_layers, spec, moe_layers, block_prefix, layout, copied, shards, target,
                          generator, (first, first_block))


def write_conversion(plan: ConversionPlan, progress: bool = True, extra=None) -> None:
    """Write `plan`'s checkpoint: the copied tensors, then each MoE layer's block (its MLP read, converted, probed
    against the MLP where `verify` is on), then config, card and index (`checkpoint.save.finish`); atomic."""
    opts, source = plan.opts, plan.source
    if opts["verify"]:
        load_extension()  # a first-use compile happens here, not inside the progress bar (whose ETA it would skew)
    total = sum(math.prod(s) * d.itemsize for d, s in plan.layout.values())
    first_kind = plan.first[0].kind
    with staging_directory(plan.target) as staging, _ShardWriter(staging, plan.shards, plan.layout) as writer:
        with tqdm(total=total, unit="B", unit_scale=True, desc="Streaming conversion", disable=not progress) as bar:
            writer.on_write = bar.update
            for key in plan.copied:
                writer.write(key, source.read(plan.names[key]).to(plan.layout[key][0]))
            worst = scale = 0.0
            pending, plan.first = plan.first, None  # the first layer is already converted
            for i in tqdm(plan.moe_layers, desc=progress_text(plan.method, len(plan.moe_layers), plan.num_experts),
                          leave=False, disable=not progress):
                if pending is not None:
                    (mlp, block), pending = pending, None
                else:
                    mlp = _read_mlp(source, plan.names, plan.decoder_layers[i], plan.spec, plan.layers_path, i,
                                    plan.working_dtype, plan.base_config)
                    _check_same_kind(first_kind, mlp, i)
                    block = convert_block(plan.method, mlp, plan.config, opts, None, plan.generator,
                                          share_identical=True)
                if opts["verify"]:
                    gap, size = _block_gap(mlp, block)
                    worst, scale = max(worst, gap), max(scale, size)
                prefix = plan.block_prefix[i]
                writer.write_many(split_experts({prefix + k: t for k, t in block.state_dict().items()}, block, prefix))
                del mlp, block
        writer.close()
        if opts["verify"]:
            plan.config.moe_conversion.update(
                max_abs_block_diff=worst,
                max_abs_mlp_output=scale,
                probe=f"per MoE layer: 16 random hidden states through the dense MLP and the MoE block, "
                f"{str(plan.working_dtype).removeprefix('torch.')}, eval mode",
            )
        finish(plan.moe, staging, plan.target, [writer.weight_map], extra)


def _cast_dtype(key: str, src: torch.dtype, dtype: torch.dtype | None, keep_fp32: set[str]) -> torch.dtype:
    """The dtype a copied tensor is written in: `dtype` for floating tensors, except modules kept in fp32."""
    if dtype is None or not src.is_floating_point:
        return src
    if src == torch.float32 and keep_fp32 and set(key.split(".")) & keep_fp32:
        return src
    return dtype


def _read_mlp(source, names, meta_layer, spec, layers_path, index, dtype, base_config) -> DenseMLP:
    """The MLP of decoder layer `index` alone, its parameters allocated and read (the rest of the layer stays on
    meta)."""
    layer = copy.deepcopy(meta_layer)
    owners = [layer.get_submodule(spec.module_path)] if spec.module_path else [
        getattr(layer, p) for p in (spec.up, spec.gate, spec.down) if p
    ]
    prefix = f"{layers_path}.{index}."
    for owner in owners:
        owner.to_empty(device="cpu")
        owner_path = next(n for n, m in layer.named_modules() if m is owner)
        state = {}
        for name, tensor in owner.state_dict().items():
            key = f"{prefix}{owner_path}.{name}"
            if key not in names:
                raise StreamingUnsupported(f"the checkpoint has no tensor for {key!r}.")
            source.check(names[key], tensor.dtype, tensor.shape)
            state[name] = source.read(names[key]).to(dtype if tensor.is_floating_point() else tensor.dtype)
        owner.load_state_dict(state, strict=True, assign=True)
    return extract_mlp(layer, spec, base_config)


def _check_same_kind(first: tuple, mlp: DenseMLP, index: int) -> None:
    a, b = first, mlp.kind
    if a != b:
        raise NoMLPFoundError(
            f"Layer {index}'s MLP {b} differs from the first converted layer's {a}; convert layers of one kind at "
            "a time with `layers=[...]`."
        )


@torch.no_grad()
def _block_gap(mlp: DenseMLP, block: nn.Module) -> tuple[float, float]:
    """(max |block(x) - mlp(x)|, max |mlp(x)|) on 16 random hidden states x ~ N(0, 1), in eval mode. The second
    gives the first its scale: on unnormalised random inputs a real MLP's outputs can be in the hundreds."""
    from ..dense_mlp import expert_forward

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, mlp.hidden_size, generator=generator).to(mlp.up.dtype)
    block.eval()
    expected = expert_forward(mlp, x).float()
    return (block(x).float() - expected).abs().max().item(), expected.abs().max().item()


# --------------------------------------------------------------------------------------------------------------
# Reading and writing safetensors without mapping whole files
# --------------------------------------------------------------------------------------------------------------
@dataclass
class _Entry:
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


class _SafetensorsSource:
    """The tensors of a local safetensors checkpoint (one file or an index), read one at a time with `pread`
    into fresh memory: reading a tensor costs its size, not a mapping of the file that stays resident. Every file
    name the index gives is checked to stay inside the directory, and every header before use."""

    def __init__(self, directory: Path):
        if not directory.is_dir():
            raise FileNotFoundError(f"No model at {str(directory)!r}: the directory does not exist.")
        if not os.path.lexists(directory / "config.json"):
            raise FileNotFoundError(f"{directory} has no config.json: it is not a saved Hugging Face model.")
        read_json(directory, "config.json", "the source")  # a link out, a FIFO, a bomb: refused before transformers
        index = directory / "model.safetensors.index.json"
        if os.path.lexists(index):
            files = sorted(set(read_index(directory)[0].values()))
        elif os.path.lexists(directory / "model.safetensors"):
            files = ["model.safetensors"]
        else:
            raise StreamingUnsupported(f"{directory} holds no safetensors weights (model.safetensors or an index).")
        self.directory = directory
        self.entries: dict[str, _Entry] = {}
        for name in files:
            if not os.path.exists(directory / name):
                checkpoint_file(directory, name, str(index))  # (a link out is named as one, not as missing)
                raise FileNotFoundError(f"{index} lists {name}, which is missing: re-download or re-save the model.")
            header, raw = read_header(directory, name, str(index))
            path = directory / name
            for key, meta in header.items():
                if key == "__metadata__":
                    continue
                begin, end = meta["data_offsets"]
                dtype = SAFETENSORS_DTYPES[meta["dtype"]]
                self.entries[key] = _Entry(path, dtype, tuple(meta["shape"]), len(raw) + begin, end - begin)

    def float_dtype(self) -> torch.dtype:
        """The dtype most of the checkpoint's floating-point bytes are in."""
        sizes: dict[torch.dtype, int] = {}
        for e in self.entries.values():
            if e.dtype.is_floating_point:
                sizes[e.dtype] = sizes.get(e.dtype, 0) + e.nbytes
        return max(sizes, key=sizes.get) if sizes else torch.float32

    def dtype_shape(self, key: str) -> tuple[torch.dtype, torch.Size]:
        e = self.entries[key]
        return e.dtype, torch.Size(e.shape)

    def check(self, key: str, dtype: torch.dtype, shape: torch.Size) -> None:
        """`key` has the shape the config gives the model's tensor, and a dtype of the same kind (floating or not):
        a transposed or reshaped tensor, or integers where weights belong, would convert into a model that does not
        load, or loads wrong."""
        e = self.entries[key]
        if torch.Size(e.shape) != shape:
            raise CheckpointError(
                f"{e.path.name} stores {key} with shape {list(e.shape)}, but the source's config.json makes it "
                f"{list(shape)}: the file is corrupt or belongs to another model. Nothing was converted."
            )
        if e.dtype.is_floating_point != dtype.is_floating_point or e.dtype.is_complex != dtype.is_complex:
            raise CheckpointError(
                f"{e.path.name} stores {key} as {_NAMES.get(e.dtype, e.dtype)}, but the model holds it as "
                f"{str(dtype).removeprefix('torch.')}: the file is corrupt. Nothing was converted."
            )

    def match(self, model: nn.Module) -> dict[str, str]:
        """{model key: checkpoint key} for the model's state dict, with the base-model prefix added or removed
        where the checkpoint was saved without (or with) it. Tied copies may be absent."""
        prefix = getattr(model, "base_model_prefix", "") or ""
        tied = set(getattr(model, "_tied_weights_keys", None) or ())
        names: dict[str, str] = {}
        for key in model.state_dict():
            candidates = [key]
            if prefix and key.startswith(prefix + "."):
                candidates.append(key[len(prefix) + 1 :])
            elif prefix:
                candidates.append(f"{prefix}.{key}")
            found = next((c for c in candidates if c in self.entries), None)
            if found is not None:
                names[key] = found
            elif key not in tied:
                raise StreamingUnsupported(
                    f"the checkpoint names its tensors differently from {type(model).__name__} (no {key!r})."
                )
        return names

    def read(self, key: str) -> torch.Tensor:
        e = self.entries[key]
        buffer = torch.empty(e.nbytes, dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        fd = open_fd(self.directory, e.path.name, "the source")
        try:
            done = 0
            while done < e.nbytes:
                got = os.preadv(fd, [view[done:]], e.start + done)
                if got == 0:
                    raise OSError(f"{e.path.name} ended while reading {key}: the file is truncated.")
                done += got
        finally:
            os.close(fd)
        return buffer.view(e.dtype).reshape(e.shape)


def max_open_files() -> int:
    """How many output files the writer keeps open at once: an eighth of the soft descriptor limit, 2 to 64, so
    that thousands of expert files convert under `ulimit -n 64`."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        soft = 4096 if soft == resource.RLIM_INFINITY else soft
    except (ImportError, ValueError, OSError):  # not POSIX
        soft = 256
    return max(2, min(64, soft // 8))


class _ShardWriter:
    """Output files whose headers are written first; each tensor is then written at its offset, in any order.

    At most `max_open` files are open at a time (the least recently used is closed to open another), so a model
    with thousands of expert files converts under a low descriptor limit. A context manager: leaving it closes
    every file.
    """

    def __init__(self, directory: Path, shards: dict[str, dict[str, Any]], layout: dict, max_open: int | None = None):
        self.directory = directory
        self.max_open = max_open or max_open_files()
        self.open_files: OrderedDict[str, int] = OrderedDict()  # filename -> fd, least recently used first
        self.offsets: dict[str, dict[str, tuple[int, int]]] = {}  # filename -> {key: (start, n)}
        self.file_of: dict[str, str] = {}
        self.pending: set[str] = set()
        self.on_write = lambda n: None
        self.shards, self.layout = shards, layout

    def __enter__(self):
        try:
            self._lay_out()
        except BaseException:  # (`with` calls __exit__ only once __enter__ has returned)
            self.abort()
            raise
        return self

    def _lay_out(self) -> None:
        """Create every file with its header, at its final size."""
        for filename, tensors in self.shards.items():
            header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
            offsets, offset = {}, 0
            for key in tensors:  # plan_shards gives them in natural order
                dtype, shape = self.layout[key]
                nbytes = math.prod(shape) * dtype.itemsize
                header[key] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
                offsets[key] = (offset, nbytes)
                offset += nbytes
                self.file_of[key] = filename
            blob = json.dumps(header, separators=(",", ":")).encode()
            blob += b" " * (-len(blob) % 8)
            fd = self._fd(filename, create=True)
            os.write(fd, struct.pack("<Q", len(blob)) + blob)
            os.ftruncate(fd, 8 + len(blob) + offset)
            base = 8 + len(blob)
            self.offsets[filename] = {k: (base + s, n) for k, (s, n) in offsets.items()}
            self.pending.update(tensors)
        self.weight_map = dict(self.file_of)

    def __exit__(self, *exc) -> None:
        self.abort()

    def _fd(self, filename: str, create: bool = False) -> int:
        """An open descriptor of `filename` (read and write: `copy_file_range` reads), opening it if needed."""
        fd = self.open_files.get(filename)
        if fd is not None:
            self.open_files.move_to_end(filename)
            return fd
        while len(self.open_files) >= self.max_open:
            os.close(self.open_files.popitem(last=False)[1])
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | (os.O_CREAT | os.O_TRUNC if create else 0)
        fd = self.open_files[filename] = os.open(self.directory / filename, flags, 0o644)
        return fd

    def write(self, key: str, tensor: torch.Tensor) -> tuple[str, int]:
        """Write `tensor` at its place; returns (file, offset) where its bytes now are."""
        filename = self.file_of[key]
        start, nbytes = self.offsets[filename][key]
        data = memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        if len(data) != nbytes:
            raise AssertionError(f"{key}: {len(data)} bytes instead of the {nbytes} planned")
        fd = self._fd(filename)
        done = 0
        while done < nbytes:
            done += os.pwrite(fd, data[done:], start + done)
        self._written(key, nbytes)
        return filename, start

    def read(self, key: str) -> torch.Tensor:
        """The tensor already written under `key`, read back from its file (a merge runs its gates on what it wrote)."""
        if key in self.pending:
            raise KeyError(f"{key} has not been written yet")
        filename = self.file_of[key]
        start, nbytes = self.offsets[filename][key]
        dtype, shape = self.layout[key]
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        view, fd, done = memoryview(buffer.numpy()), self._fd(filename), 0
        while done < nbytes:
            done += os.preadv(fd, [view[done:]], start + done)
        return buffer.view(dtype).reshape(shape)

    def write_many(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write several tensors; those that are views of the same memory (the identical experts of an upcycled
        block) are written once and then copied file to file by the kernel (`copy_file_range`, as `cp` does),
        without passing through this process again."""
        first_copy: dict[tuple[int, int], tuple[str, int]] = {}
        for key, tensor in tensors.items():
            same = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
            if tensor.is_contiguous() and same in first_copy and self._copy(key, *first_copy[same]):
                continue
            first_copy[same] = self.write(key, tensor)

    def _copy(self, key: str, src_file: str, src_start: int) -> bool:
        """Copy `key`'s bytes from where they were already written; False if the kernel cannot."""
        filename = self.file_of[key]
        start, nbytes = self.offsets[filename][key]
        src_fd = self._fd(src_file)
        fd = self._fd(filename)  # opening it cannot close src_fd: that one was just used
        done = 0
        try:
            while done < nbytes:
                copied = os.copy_file_range(src_fd, fd, nbytes - done, src_start + done, start + done)
                if copied == 0:
                    return False
                done += copied
        except (AttributeError, OSError):  # not Linux, or not across these files: write it instead
            return False
        self._written(key, nbytes)
        return True

    def _written(self, key: str, nbytes: int) -> None:
        self.pending.discard(key)
        self.on_write(nbytes)

    def close(self) -> None:
        if self.pending:
            raise AssertionError(
                f"{len(self.pending)} planned tensors were never written, e.g. {sorted(self.pending)[:3]}"
            )
        self.abort()

    def abort(self) -> None:
        while self.open_files:
            os.close(self.open_files.popitem()[1])
