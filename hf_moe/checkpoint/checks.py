"""The checks before load: config, format version, index, every weight file's header against the index and the
checksums, every key and tensor shape against the config, and routers that hold finite numbers.

Each check raises `CheckpointError` (or `FileNotFoundError`) naming the file and what to do. `load.py` runs them in
order (`validate_checkpoint`).
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from ..configuration import MoEConfig, _brief, _cut
from ..convert.adapters import find_mlp
from ..version import __version__
from .format import (
    CHECKPOINT_FORMAT_VERSION, CHECKSUM_ALGORITHMS, INDEX_NAME, SAFETENSORS_DTYPES, CheckpointError, expected_expert_keys,
)
from .guard import checkpoint_file, read_json
from .headers import read_header
from .layout import checkpoint_state_dict


def read_index(directory: str | os.PathLike) -> tuple[dict[str, str], dict]:
    """(weight_map, metadata) of the directory's index, checked: a map of tensor names to file names of the
    directory, and a metadata object."""
    directory = Path(directory)
    path = checkpoint_file(directory, INDEX_NAME, "the index")
    index = read_json(path)
    weight_map, metadata = index.get("weight_map"), index.get("metadata", {})
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f"{path} is corrupt: its weight_map is {type(weight_map).__name__}, not an object mapping tensor names "
            "to files. Save the model again."
        )
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path} is corrupt: its metadata is {type(metadata).__name__}, not an object.")
    names = set()
    for key, name in weight_map.items():
        if not isinstance(name, str) or name not in names:
            checkpoint_file(directory, name, f"{INDEX_NAME} (for {_brief(key)})")
            names.add(name)
    return weight_map, metadata


def read_config(directory: Path) -> dict:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{directory} has no config.json, so it is not a saved model. Save one with model.save_pretrained(), "
            "or convert a dense model with `hf-moe convert SRC OUT`."
        )
    config = read_json(checkpoint_file(directory, "config.json", "the checkpoint"))
    model_type = config.get("model_type")
    if model_type != "hf_moe":
        raise CheckpointError(
            f"{directory} holds a dense `{_cut(str(model_type), 60)}` model, not an hf_moe one. Convert it first: "
            f"`hf_moe.convert_to_moe({str(directory)!r}, num_experts=8, top_k=2)` or `hf-moe convert`."
        )
    fmt = config.get("hf_moe_format")
    if type(fmt) is not int or not 1 <= fmt <= CHECKPOINT_FORMAT_VERSION:
        if type(fmt) is int and fmt > CHECKPOINT_FORMAT_VERSION:
            raise CheckpointError(
                f"{directory} was written with checkpoint format {fmt}, which hf_moe {__version__} cannot read "
                f"(it reads format 1 to {CHECKPOINT_FORMAT_VERSION}). Upgrade hf_moe: `pip install -U hf-moe`."
            )
        raise CheckpointError(
            f"{directory}/config.json has hf_moe_format={_brief(fmt)}, not a format number (1 to "
            f"{CHECKPOINT_FORMAT_VERSION}): the file is damaged, or was not written by hf_moe {__version__}."
        )
    return config


def checkpoint_config(directory: str | os.PathLike):
    """The MoEConfig of a saved checkpoint's config.json, read from inside the directory and checked (format,
    model type, every value), without reading any weight."""
    directory = Path(directory)
    return read_moe_config(directory, read_config(directory))


def read_moe_config(directory: Path, config: dict):
    """The MoEConfig of config.json, or a `CheckpointError` that says which value is wrong."""
    try:
        return MoEConfig.from_dict(config)
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as err:
        raise CheckpointError(f"{directory}/config.json is invalid: {_cut(str(err), 500)}") from None


def check_files(directory: Path, weight_map: dict[str, str], checksums: dict | None) -> dict[str, dict]:
    """{file: header} of every weight file, after checking that each exists, is well-formed, holds the keys the
    index lists, and (with checksums) has the size and header it was saved with."""
    files = defaultdict(list)
    for key, filename in weight_map.items():
        files[filename].append(key)
    missing_files = sorted(f for f in files if not (directory / f).is_file())
    if missing_files:
        raise CheckpointError(
            f"{directory} is incomplete: {len(missing_files)} weight file(s) listed in {INDEX_NAME} are missing: "
            f"{', '.join(missing_files[:8])}{', ...' if len(missing_files) > 8 else ''}. Copy them back, or save "
            "the model again."
        )
    headers = {}
    for filename, keys in files.items():
        header, raw = read_header(checkpoint_file(directory, filename, INDEX_NAME))
        if checksums is not None:
            record = checksums["files"].get(filename)
            if record is None:
                raise CheckpointError(
                    f"{filename} has no checksum in {INDEX_NAME}: it was added after the save, or the index was "
                    "edited. Save the model again."
                )
            size = (directory / filename).stat().st_size
            if size != record["size"]:
                raise CheckpointError(
                    f"{filename} is corrupt: it is {size} bytes, but {record['size']} were saved. Restore it from a "
                    "good copy, or save the model again."
                )
            if CHECKSUM_ALGORITHMS[checksums["algorithm"]](raw).hexdigest() != record["header"]:
                raise CheckpointError(
                    f"{filename} is corrupt: its header (tensor names, dtypes, shapes, offsets) differs from the one "
                    "saved. Restore it from a good copy, or save the model again."
                )
        absent = [k for k in keys if k not in header]
        if absent:
            raise CheckpointError(
                f"{filename} is corrupt or was replaced: it lacks {len(absent)} tensor(s) the index lists, e.g. "
                f"{_brief(absent[0])}. Save the model again."
            )
        headers[filename] = header
    return headers


def check_expert_keys(directory: Path, config, weight_map: dict[str, str]) -> None:
    per_expert = 2 * (2 if config.expert_bias else 1)
    needed = len(config.moe_layers) * config.num_experts * per_expert
    if needed > len(weight_map):  # without listing them: num_experts may be absurd
        raise CheckpointError(
            f"{directory} is incomplete or its config.json is wrong: num_experts={config.num_experts} in "
            f"{len(config.moe_layers)} MoE layer(s) makes {needed} expert tensors, but {INDEX_NAME} lists "
            f"{len(weight_map)} tensors in all."
        )
    expected = expected_expert_keys(config)
    missing = [k for k in expected if k not in weight_map]
    if missing:
        experts = sorted({expected[k] for k in missing})
        names = ", ".join(f"model-expert-{e:05d}*.safetensors" for e in experts[:8])
        shown = f"{experts[:16]}{' ...' if len(experts) > 16 else ''}"
        raise CheckpointError(
            f"{directory} is incomplete: {len(missing)} expert tensor(s) are missing (e.g. {missing[0]}), from "
            f"{len(experts)} expert(s) {shown} — expected in {names}{', ...' if len(experts) > 8 else ''}. Save the "
            "model again."
        )


def _config_dtype(config) -> torch.dtype | None:
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def expected_tensors(config, model_class=None) -> dict[str, tuple[torch.dtype, torch.Size]]:
    """{on-disk key: (dtype, shape)} of every tensor a model of `config` saves, from the model built on the meta
    device (no memory): an instance of `model_class` (an hf_moe model class, which the loader passes), else the
    causal LM that transformers' Auto registry gives for the config."""
    build = AutoModelForCausalLM.from_config if model_class is None else model_class._from_config
    with torch.device("meta"):
        model = build(config, dtype=_config_dtype(config) or torch.float32)
    return {k: (t.dtype, t.shape) for k, t in checkpoint_state_dict(model).items()}


def _dtype_fits(stored: torch.dtype, expected: torch.dtype) -> bool:
    """A stored dtype the loader may take for `expected`: the same, or a floating dtype of another width (cast on
    load). Same width but another dtype (F32 as I32, BF16 as F16) reinterprets the bytes: never."""
    if stored == expected:
        return True
    return stored.is_floating_point and expected.is_floating_point and stored.itemsize != expected.itemsize


def check_tensors(weight_map: dict[str, str], headers: dict[str, dict], expected: dict, config) -> None:
    """Every tensor the model takes has the shape of the config and a dtype it can take."""
    for key, filename in weight_map.items():
        if key not in expected:
            continue
        meta = headers[filename][key]
        dtype, shape = SAFETENSORS_DTYPES[meta["dtype"]], torch.Size(meta["shape"])
        want_dtype, want_shape = expected[key]
        if shape != want_shape:
            raise CheckpointError(
                f"{filename} is corrupt or belongs to another model: it stores {key} with shape {list(shape)}, but "
                f"config.json makes it {list(want_shape)}. Restore the file from a good copy, or save the model again."
            )
        if not _dtype_fits(dtype, want_dtype):
            raise CheckpointError(
                f"{filename} is corrupt: it stores {key} as {meta['dtype']}, but the model holds it as "
                f"{str(want_dtype).removeprefix('torch.')} (config.json dtype: "
                f"{_cut(str(getattr(config, 'dtype', None)).removeprefix('torch.'), 40)}); "
                "reading those bytes as the other type would give wrong values. Restore the file, or save again."
            )


def check_block_paths(directory: Path, config) -> None:
    """`moe_bypassed_paths` turn parts of each MoE layer into identities: only those that the dense MLP is made of
    (as the converter finds it), never a norm or an attention block."""
    if not config.moe_bypassed_paths:
        return
    try:
        with torch.device("meta"):
            dense = AutoModelForCausalLM.from_config(config.to_base_config())
        spec = find_mlp(dense.get_submodule(config.decoder_layers_path)[config.moe_layers[0]])
        expected = (spec.block_path, list(spec.bypassed_paths))
    except Exception as err:  # noqa: BLE001 - any failure here means the paths cannot be trusted
        expected = ("?", [f"none found ({type(err).__name__})"])
    if (config.moe_block_path, config.moe_bypassed_paths) != expected:
        raise CheckpointError(
            f"{directory}/config.json is invalid: moe_block_path={_brief(config.moe_block_path)} and "
            f"moe_bypassed_paths={_brief(config.moe_bypassed_paths)} would replace parts of each MoE layer with "
            f"identities, but the dense {config.base_model_type} MLP is at {expected[0]!r} with inline parts "
            f"{expected[1]}. Restore config.json (hf_moe writes these fields itself)."
        )


def check_routers(directory: Path, weight_map: dict[str, str], expected: dict, config) -> None:
    """The routers' tensors (small: E x H per layer) hold only finite numbers: a NaN router routes every token
    arbitrarily, and the model would load and run without a word."""
    prefixes = tuple(f"{config.decoder_layers_path}.{i}.{config.moe_block_path}.gate." for i in config.moe_layers)
    by_file = defaultdict(list)
    for key in expected:
        if key.startswith(prefixes) and key in weight_map:
            by_file[weight_map[key]].append(key)
    for filename, keys in sorted(by_file.items()):
        try:
            with safe_open(directory / filename, framework="pt") as f:
                tensors = {key: f.get_tensor(key) for key in keys}
        except Exception as err:  # noqa: BLE001 - safetensors' own checks: name the file
            raise CheckpointError(f"{filename} is corrupt: {_cut(str(err), 300)}") from None
        for key, tensor in tensors.items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                bad = int((~torch.isfinite(tensor)).sum())
                raise CheckpointError(
                    f"{filename}: the router weights {key} hold {bad} NaN or infinite value(s) of "
                    f"{tensor.numel()}. Every token would be routed arbitrarily. Training diverged before this "
                    "save, or the file is damaged: load an earlier checkpoint."
                )
