"""Where offloaded experts live when they are not in the cache: the checkpoint's files, or host memory.

Both stores answer `read_into(layer, expert, dst)`: fill `dst` ({tensor name: tensor of the expert's shape}) with
expert `expert` of the `layer`-th MoE layer (counted over MoE layers only). They are called from the cache's I/O
thread (disk) or side stream (host -> GPU) as well as from the forward, so they keep no state that a read changes.
"""

from __future__ import annotations

import io
import math
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..checkpoint import (
    CHECKSUM_ALGORITHMS, INDEX_NAME, SAFETENSORS_DTYPES, VERIFY_CHECKSUMS_BY_DEFAULT, CheckpointError, read_index,
    recorded_checksums,
)
from ..checkpoint.guard import open_fd
from ..checkpoint.headers import header_of
from ..layers.quantized import CONFIG_FIELD as QUANTIZATION_FIELD
from ..layers.quantized import check_group_size


@dataclass(frozen=True)
class ExpertLayout:
    """The tensors of one expert, named and shaped as one slice of `Experts`' fused parameters.

    GLU:   gate_up_proj [2I, H], down_proj [H, I];  plain: up_proj [I, H], down_proj [H, I];
    with `expert_bias`: gate_up_proj_bias [2I] / up_proj_bias [I], down_proj_bias [H].
    """

    shapes: dict[str, tuple[int, ...]]
    prefixes: tuple[str, ...]  # on-disk key prefix of each MoE layer's experts: "model.layers.3.mlp.experts"
    num_experts: int
    top_k: int
    glu: bool
    bias: bool
    activation: str
    # Tensors whose dtype is fixed whatever the model's: int8 experts' weights (int8) and scales (fp32), saved by
    # hf_moe.quantize.save_quantized (config `expert_quantization`). Empty for floating-point experts.
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    group_size: int | None = None  # int8 scales per group of this many inputs (None: per output channel)

    @classmethod
    def from_config(cls, config) -> ExpertLayout:
        h, i = config.hidden_size, config.moe_intermediate_size
        up = "gate_up_proj" if config.expert_glu else "up_proj"
        rows = 2 * i if config.expert_glu else i
        shapes = {up: (rows, h), "down_proj": (h, i)}
        dtypes, group = {}, None
        quantization = getattr(config, QUANTIZATION_FIELD, None)
        if quantization is not None:
            if not isinstance(quantization, dict) or quantization.get("quant_method") != "int8":
                raise CheckpointError(f"config.json's {QUANTIZATION_FIELD}={quantization!r} is not one hf_moe "
                                      "offloads (int8); load the model without offload_experts.")
            group = quantization.get("group_size")
            try:
                check_group_size(group, h, i)
            except ValueError as err:
                raise CheckpointError(f"config.json's {QUANTIZATION_FIELD} is invalid: {err}") from None
            for name, (out, k) in list(shapes.items()):
                shapes[f"{name}_scale"] = (out,) if group is None else (out, k // group)
                dtypes.update({name: torch.int8, f"{name}_scale": torch.float32})
        if config.expert_bias:
            shapes.update({f"{up}_bias": (rows,), "down_proj_bias": (h,)})
        # The same key layout as checkpoint.expected_expert_keys.
        prefixes = tuple(
            f"{config.decoder_layers_path}.{layer}.{config.moe_block_path}.experts" for layer in config.moe_layers
        )
        return cls(
            shapes, prefixes, config.num_experts, config.num_experts_per_tok, config.expert_glu, config.expert_bias,
            config.expert_hidden_act, dtypes, group,
        )

    def dtype_of(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype tensor `name` has in a model of floating dtype `dtype`."""
        return self.dtypes.get(name, dtype)

    @property
    def num_layers(self) -> int:
        return len(self.prefixes)

    def expert_numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes.values())

    def expert_bytes(self, dtype: torch.dtype) -> int:
        return sum(math.prod(shape) * self.dtype_of(name, dtype).itemsize for name, shape in self.shapes.items())

    def key(self, layer: int, expert: int, name: str) -> str:
        return f"{self.prefixes[layer]}.{expert}.{name}"


@dataclass(frozen=True)
class _Span:
    fd: int
    filename: str
    offset: int  # absolute, in bytes
    nbytes: int
    dtype: torch.dtype


class DiskExperts:
    """Experts left in the checkpoint's per-expert safetensors files, read on demand with positioned reads.

    Every expert file is opened once, through the guarded opener, and kept open: a save that replaces the directory
    meanwhile does not change what this store reads. Every expert tensor's header entry is checked when the store
    opens (known float dtype, the shape the config implies, a byte range that matches it and lies inside the file),
    so a read never trusts the file further. Each tensor is hashed at its first read and compared with the checksum
    recorded at save time (`verify_checksums`, as in `validate_checkpoint`; one hash per tensor, of the bytes just
    read: no extra I/O); every read checks that its file still has the size, modification time and inode change time
    it had at load, so a file overwritten in place is an error, never wrong logits. `pread` copies through the page
    cache into the destination: no mapping of the files stays resident in this process (a mapping's touched pages
    would count in its RSS). Read-ahead is off on these descriptors (POSIX_FADV_RANDOM): a read takes the expert's
    bytes only. The kernel's window would read on into experts the router did not pick, and under a memory limit
    smaller than the model (the case offloading is for) those pages are evicted before any use, so every expert read
    cost several times its bytes (benchmarks/offload.py --memory-limit; docs/offload.md).
    """

    def __init__(self, directory: str | os.PathLike, layout: ExpertLayout, verify_checksums: bool | None = None):
        directory = Path(directory)
        self.directory, self.layout = str(directory), layout
        weight_map, metadata = read_index(directory)
        checksums = recorded_checksums(metadata)
        if verify_checksums is None:
            verify_checksums = VERIFY_CHECKSUMS_BY_DEFAULT and checksums is not None
        if verify_checksums and checksums is None:
            raise CheckpointError(
                f"{directory} records no checksums (saved by an older hf_moe, or by another tool), so its experts "
                "cannot be verified. Load it with verify_checksums=False and save it again with this hf_moe."
            )
        self._hash = CHECKSUM_ALGORITHMS[checksums["algorithm"]] if verify_checksums else None
        self._digests: dict[tuple[int, int, str], str] = {}
        self._verified: set[tuple[int, int, str]] = set()
        self._fds: dict[str, int] = {}
        self._stats: dict[str, tuple[int, int, int, int]] = {}  # filename -> `_identity` when opened
        self._finalizer = weakref.finalize(self, _close_all, self._fds)
        headers: dict[str, tuple[dict, int]] = {}
        self._spans: dict[tuple[int, int, str], _Span] = {}
        for layer in range(layout.num_layers):
            for expert in range(layout.num_experts):
                for name, shape in layout.shapes.items():
                    key = layout.key(layer, expert, name)
                    filename = weight_map.get(key)
                    if filename is None:
                        raise CheckpointError(f"{directory / INDEX_NAME} does not list {key}: save the model again.")
                    if filename not in headers:
                        fd = self._fds[filename] = open_fd(directory, filename, INDEX_NAME)
                        with io.FileIO(fd, "rb", closefd=False) as f:
                            header, raw = header_of(f, filename)  # checks the file holds every byte it declares
                        info = os.fstat(fd)
                        self._stats[filename] = _identity(info)
                        if hasattr(os, "posix_fadvise"):  # after the header: no read-ahead on this descriptor
                            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                        headers[filename] = (header, len(raw))
                    header, data_start = headers[filename]
                    self._spans[layer, expert, name] = _check_entry(
                        filename, self._fds[filename], key, header.get(key), shape, data_start, layout.dtypes.get(name)
                    )
                    if self._hash is not None:
                        self._digests[layer, expert, name] = _recorded_digest(checksums, filename, key)

    def dtype(self) -> torch.dtype:
        """The floating dtype the experts are stored in (the first expert's; float32 when every tensor of an expert
        has a fixed dtype, as int8 experts without biases)."""
        return next((span.dtype for (_, _, name), span in self._spans.items() if name not in self.layout.dtypes),
                    torch.float32)

    def read_into(self, layer: int, expert: int, dst: dict[str, torch.Tensor]) -> int:
        """Fill `dst` with the expert's tensors (converting dtype if they differ). Returns the bytes read."""
        total = 0
        for name, out in dst.items():
            span = self._spans[layer, expert, name]
            direct = out.dtype == span.dtype and out.device.type == "cpu" and out.is_contiguous()
            buffer = out if direct else torch.empty(out.shape, dtype=span.dtype)
            raw = memoryview(buffer.view(-1).view(torch.uint8).numpy())
            key = self.layout.key(layer, expert, name)
            self._pread(span, raw, key)
            self._check_unchanged(span.filename)
            if self._hash is not None and (layer, expert, name) not in self._verified:
                if self._hash(raw).hexdigest() != self._digests[layer, expert, name]:
                    raise CheckpointError(
                        f"{span.filename} is corrupt: the bytes of {key} differ from the checksum recorded when it "
                        "was saved (found on its first read by the offloaded experts). Restore the file from a good "
                        "copy, or save the model again; `hf-moe verify DIR` lists every damaged tensor."
                    )
                self._verified.add((layer, expert, name))
            if not direct:
                out.copy_(buffer)
            total += span.nbytes
        return total

    def _check_unchanged(self, filename: str) -> None:
        now, then = _identity(os.fstat(self._fds[filename])), self._stats[filename]
        if now[3] != then[3] and now[:2] == then[:2]:  # linked or unlinked (a save replaced the directory): that
            self._stats[filename] = then = (*then[:2], *now[2:])  # sets the inode's change time, not its data
        if now != then:
            raise CheckpointError(
                f"{filename} changed on disk after the model was loaded (its size, modification time or inode change "
                "time differs): it was overwritten in place while this model read experts from it (a modification "
                "time put back, as `cp -p` does, still changes the inode's), so they can no longer be trusted. "
                "Reload the model once the file is complete. (save_pretrained never writes over a loaded "
                "checkpoint's files: it replaces the directory, and loaded models keep reading the old files.)"
            )

    def _pread(self, span: _Span, view: memoryview, key: str) -> None:
        done = 0
        while done < span.nbytes:
            got = os.preadv(span.fd, [view[done:]], span.offset + done)
            if got == 0:
                raise CheckpointError(
                    f"{span.filename} ended while reading {key}: the file was truncated or replaced after the model "
                    "was loaded. Restore it (or save the model again) and reload."
                )
            done += got

    def close(self) -> None:
        self._finalizer()


def _identity(info: os.stat_result) -> tuple[int, int, int, int]:
    """What a write in place changes: the size, the modification time, and the inode's change time, which every write
    (and every `utime` that puts a modification time back) sets to now; and the link count, whose change (a save that
    replaced the directory unlinks the old files) sets the change time too. (The file's descriptor pins the inode: a
    file replaced by a rename is not this one, and the store reads on from the one it opened.)"""
    return info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_nlink


def _recorded_digest(checksums: dict, filename: str, key: str) -> str:
    digest = checksums["files"].get(filename, {}).get("tensors", {}).get(key)
    if digest is None:
        raise CheckpointError(
            f"{INDEX_NAME} records no checksum for {key} in {filename}: the file or the index was changed after the "
            "save. Save the model again (or load with verify_checksums=False)."
        )
    return digest


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()


def _check_entry(filename: str, fd: int, key: str, meta, shape: tuple[int, ...], data_start: int,
                 fixed: torch.dtype | None = None) -> _Span:
    """The byte range of one expert tensor, after checking its header entry against what the config implies
    (`fixed`: the dtype it must have, for int8 experts' weights and scales; else any floating-point dtype)."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{filename} is corrupt or from another model: {key} {what}. Save the model again.")

    if not isinstance(meta, dict):
        raise bad("is not in its header")
    dtype = SAFETENSORS_DTYPES.get(meta.get("dtype"))
    if fixed is not None and dtype != fixed:
        raise bad(f"has dtype {meta.get('dtype')!r}, but config.json's {QUANTIZATION_FIELD} makes it {fixed}")
    if dtype is None or not (dtype.is_floating_point or dtype == fixed):
        raise bad(f"has dtype {meta.get('dtype')!r}, not a floating-point type")
    if list(meta.get("shape", ())) != list(shape):
        raise bad(f"has shape {meta.get('shape')}, but the config implies {list(shape)}")
    offsets = meta.get("data_offsets")
    if (
        not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] or offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize
    ):
        raise bad(f"has data_offsets {offsets}, which do not span {math.prod(shape)} {meta['dtype']} values")
    # header_of checked that the file holds every declared byte.
    return _Span(fd, filename, data_start + offsets[0], offsets[1] - offsets[0], dtype)


class HostExperts:
    """Every expert in host memory (pinned when the cache is on a GPU), copied to the device cache on demand: the
    "cpu" tier. tensors[name] is [L, E, *shape]; filled once from the files, with progress."""

    def __init__(self, disk: DiskExperts, dtype: torch.dtype, pin: bool):
        layout = self.layout = disk.layout
        self.directory = disk.directory
        self.tensors = {
            name: torch.empty((layout.num_layers, layout.num_experts, *shape), dtype=layout.dtype_of(name, dtype),
                              pin_memory=pin)
            for name, shape in layout.shapes.items()
        }
        keys = [(layer, e) for layer in range(layout.num_layers) for e in range(layout.num_experts)]
        for layer, e in tqdm(keys, desc="Loading experts into host memory", unit="expert", leave=False):
            disk.read_into(layer, e, {name: t[layer, e] for name, t in self.tensors.items()})

    def dtype(self) -> torch.dtype:
        return next((t.dtype for n, t in self.tensors.items() if n not in self.layout.dtypes), torch.float32)

    def read_into(self, layer: int, expert: int, dst: dict[str, torch.Tensor]) -> int:
        total = 0
        for name, out in dst.items():
            src = self.tensors[name][layer, expert]
            out.copy_(src, non_blocking=True)  # asynchronous from pinned memory on the cache's side stream
            total += src.numel() * src.element_size()
        return total

    def close(self) -> None:
        pass
