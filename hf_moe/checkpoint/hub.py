"""A checkpoint named by its Hub id (`"org/name"`) is checked like any directory: the id is resolved to its snapshot
in the Hugging Face cache first, as transformers resolves it (`revision`, `cache_dir`, `local_files_only`, `token`,
`force_download`, `subfolder`; `HF_HUB_OFFLINE`), and the checks before load, the load itself and every command run
on that directory. Online, what the cache lacks of the checkpoint is downloaded first (its config files, index,
safetensors files and tokenizer files); offline, the cached snapshot is used as it is.

    models--org--name/refs/main              the commit the branch names
    models--org--name/snapshots/<commit>/    the checkpoint: each file a link into blobs/ (guard.py allows these)
    models--org--name/blobs/<hash>           the files' bytes
"""

from __future__ import annotations

import os
from pathlib import Path

from .format import CONFIG_FILES, INDEX_NAME, TOKENIZER_FILES, CheckpointError

# from_pretrained's keyword arguments that say where a Hub id's files are.
HUB_KWARGS = ("revision", "cache_dir", "local_files_only", "token", "force_download", "subfolder")


def is_hub_id(name_or_path) -> bool:
    """Whether `name_or_path` names a Hub repository rather than a local directory: not a directory here, and a valid
    repository id (`org/name` or `name`), as transformers decides."""
    path = os.fspath(name_or_path)
    if os.path.isdir(path):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def resolve_checkpoint(name_or_path, *, revision=None, cache_dir=None, local_files_only: bool = False, token=None,
                       force_download: bool = False, subfolder: str | None = None, **_) -> str:
    """The local directory of a checkpoint named by a path or a Hub id: a path as it is; a Hub id as its snapshot in
    the cache (the repository's root: `subfolder` is inside it), downloading what the cache lacks unless offline.

    Raises `FileNotFoundError` for an id that is not cached while offline, the Hub's own errors (repository or
    revision not found, gated) online, and `CheckpointError` for a cache whose ref names no snapshot of the
    repository."""
    path = os.fspath(name_or_path)
    if not is_hub_id(path):
        return path
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    prefix = f"{subfolder.strip('/')}/" if subfolder else ""
    patterns = [f"{prefix}{name}" for name in (*CONFIG_FILES, INDEX_NAME, "*.safetensors", *TOKENIZER_FILES)]
    offline = bool(local_files_only) or constants.is_offline_mode()
    try:
        snapshot = snapshot_download(
            path, revision=revision, cache_dir=cache_dir, local_files_only=offline, token=token,
            force_download=force_download, allow_patterns=patterns,
        )
    except IncompleteSnapshotError:
        raise
    except LocalEntryNotFoundError:
        where = cache_dir or constants.HF_HUB_CACHE
        raise FileNotFoundError(
            f"{path!r} is not a local directory, and the Hugging Face cache ({where}) holds no snapshot of it "
            f"(revision {revision or 'main'}); downloads are off (HF_HUB_OFFLINE or local_files_only). Download it "
            f"first (`hf download {path}`), or give the path of the checkpoint's directory."
        ) from None
    repository = Path(cache_dir or constants.HF_HUB_CACHE).expanduser().resolve() / f"models--{path.replace('/', '--')}"
    real = Path(os.path.realpath(snapshot))
    if real.parent != repository / "snapshots":
        raise CheckpointError(
            f"The Hugging Face cache's entry for {path!r} (revision {revision or 'main'}) names {real}, which is not a "
            f"snapshot of {repository}: the cache's refs are damaged. Remove {repository} and download it again."
        )
    return str(real)
