"""Where the compiled extension's builds live: once per user and machine, wherever a cache can.

The first usable directory of:
  1. `$HF_MOE_CACHE`;
  2. `$XDG_CACHE_HOME/hf_moe`;
  3. `~/.cache/hf_moe`;
  4. `<temp dir>/hf_moe-<uid>`: a per-user directory in the shared temp dir (a service user whose `$HOME` is missing
     or read-only), used only while it is a real directory (not a link) owned by this user with mode 0700, as it is
     made when absent, so that no other user can plant a library in it.
Usable means that a file can be created in it. When none is, there is no cache: the caller runs without the
extension rather than rebuild it in every process.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from pathlib import Path


class NoBuildCache(RuntimeError):
    """No directory can hold the extension's build."""


def cache_root() -> Path:
    """The cache directory (see the module docstring). Says on stderr why a directory named by an environment
    variable was passed over. Raises `NoBuildCache` when no candidate is usable."""
    passed_over = []
    for path, variable, shared in _candidates():
        problem = (shared and _private_problem(path)) or _writable_problem(path)
        if problem is None:
            for name, skipped, why in passed_over:
                print(f"hf_moe: {name}={skipped} {why}; caching the C++ extension in {path} instead",
                      file=sys.stderr)
            return path
        passed_over.append((variable, path, problem))
    reasons = "; ".join(f"{path} {problem}" for _, path, problem in passed_over)
    raise NoBuildCache(f"no directory can hold its build ({reasons}); set HF_MOE_CACHE to a writable directory")


def _candidates() -> list[tuple[Path, str | None, bool]]:
    """(directory, the environment variable that names it, whether it is in a directory shared with other
    users), in order of preference."""
    out = []
    if os.environ.get("HF_MOE_CACHE"):
        out.append((Path(os.environ["HF_MOE_CACHE"]).expanduser(), "HF_MOE_CACHE", False))
    if os.environ.get("XDG_CACHE_HOME"):
        out.append((Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "hf_moe", "XDG_CACHE_HOME", False))
    try:
        out.append((Path.home() / ".cache" / "hf_moe", None, False))
    except (RuntimeError, KeyError):  # no $HOME and no password entry
        pass
    out.append((Path(tempfile.gettempdir()) / f"hf_moe-{os.getuid()}", None, True))
    return out


def _private_problem(path: Path) -> str | None:
    """None if `path` is (or was just made) a directory of this user's alone; else what is wrong with it."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as err:
        return f"cannot be made ({err.strerror or err})"
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory (a link, or a file)"
    if info.st_uid != os.getuid():
        return f"belongs to another user (uid {info.st_uid})"
    if info.st_mode & 0o077:
        return f"is open to other users (mode {stat.S_IMODE(info.st_mode):o}; it must be 700)"
    return None


def _writable_problem(path: Path) -> str | None:
    """None if a file can be created in `path` (made if absent); else why not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        return f"is not writable ({err.strerror or err})"
    return None
