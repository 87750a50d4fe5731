"""Atomic commit of a directory, and recovery from whatever a killed writer left.

A writer fills `.OUT.hf_moe-tmp-<token>` beside OUT while holding an exclusive `flock` on
`.OUT.hf_moe-<token>.lock`, then swaps it with OUT in one step (`renameat2(RENAME_EXCHANGE)`; where the platform
or filesystem lacks it, two renames through `.OUT.hf_moe-old-<token>`). Whatever a killed writer leaves beside OUT
has a lock nobody holds: the next writer into OUT removes it, and the next load or save puts back a directory that a
kill between the two renames left hidden. A live writer holds its lock, so its staging is never touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import re
import shutil
import stat
import uuid
from collections import defaultdict
from pathlib import Path

from ..model_card import is_generated_card
from .format import CONFIG_FILES, MAX_FILE_BYTES, CheckpointError, is_weight_file
from .guard import read_bytes
from .snapshot import exclusive

try:
    import fcntl
except ImportError:  # not POSIX: no locks, so stale staging is never removed (it cannot be told from live)
    fcntl = None


# Staging directories this process is writing: path -> (fd holding the flock, or None without locks; lock file;
# token). Released by `commit` or `discard`.
_HELD: dict[Path, tuple[int | None, Path, str]] = {}


def resolve_output_directory(directory: str | os.PathLike, action: str = "Cannot write to") -> Path:
    """`directory` as an absolute path with symbolic links and `..` resolved, so that a link is followed (the
    directory it names is replaced, not the link) and two spellings of one directory compare equal."""
    target = Path(os.path.realpath(directory))
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"{action} {target}: it is a file, not a directory.")
    return target


def same_directory(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name one directory (after resolving links and `..`)."""
    return os.path.realpath(a) == os.path.realpath(b)


def nested_directories(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name one directory or one lies inside the other (after resolving links and `..`): a save
    into either would replace, or write into, the other."""
    a, b = os.path.realpath(a), os.path.realpath(b)
    return os.path.commonpath([a, b]) in (a, b)


@contextlib.contextmanager
def staging_directory(target: Path):
    """A fresh staging directory beside `target`, locked while the block runs; discarded if the block raises.
    The block ends with `commit(staging, target)` (a save does it in `save.finish`)."""
    staging = new_staging(target)
    try:
        yield staging
    except BaseException:
        discard(staging)
        raise
    finally:
        _release(staging)


def _sibling(target: Path, kind: str, token: str) -> Path:
    return target.parent / f".{target.name}.hf_moe-{kind}-{token}"


def _lock_path(target: Path, token: str) -> Path:
    return target.parent / f".{target.name}.hf_moe-{token}.lock"


def new_staging(target: Path) -> Path:
    """Create and lock a staging directory beside `target`, after removing what killed saves into it left.

    The lock file is created (and locked) before the directory, and removed only once the directory is finished
    with (committed or being discarded), so a staging directory whose lock nobody holds belongs to no live writer.
    A cleaner may lock a new lock file in the instant between its creation and its locking, and remove it: the
    writer then finds its lock file gone and takes a new one.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_staging(target)
    token, fd, lock = _new_lock(target)
    staging = _sibling(target, "tmp", token)
    try:
        staging.mkdir()
    except BaseException:
        _unlock(fd, lock)
        raise
    _HELD[staging] = (fd, lock, token)
    return staging


def _new_lock(target: Path) -> tuple[str, int | None, Path]:
    """(token, descriptor holding its lock, or None on a filesystem without locks, lock file) of a new writer."""
    while True:
        token = uuid.uuid4().hex[:12]
        lock = _lock_path(target, token)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        locked = _try_lock(fd, blocking=True)
        if locked is not False and _still_linked(fd, lock):
            break
        os.close(fd)  # a cleaner removed it before we locked it: take another
    if locked is None:  # a filesystem without locks: nothing to hold (and no cleaner will touch it)
        os.close(fd)
        fd = None
    return token, fd, lock


def replace_file(target: str | os.PathLike, data: bytes) -> None:
    """Replace the file `target` (inside a checkpoint: its index) with `data` in one rename, keeping its mode (the
    umask does not apply: other users keep the access they had). Staged as a directory is: `.NAME.hf_moe-tmp-<token>`
    beside it, under the lock `.NAME.hf_moe-<token>.lock`, so that what a killed writer leaves is stale for the next
    `replace_file` (or `clean_stale_staging(target)`) to remove, and a live writer's staging is left alone."""
    target = Path(target)
    mode = stat.S_IMODE(os.stat(target).st_mode)
    clean_stale_staging(target)
    token, lock_fd, lock = _new_lock(target)
    staging = _sibling(target, "tmp", token)
    try:
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(staging, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            staging.unlink()
        raise
    finally:
        _unlock(lock_fd, lock)


def _still_linked(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _try_lock(fd: int, blocking: bool) -> bool | None:
    """True: this process now holds the lock. False: another process holds it. None: the filesystem has no locks."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        return None
    return True


def _unlock(fd: int | None, lock: Path) -> None:
    """Remove the lock file, then release the lock (in that order: see `new_staging`)."""
    with contextlib.suppress(FileNotFoundError):
        lock.unlink()
    if fd is not None:
        os.close(fd)


def _release(staging: Path) -> None:
    held = _HELD.pop(staging, None)
    if held is not None:
        _unlock(held[0], held[1])


def discard(staging: Path) -> None:
    """Remove a staging directory this process created. Its lock goes first: that frees a descriptor for the
    removal (which may have failed for want of one), and should the removal fail, what remains is stale, for the
    next save to remove."""
    _release(staging)
    _remove_tree(staging)


def _remove_tree(path: Path) -> None:
    """`shutil.rmtree`, and where it could not (it holds a descriptor per directory level), a simpler walk."""
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.lexists(path):
        return
    with contextlib.suppress(OSError):
        for name in os.listdir(path):
            child = path / name
            if child.is_dir() and not child.is_symlink():
                _remove_tree(child)
            else:
                child.unlink()
        path.rmdir()


_STAGING = re.compile(r"\..+\.hf_moe-(?:(?:tmp|old|export)-)?[0-9a-f]{8,32}(?:\.lock)?")


def _leftovers(target: Path) -> dict[str, list[Path]]:
    """{token: paths} of the staging directories, backups and lock files beside `target`."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.hf_moe-(?:(?:tmp|old|export)-)?([0-9a-f]{{8,32}})(?:\.lock)?")
    try:
        names = os.listdir(target.parent)
    except OSError:
        return {}
    found: dict[str, list[Path]] = defaultdict(list)
    for name in names:
        match = pattern.fullmatch(name)
        if match:
            found[match[1]].append(target.parent / name)
    return found


def _claim_dead(target: Path, token: str) -> tuple[bool, int | None]:
    """(True, fd) with the token's lock now held by this process (fd None if it has no lock file) when its writer
    is gone; (False, None) when it is alive, or when this filesystem cannot tell."""
    if any(held[2] == token for held in _HELD.values()):
        return False, None
    try:
        fd = os.open(_lock_path(target, token), os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return True, None  # no lock file: its writer is gone (or was an hf_moe without locks)
    except OSError:
        return False, None
    if _try_lock(fd, blocking=False):
        return True, fd
    os.close(fd)
    return False, None


def clean_stale_staging(target: str | os.PathLike) -> list[Path]:
    """Remove what killed saves into `target` left beside it (staging directories, backups, lock files), after
    putting back a model that a kill in the middle of a commit left hidden. Live writers' files are kept. Returns
    the paths removed."""
    target = Path(target)
    removed = []
    for token, paths in sorted(_leftovers(target).items()):
        dead, fd = _claim_dead(target, token)
        if not dead:
            continue
        try:
            _restore_backup(target, token)
            for path in paths:
                if path.name.endswith(".lock"):
                    continue
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                removed.append(path)
        finally:
            _unlock(fd, _lock_path(target, token))
    return removed


def _restore_backup(target: Path, token: str) -> bool:
    backup = _sibling(target, "old", token)
    if backup.is_dir() and not os.path.lexists(target):
        with contextlib.suppress(FileNotFoundError):
            os.rename(backup, target)
            return True
    return False


def recover_interrupted_commit(target: str | os.PathLike) -> bool:
    """If `target` is missing because a save was killed between the two renames of its commit (platforms without
    `RENAME_EXCHANGE`), put the previous model back. Returns whether it did."""
    target = Path(target)
    if os.path.lexists(target) or not target.parent.is_dir():
        return False
    for token in sorted(_leftovers(target)):
        if not _sibling(target, "old", token).is_dir():
            continue
        dead, fd = _claim_dead(target, token)
        if dead:
            try:
                if _restore_backup(target, token):
                    return True
            finally:
                if fd is not None:
                    os.close(fd)
    return False


def commit(staging: Path, target: Path, carry: bool = True) -> None:
    """Move the finished staging directory to `target`, keeping the target's unrelated files (with `carry`).

    One atomic step where the platform allows it (`renameat2(RENAME_EXCHANGE)` swaps the two directories; the old
    model is then removed from the staging path). Elsewhere: target -> backup, staging -> target, and the next
    load or save puts the backup back if a kill fell between the two.
    """
    held = _HELD.get(staging)
    if os.path.lexists(target):
        if carry:
            _carry_unrelated(target, staging)
        with exclusive(target):  # waits for loads of the target in progress (snapshot.py)
            if _exchange(staging, target):
                previous = staging  # the previous model, now at the staging path
            else:
                previous = _sibling(target, "old", held[2] if held else uuid.uuid4().hex[:12])
                os.rename(target, previous)
                try:
                    os.rename(staging, target)
                except BaseException:
                    os.rename(previous, target)
                    raise
        _release(staging)  # first: should the removal fail (or be killed), the previous model is stale, not live
        _remove_tree(previous)
    else:
        os.rename(staging, target)
        _release(staging)


def _carry_unrelated(target: Path, staging: Path) -> None:
    """Link (or copy) into `staging` the target's files that this save does not produce: a tokenizer, training
    logs. Symbolic links are carried as links, never followed."""
    produced = {p.name for p in staging.iterdir()}
    for item in target.iterdir():
        if item.name == "README.md" and (
            not item.is_file() or item.is_symlink() or not _is_generated_card(target, item.name)
        ):
            (staging / "README.md").unlink(missing_ok=True)  # the user's own README wins over our card
        elif item.name in produced or is_weight_file(item.name) or item.name in CONFIG_FILES:
            continue  # (a config file the save did not write is the old model's: not carried)
        elif _STAGING.fullmatch(item.name):
            continue  # what a killed `hf-moe verify --update` left (replace_file): it goes with the old directory
        _link_or_copy(item, staging / item.name)


def _is_generated_card(directory: Path, name: str) -> bool:
    try:
        return is_generated_card(read_bytes(directory, name, "the output directory", MAX_FILE_BYTES).decode(
            "utf-8", errors="replace"))
    except (CheckpointError, OSError):
        return False  # not ours to replace


def _link_or_copy(src: Path, dst: Path) -> None:
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy_file)
    else:
        _link_or_copy_file(src, dst)


def _link_or_copy_file(src, dst) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@functools.cache
def _renameat2():
    """libc's renameat2 (Linux, glibc >= 2.28), or None."""
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError, TypeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically. False where the platform or the filesystem cannot."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"Cannot swap {a} and {b}: {os.strerror(err)}")
