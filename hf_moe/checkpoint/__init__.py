"""Per-expert safetensors checkpoints: the format, the one guarded opener, checks, checksums, atomic commit, save,
load and verify. Each module does one of these; this package re-exports what the rest of hf_moe and its users call.

    format.py      file and key names, dtypes, limits, the note to processes without hf_moe, `CheckpointError`
    guard.py       the one way a file of a checkpoint is opened (inside the directory, a regular file, bounded)
    headers.py     safetensors headers, read and checked
    checksums.py   per-file and per-tensor hashes (and of the config files), recorded at save and checked at load
    hub.py         a checkpoint named by its Hub id, resolved to its snapshot in the Hugging Face cache
    layout.py      fused expert parameters <-> per-expert keys, and shards planned by size
    snapshot.py    readers see the old or the new checkpoint: a save's swap waits for loads in progress
    commit.py      staging, locks, the atomic swap, recovery from killed writers
    save.py        `save_checkpoint`
    checks.py      the checks before load
    load.py        `validate_checkpoint` (`validate_files`: its checks that need no model), the views of a directory
                   for expert-parallel and offloaded loads, `load_checkpoint`
    verify.py      `verify_checkpoint` (`hf-moe verify`), `record_config_files` (`hf-moe verify --update`)
    adapter_experts.py  an adapter-experts checkpoint (LoRA or PESC experts): the block on a dense MLP, its base
                   found and checked, the checkpoint loaded onto it (imported where used, not re-exported)
    fingerprint.py the fingerprint of an adapter-experts model's base, and what its save writes
"""

from .checks import checkpoint_config, expected_tensors, read_index
from .checksums import config_checksums, file_checksums, recorded_checksums
from .commit import (
    clean_stale_staging, recover_interrupted_commit, resolve_output_directory, same_directory, staging_directory,
)
from .format import (
    CHECKPOINT_FORMAT_VERSION, CHECKSUM_ALGORITHM, CHECKSUM_ALGORITHMS, CONFIG_FILES, EXPERT_FILE_PREFIX, EXPERT_KEY,
    EXPERT_PARAM_NAMES, INDEX_NAME, SAFETENSORS_DTYPES, TOKENIZER_FILES, VERIFY_CHECKSUMS_BY_DEFAULT,
    CheckpointBusyError, CheckpointError, expected_expert_keys, fused_key,
)
from .guard import checkpoint_file, copy_files, open_file, read_bytes, read_json, stays_inside
from .headers import read_safetensors_header
from .hub import HUB_KWARGS, is_hub_id, resolve_checkpoint
from .layout import checkpoint_state_dict, split_experts
from .load import (
    load_checkpoint, load_tokenizer, local_expert_view, missing_keys_error, validate_checkpoint, validate_files,
)
from .save import save_checkpoint
from .snapshot import reading
from .verify import VerifyReport, record_config_files, verify_checkpoint

__all__ = [
    "CHECKPOINT_FORMAT_VERSION", "CHECKSUM_ALGORITHM", "CHECKSUM_ALGORITHMS", "CONFIG_FILES", "EXPERT_FILE_PREFIX",
    "EXPERT_KEY", "EXPERT_PARAM_NAMES", "HUB_KWARGS", "INDEX_NAME", "SAFETENSORS_DTYPES", "TOKENIZER_FILES",
    "VERIFY_CHECKSUMS_BY_DEFAULT", "CheckpointBusyError", "CheckpointError", "VerifyReport", "checkpoint_config",
    "checkpoint_file", "checkpoint_state_dict", "clean_stale_staging", "config_checksums", "copy_files",
    "expected_expert_keys", "expected_tensors", "file_checksums", "fused_key", "is_hub_id", "load_checkpoint",
    "load_tokenizer", "local_expert_view", "missing_keys_error", "open_file", "read_bytes", "read_index", "read_json",
    "read_safetensors_header", "reading", "record_config_files", "recorded_checksums", "recover_interrupted_commit",
    "resolve_checkpoint", "resolve_output_directory", "same_directory", "save_checkpoint", "split_experts",
    "staging_directory", "stays_inside", "validate_checkpoint", "validate_files", "verify_checkpoint",
]
