"""The on-disk format: file and key names, dtypes, limits, the checksum algorithms, and what older checkpoints' `auto_map` shim is.

Layout of a saved directory:

    config.json, generation_config.json, README.md (model card)   (older saves: also modeling_hf_moe.py, the shim)
    model-00001-of-0000N.safetensors              every non-expert tensor (embeddings, attention, routers, ...)
    model-expert-00000.safetensors                expert 0 of every MoE layer
    ...
    model-expert-000{E-1}.safetensors             (an expert's file is split as model-expert-00003-00001-of-00002
                                                   past `max_shard_size`)
    model.safetensors.index.json                  the standard index: every key -> its file; its `metadata` holds
                                                  a content hash of every file (`checksums`, see checksums.py)

In memory, an MoE layer's experts are fused 3-D parameters (`...mlp.experts.gate_up_proj` [E, 2I, H]). On
disk each expert has its own keys: `...mlp.experts.{e}.gate_up_proj` [2I, H]. Nothing depends on how many
processes wrote or will read the files. Loading goes through transformers' `from_pretrained`, with a weight
conversion (registered by `hf_moe.auto`) that stacks the per-expert tensors back.
"""

from __future__ import annotations

import hashlib
import re

import torch
import xxhash

from ..configuration import CHECKPOINT_FORMAT_VERSION

INDEX_NAME = "model.safetensors.index.json"
EXPERT_FILE_PREFIX = "model-expert-"
EXPERT_PARAM_NAMES = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")
EXPERT_KEY = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<name>\w+)$")

# The dtypes of the safetensors format that torch has.
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "C64": torch.complex64,
}
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on the JSON header
# Limits of the guarded opener (guard.py). A file past them is refused before it is parsed: no file hf_moe writes comes
# near them (an index is ~200 bytes per tensor: 64 MB is 300k tensors, 4x Kimi-K2's expert tensors with biases).
MAX_INDEX_BYTES = 64 << 20  # model.safetensors.index.json
MAX_CONFIG_BYTES = 16 << 20  # config.json, generation_config.json, training_state.json and the like
MAX_FILE_BYTES = 1 << 30  # other small files read whole: tokenizer files, the model card, the auto_map shim
# JSON is parsed only if it holds at most this many values (counted as `,` `[` `{` bytes: an upper bound) and nests at
# most this deep: each value costs Python at most ~72 bytes, so no file may take more than ~150 MB to parse.
MAX_JSON_VALUES = 2_000_000
MAX_JSON_DEPTH = 32
CHECKSUM_ALGORITHMS = {"xxh3_128": xxhash.xxh3_128, "blake2b": hashlib.blake2b, "sha256": hashlib.sha256}
CHECKSUM_ALGORITHM = "xxh3_128"  # the fastest of those hashes (benchmarks/checksums.py; docs/checkpoints.md)
# Whether `from_pretrained` hashes the data of a checkpoint that records checksums, unless told otherwise (the
# sizes and headers are always checked). See benchmarks/checksums.py for the measured cost.
VERIFY_CHECKSUMS_BY_DEFAULT = True


# `auto_map`: checkpoints saved by older hf_moe carry it, naming a shim module written into the checkpoint that imports
# the installed hf_moe package, so that `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` loaded them
# in a process that never imported hf_moe. hf_moe no longer writes it: transformers' AutoTokenizer reads config.json
# through AutoConfig, which asks "Do you wish to run the custom code? [y/N]" about any `auto_map["AutoConfig"]` unless
# trust_remote_code is given, so a process loading only the tokenizer was asked; and without AutoConfig's entry the
# model's entries are never read (AutoConfig fails first). Such checkpoints still load, and still carry the shim.
AUTO_MAP_MODULE = "modeling_hf_moe"
AUTO_MAP = {
    "AutoConfig": f"{AUTO_MAP_MODULE}.MoEConfig",
    "AutoModelForCausalLM": f"{AUTO_MAP_MODULE}.MoEForCausalLM",
    "AutoModelForSequenceClassification": f"{AUTO_MAP_MODULE}.MoEForSequenceClassification",
    "AutoModelForTokenClassification": f"{AUTO_MAP_MODULE}.MoEForTokenClassification",
}
AUTO_MAP_SHIM = '''"""Loads this hf_moe checkpoint with the installed hf_moe package (`pip install hf-moe`).

Written by hf_moe into every checkpoint it saves, so that
`AutoModelForCausalLM.from_pretrained(this_dir, trust_remote_code=True)` works in a process that never imported
hf_moe. It holds no model code: importing hf_moe registers the `hf_moe` model type with transformers.
"""

from hf_moe import MoEConfig, MoEForCausalLM, MoEForSequenceClassification, MoEForTokenClassification

__all__ = ["MoEConfig", "MoEForCausalLM", "MoEForSequenceClassification", "MoEForTokenClassification"]
'''

# A config field that a process without hf_moe reads instead of the config. There, AutoTokenizer falls back to a plain
# `PreTrainedConfig` for the model type it does not know, and that warns "You are using a model of type hf_moe to
# instantiate a model of type ``" unless a dict in the config has the plain config's model type (""), as a composite
# model's sub-config would; this one is that dict, and says what the model needs. hf_moe's config ignores it.
PACKAGE_FIELD = "hf_moe_package"
PACKAGE_NOTE = {"model_type": "", "install": "pip install hf-moe", "load": "import hf_moe before loading the model"}

# A model's tokenizer files (copied byte for byte by `hf-moe convert` and export; read by `hf-moe generate`).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "spiece.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json",
)

# The files besides the weights that decide what a checkpoint computes (the shim decides which code loads it): their
# checksums are recorded at save time too (checksums.py), and a change is a changed checkpoint.
CONFIG_FILES = ("config.json", "generation_config.json", f"{AUTO_MAP_MODULE}.py")


class CheckpointError(ValueError):
    """A saved MoE checkpoint is incomplete, corrupt, or from an unsupported version."""


class CheckpointBusyError(CheckpointError):
    """A checkpoint was replaced by a save while it was being read: nothing is wrong with it; read it again."""


def fused_key(key: str) -> str:
    """The in-memory name of an on-disk key: `...experts.3.up_proj` -> `...experts.up_proj`; others unchanged."""
    match = EXPERT_KEY.match(key)
    return f"{match['prefix']}.{match['name']}" if match else key


def expected_expert_keys(config) -> dict[str, int]:
    """{on-disk key: expert index} of every expert tensor the config calls for."""
    names = ["gate_up_proj" if config.expert_glu else "up_proj", "down_proj"]
    if config.expert_bias:
        names += [f"{n}_bias" for n in names]
    keys = {}
    for layer in config.moe_layers:
        prefix = f"{config.decoder_layers_path}.{layer}.{config.moe_block_path}.experts"
        for e in range(config.num_experts):
            keys.update({f"{prefix}.{e}.{name}": e for name in names})
    return keys


def is_weight_file(name: str) -> bool:
    """Whether a file name is one of the weight files a save replaces (ours, or transformers' own names)."""
    return name.endswith((".safetensors", ".safetensors.index.json")) or re.fullmatch(
        r"pytorch_model.*\.bin(\.index\.json)?", name
    ) is not None


def natural_key(key: str):
    """Sort key putting `layers.10` after `layers.9`."""
    return [int(part) if part.isdigit() else part for part in key.split(".")]
