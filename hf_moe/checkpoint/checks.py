"""The checks before load: config, format version, index, every weight file's header against the index and the
checksums, every key and tensor shape against the config, and routers that hold finite numbers.

Each check raises `CheckpointError` (or `FileNotFoundError`) naming the file and what to do. `load.py` runs them in
order (`validate_checkpoint`).
"""

from __future__ import annotations

import math
import numbers
import os
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from ..configuration import _FIELD_TYPES, MoEConfig, _brief, _cut
from ..dense_mlp import find_mlp
from ..ops.int8 import bad_scales, scale_limit
from ..version import __version__
from .format import (
    CHECKPOINT_FORMAT_VERSION, CHECKSUM_ALGORITHMS, EXPERT_KEY, INDEX_NAME, MAX_INDEX_BYTES, SAFETENSORS_DTYPES,
    CheckpointError, expected_expert_keys,
)
from .guard import check_regular, checkpoint_file, read_json, safe_open_file
from .headers import read_header
from .layout import checkpoint_state_dict


def read_index(directory: str | os.PathLike) -> tuple[dict[str, str], dict]:
    """(weight_map, metadata) of the directory's index, checked: a map of tensor names to file names of the
    directory, and a metadata object."""
    directory = Path(directory)
    path = directory / INDEX_NAME
    index = read_json(directory, INDEX_NAME, "the checkpoint", MAX_INDEX_BYTES)
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
    if not os.path.lexists(directory / "config.json"):
        raise FileNotFoundError(
            f"{directory} has no config.json, so it is not a saved model. Save one with model.save_pretrained(), "
            "or convert a dense model with `hf-moe convert SRC OUT`."
        )
    config = read_json(directory, "config.json", "the checkpoint")
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
    check_base_values(directory, config)
    try:
        return MoEConfig.from_dict(config)
    except Exception as err:  # noqa: BLE001 - any value transformers' config classes choke on: name the file
        raise CheckpointError(
            f"{directory}/config.json is invalid: {_cut(str(err), 500) or type(err).__name__}"
        ) from None


# Fields of the base config (any family) that must be sizes: `num_attention_heads: 0` divides by zero when the model is
# built, `vocab_size: "256"` fails deep inside torch.
_SIZES = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings",
)
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")
_SKIPPED = set(_FIELD_TYPES) | {"moe_conversion", "moe_layers", "moe_bypassed_paths"}  # MoEConfig checks these


def check_base_values(directory: Path, config: dict) -> None:
    """The base model's values in config.json make a model that computes numbers: every number finite (in nested
    objects too: `rope_parameters`), epsilons and `rope_theta` positive, dropouts in [0, 1], sizes positive ints,
    token ids ints. `rms_norm_eps: NaN` would load and compute NaN logits, silently. Only what is unsafe or
    meaningless is refused, never what transformers loads: a token id past the vocabulary (GPT-2's default eos is
    50256, a resized vocabulary may be smaller) loads there with a warning, and here too. (MoE fields are
    MoEConfig's to check, with their own messages.)"""

    def bad(name: str, value, what: str) -> CheckpointError:
        return CheckpointError(
            f"{directory}/config.json is invalid: {name}={_brief(value, 60)}, but {what}. Restore config.json from a "
            "good copy (hf_moe writes it at save time)."
        )

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}{key}"
            if not prefix and key in _SKIPPED:
                continue
            if key == "dtype" and value is not None and not isinstance(value, str):  # (transformers splits its name)
                raise bad(name, value, "a dtype is named by a string, such as 'float32'")
            if isinstance(value, dict):
                walk(value, f"{name}.")
            elif isinstance(value, list):
                if any(isinstance(v, float) and not math.isfinite(v) for v in value):
                    raise bad(name, value, "every number of a model's config must be finite")
            elif isinstance(value, numbers.Real) and not isinstance(value, bool):
                if not math.isfinite(value):
                    raise bad(name, value, "every number of a model's config must be finite")
                if (key.endswith(("eps", "epsilon")) or key in ("rope_theta", "factor")) and not value > 0:
                    raise bad(name, value, f"{key} must be positive")
                if "dropout" in key and not 0 <= value <= 1:
                    raise bad(name, value, "a dropout probability is in [0, 1]")
                if key == "partial_rotary_factor" and not 0 < value <= 1:
                    raise bad(name, value, "partial_rotary_factor is in (0, 1]")

    walk(config, "")
    for name in _SIZES:
        value = config.get(name)
        if value is not None and (type(value) is not int or value < 1):
            raise bad(name, value, "it must be a positive int")
    for name in _TOKEN_IDS:  # (past the vocabulary, or -1, transformers loads them with a warning: so does hf_moe)
        value = config.get(name)
        ids = value if isinstance(value, list) else [value]
        if value is None or (isinstance(value, list) and not value):
            continue
        if not all(type(i) is int for i in ids):
            raise bad(name, value, "a token id is an int (or a list of ints, for eos_token_id)")


def check_generation_config(directory: Path) -> None:
    """generation_config.json, which transformers reads with the model, is a file of the directory (not a link out,
    not a FIFO) and a JSON object of bounded size; so is any other file its loader reads."""
    if os.path.lexists(directory / "generation_config.json"):
        read_json(directory, "generation_config.json", "the checkpoint")
    if os.path.lexists(directory / "adapter_config.json"):  # (transformers looks for PEFT adapters beside a model)
        check_regular(directory, "adapter_config.json", "the checkpoint")


def check_files(directory: Path, weight_map: dict[str, str], checksums: dict | None) -> dict[str, dict]:
    """{file: header} of every weight file, after checking that each exists, is well-formed, holds the keys the
    index lists, and (with checksums) has the size and header it was saved with."""
    files = defaultdict(list)
    for key, filename in weight_map.items():
        files[filename].append(key)
    missing_files = sorted(f for f in files if not os.path.exists(directory / f))
    if missing_files:
        raise CheckpointError(
            f"{directory} is incomplete: {len(missing_files)} weight file(s) listed in {INDEX_NAME} are missing: "
            f"{', '.join(missing_files[:8])}{', ...' if len(missing_files) > 8 else ''}. Copy them back, or save "
            "the model again."
        )
    headers = {}
    for filename, keys in files.items():
        header, raw = read_header(directory, filename, INDEX_NAME)
        if checksums is not None:
            record = checksums["files"].get(filename)
            if record is None:
                raise CheckpointError(
                    f"{filename} has no checksum in {INDEX_NAME}: it was added after the save, or the index was "
                    "edited. Save the model again."
                )
            size = os.stat(directory / filename).st_size
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
        _safetensors_reads(directory, filename)
        headers[filename] = header
    return headers


def _safetensors_reads(directory: Path, filename: str) -> None:
    """The safetensors library reads the file's header as hf_moe does (its own parser has the last word: a header
    that passes hf_moe's checks and not its own would fail inside transformers, naming no file)."""
    try:
        with safe_open_file(directory, filename, INDEX_NAME):
            pass
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - safetensors' SafetensorError and its kin
        raise CheckpointError(
            f"{filename} is corrupt: the safetensors reader refuses it ({_cut(str(err), 300)}). Restore it from a "
            "good copy, or save the model again."
        ) from None


def check_expert_keys(directory: Path, config, weight_map: dict[str, str]) -> None:
    """Every expert tensor the config calls for is in the index (counted first: num_experts may be absurd), and the
    config has no more layers than the index has tensors (each would cost memory before the load is refused)."""
    layers = config.get_text_config().num_hidden_layers
    if layers > len(weight_map):
        raise CheckpointError(
            f"{directory} is incomplete or its config.json is wrong: num_hidden_layers={layers}, but {INDEX_NAME} "
            f"lists {len(weight_map)} tensors in all."
        )
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


def check_tensors(
    directory: Path, weight_map: dict[str, str], headers: dict[str, dict], expected: dict, config
) -> None:
    """Every tensor of the backbone that the config calls for is in the checkpoint (a head may be new: a causal-LM
    checkpoint loaded as a classifier), and every tensor the model takes has the shape of the config and a dtype it
    can take. So loading allocates only what the files hold: `num_shared_experts: 5000` with the files of one shared
    expert is refused here, not after gigabytes are allocated."""
    backbone = config.decoder_layers_path.split(".")[0] + "."
    missing = [k for k in expected if k not in weight_map and k.startswith(backbone)]
    if missing:
        shown = ", ".join(_cut(k, 100) for k in missing[:5])
        raise CheckpointError(
            f"{directory} lacks {len(missing)} tensor(s) that its config.json calls for ({shown}"
            f"{', ...' if len(missing) > 5 else ''}): the checkpoint is incomplete, or config.json was changed. "
            "Restore them from a good copy, or save the model again."
        )
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
    keys = [key for key in expected if key.startswith(prefixes) and key in weight_map]
    for filename, key, tensor in _read_tensors(directory, weight_map, keys):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise CheckpointError(
                f"{filename}: the router weights {key} hold {bad} NaN or infinite value(s) of "
                f"{tensor.numel()}. Every token would be routed arbitrarily. Training diverged before this "
                "save, or the file is damaged: load an earlier checkpoint."
            )


def check_int8_scales(directory: Path, weight_map: dict[str, str]) -> None:
    """The scales of int8 experts (`...experts.{e}.<weight>_scale`, `hf_moe.quantize`) and int8 linear layers
    (`<layer>.weight_scale`) are finite, >= 0 and within `scale_limit` of their rows' inputs: a NaN, infinite, negative
    or huge scale computes non-finite or sign-flipped outputs wherever it is used. Scales are small (one per output
    channel or group: 1/H of the int8 weights' bytes, times 4); the inputs per row come from the weights' headers."""
    keys = [key for key in weight_map
            if ((match := EXPERT_KEY.match(key)) and match["name"].endswith("_scale"))
            or (key.endswith(".weight_scale") and key.removesuffix("_scale") in weight_map)]
    headers = {}

    def inputs(key: str) -> int:  # the last dimension of the int8 weight the scales belong to, from its header
        weight = key.removesuffix("_scale")
        filename = weight_map.get(weight)
        if filename is None:  # (a missing weight is named by the checks of keys)
            return 1
        if filename not in headers:
            headers[filename] = read_header(directory, filename, INDEX_NAME)[0]
        return (headers[filename].get(weight, {}).get("shape") or [1])[-1]

    for filename, key, scale in _read_tensors(directory, weight_map, keys):
        in_features = inputs(key)
        bad = bad_scales(scale, in_features) if scale.is_floating_point() else 0
        if bad:
            raise CheckpointError(
                f"{filename}: the int8 scales {key} hold {bad} NaN, infinite, negative or too large value(s) of "
                f"{scale.numel()} (at most {scale_limit(in_features):.3g} for rows of {in_features} inputs): the "
                "layer would compute non-finite or sign-flipped outputs. The file is damaged, or the model was "
                "quantized from non-finite weights: quantize and save it again."
            )


def _read_tensors(directory: Path, weight_map: dict[str, str], keys: list[str]):
    """Yield (file, key, tensor) of the tensors `keys`, one file open at a time, through the guarded opener."""
    by_file = defaultdict(list)
    for key in keys:
        by_file[weight_map[key]].append(key)
    for filename, names in sorted(by_file.items()):
        try:
            with safe_open_file(directory, filename, INDEX_NAME) as f:
                tensors = {key: f.get_tensor(key) for key in names}
        except CheckpointError:
            raise
        except Exception as err:  # noqa: BLE001 - safetensors' own checks: name the file
            raise CheckpointError(f"{filename} is corrupt: {_cut(str(err), 300)}") from None
        for key, tensor in tensors.items():
            yield filename, key, tensor
