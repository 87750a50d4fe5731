"""Loading: `validate_checkpoint` (every check of checks.py, in order), the expert-parallel and offloaded views of a
directory, and `load_checkpoint` into an existing model (Trainer resume)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

import torch

from ..configuration import _cut
from ..layers.adapter_experts import checkpoint_expectations
from ..layers.quantized import CONFIG_FIELD as QUANTIZATION_FIELD
from .checks import (
    check_block_paths, check_expert_keys, check_files, check_generation_config, check_int8_scales, check_routers,
    check_tensors, expected_tensors, read_config, read_index, read_moe_config,
)
from .checksums import config_changed_error, config_problems, recorded_checksums, verify_data
from .commit import recover_interrupted_commit
from .format import CONFIG_FILES, EXPERT_KEY, INDEX_NAME, TOKENIZER_FILES, CheckpointError
from .guard import checkpoint_file, copy_files, load_safetensors
from .headers import read_header
from .layout import checkpoint_state_dict
from .save import is_sharded
from .snapshot import reading


def validate_checkpoint(
    directory: str | os.PathLike, *, verify_checksums: bool | None = False, model_class=None
) -> None:
    """Check a saved MoE directory before loading it: config (format version, every value), index, every file's
    name, size, header and header checksum, every key, every tensor's dtype and shape against the config, the config
    files against their checksums, and that the routers hold finite numbers. Every file is read through the guarded
    opener (guard.py). Restores a model that a killed save left hidden.

    verify_checksums: also hash every file's data and compare with the checksums recorded at save time. None: do
        so when the checkpoint records checksums and `VERIFY_CHECKSUMS_BY_DEFAULT`; True: required (an error if
        none are recorded); False: not.
    model_class: the hf_moe model class the checkpoint is about to be loaded into (its tensors are the expected
        ones); default: the causal LM of the config.
    Raises `CheckpointError` (or `FileNotFoundError`) naming the missing or corrupt file and what to do.
    """
    directory = Path(directory)
    recover_interrupted_commit(directory)
    config = read_config(directory)
    if config.get(QUANTIZATION_FIELD) is not None:
        raise CheckpointError(
            f"{directory} holds int8 experts (config.json's {QUANTIZATION_FIELD}): load it with "
            f"`hf_moe.load_quantized({str(directory)!r})`, or with offload_experts='disk' or 'cpu'."
        )
    if os.path.lexists(directory / INDEX_NAME):
        weight_map, metadata = read_index(directory)
        checksums = recorded_checksums(metadata)
    elif os.path.lexists(directory / "model.safetensors"):
        header = read_header(directory, "model.safetensors", "the checkpoint")[0]
        weight_map, checksums = dict.fromkeys((k for k in header if k != "__metadata__"), "model.safetensors"), None
    else:
        raise FileNotFoundError(f"{directory} has a config but no weights ({INDEX_NAME} or model.safetensors).")

    headers = check_files(directory, weight_map, checksums)
    moe_config = read_moe_config(directory, config)
    adapters = moe_config.adapter_experts is not None  # (only what was trained is saved; the rest is the base's)
    if not adapters:
        check_expert_keys(directory, moe_config, weight_map)
    try:
        expected = expected_tensors(moe_config, model_class)
    except Exception as err:  # noqa: BLE001 - ZeroDivisionError, AssertionError, ImportError ...: name the file
        raise CheckpointError(
            f"{directory}/config.json describes no model that can be built here ({type(err).__name__}: "
            f"{_cut(str(err), 400)}). Restore it from a good copy."
        ) from None
    if adapters:
        expected = checkpoint_expectations(expected, weight_map, moe_config)
    check_tensors(directory, weight_map, headers, expected, moe_config)
    check_block_paths(directory, moe_config)
    check_generation_config(directory)
    problems = config_problems(directory, checksums)
    if problems:
        raise config_changed_error(directory, problems)
    verify_data(directory, checksums, sorted(set(weight_map.values())), verify_checksums)
    check_routers(directory, weight_map, expected, moe_config)  # (after: damage is named as damage, not as NaN)


def validate_files(directory: str | os.PathLike, *, verify_checksums: bool | None = False) -> None:
    """The checks of `validate_checkpoint` that build no model from the config, for a checkpoint whose tensors the
    config's model does not hold (int8 experts, `hf_moe.quantize`; their caller checks those tensors): restores a
    model that a killed save left hidden; the config's format; the index; every weight file's name, size, header
    and header checksum; the config files against their checksums; as `verify_checksums` says (see
    `validate_checkpoint`), every file's data; and that int8 experts' scales are finite and >= 0. Raises
    `CheckpointError` (or `FileNotFoundError`)."""
    directory = Path(directory)
    recover_interrupted_commit(directory)
    read_config(directory)
    weight_map, metadata = read_index(directory)
    checksums = recorded_checksums(metadata)
    check_files(directory, weight_map, checksums)
    check_generation_config(directory)
    problems = config_problems(directory, checksums)
    if problems:
        raise config_changed_error(directory, problems)
    verify_data(directory, checksums, sorted(set(weight_map.values())), verify_checksums)
    check_int8_scales(directory, weight_map)  # (after: damage is named as damage, not as NaN)


@contextlib.contextmanager
def local_expert_view(directory: str | os.PathLike, start: int, end: int, verify_checksums: bool | None = False):
    """A temporary directory that looks like `directory` but lists only the non-expert tensors and experts
    [start, end): the config files are copied (through the guarded opener), weight files linked, and the index
    filtered. Loading from it reads nothing of the other experts. `verify_checksums` (see `validate_checkpoint`)
    hashes only the files linked, so each rank of an expert-parallel load verifies what it reads."""
    directory = Path(directory).absolute()
    weight_map, metadata = read_index(directory)
    keep = {}
    for key, filename in weight_map.items():
        match = EXPERT_KEY.match(key)
        if match is None or start <= int(match["expert"]) < end:
            keep[key] = filename
    verify_data(directory, recorded_checksums(metadata), sorted(set(keep.values())), verify_checksums)
    with tempfile.TemporaryDirectory(prefix="hf_moe-view-") as tmp:
        view = Path(tmp)
        _, refused = copy_files(directory, CONFIG_FILES, view, "the checkpoint")
        if refused:
            raise CheckpointError(refused[0])
        for name in sorted(set(keep.values())):  # (checked by validate_checkpoint; transformers opens them)
            os.symlink(checkpoint_file(directory, name, INDEX_NAME), view / name)
        (view / INDEX_NAME).write_text(json.dumps({"metadata": metadata, "weight_map": keep}))
        yield str(view)


def missing_keys_error(directory, missing_keys) -> CheckpointError:
    """The error for tensors the model needs that the checkpoint does not have."""
    shown = ", ".join(sorted(missing_keys)[:5])
    return CheckpointError(
        f"{directory} lacks {len(missing_keys)} tensor(s) the model needs ({shown}"
        f"{', ...' if len(missing_keys) > 5 else ''}); they are normally in the model-0000*-of-*.safetensors "
        "files. The checkpoint is incomplete or from another model: save it again."
    )


def load_checkpoint(model, directory: str | os.PathLike, strict: bool = True):
    """Load a per-expert checkpoint into `model` in place, one file at a time.

    Returns torch's `_IncompatibleKeys(missing_keys, unexpected_keys)` in on-disk key names; with `strict`, raises
    instead when either is non-empty. (A plain `transformers.Trainer` resumes the same way, file by file through
    `load_state_dict` and the experts' per-expert-key hook, but reports the keys by their in-memory names.) A
    sharded model (DTensor parameters) is refused: see the error.
    """
    directory = Path(directory)
    if is_sharded(model, None):
        raise CheckpointError(
            f"Cannot load {directory} into a sharded model (DTensor parameters, from hf_moe.parallelize or "
            "expert_parallel) tensor by tensor. Load it with MoEForCausalLM.from_pretrained(path, "
            "expert_parallel=True) (each process reads its own experts) and call hf_moe.parallelize; to resume "
            "training, use hf_moe.MoETrainer, whose checkpoints hold a resharding DCP training state."
        )
    with reading(directory):  # a save into it waits (snapshot.py)
        validate_checkpoint(directory, verify_checksums=None)
        weight_map, _ = read_index(directory)
        expected = set(checkpoint_state_dict(model))
        missing = sorted(expected - set(weight_map))
        unexpected = sorted(set(weight_map) - expected)
        if strict and (missing or unexpected):
            raise CheckpointError(
                f"{directory} does not match {type(model).__name__}: {len(missing)} missing tensor(s) "
                f"{missing[:3]}, {len(unexpected)} unexpected {unexpected[:3]}."
            )
        for filename in sorted(set(weight_map.values())):
            model.load_state_dict(load_safetensors(directory, filename, INDEX_NAME), strict=False)
    return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)


def load_tokenizer(directory: str | os.PathLike):
    """The tokenizer saved in `directory`, read through the guarded opener: its files (and config.json, which
    transformers consults for the tokenizer class) are copied to a temporary directory that transformers loads from,
    so a link out of the checkpoint, a FIFO or an oversized file is refused, not read."""
    from transformers import AutoTokenizer

    directory = Path(directory)
    with tempfile.TemporaryDirectory(prefix="hf_moe-tokenizer-") as tmp:
        copied, refused = copy_files(directory, ("config.json", *TOKENIZER_FILES), tmp, "the checkpoint")
        if refused:
            raise CheckpointError(refused[0])
        if not set(copied) & set(TOKENIZER_FILES):
            raise FileNotFoundError(
                f"{directory} has no tokenizer (none of {', '.join(TOKENIZER_FILES[:3])}, ...). Save one beside the "
                "model: tokenizer.save_pretrained(DIR) (`hf-moe convert` copies the base model's)."
            )
        return AutoTokenizer.from_pretrained(tmp)
