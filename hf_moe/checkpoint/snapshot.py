"""What a reader of a checkpoint sees while a save replaces it: the old checkpoint or the new one, never a mix.

A save into OUT commits by swapping directories (commit.py): the finished staging directory takes OUT's name in one
rename and the old directory is removed. A load reads OUT's files one at a time, by path (hf_moe's checks, then
transformers and safetensors); a swap between two of those reads would mix two checkpoints, and the old files
vanishing mid-read would look like corruption. So:

- a reader (`reading(OUT)`) opens OUT as a directory, takes a shared `flock` on it for the whole read, and checks
  that OUT still names the directory it locked (else it locked a directory just swapped out: it opens OUT again);
- a writer (`exclusive(OUT)`, in `commit`) takes the exclusive `flock` of the directory OUT names before it swaps,
  so the swap waits for the reads in progress (at most `HF_MOE_COMMIT_WAIT` seconds, default 600, then it swaps
  anyway, with a warning), and readers that arrive during the swap wait for it (it takes microseconds);
- a writer that has to wait first takes the exclusive lock of a turnstile, `.OUT.hf_moe.lock` beside OUT (an empty
  file, created then and left in place), which new readers pass through (a shared lock, taken and released) before
  they lock OUT: they queue behind the writer, so readers in a loop cannot starve it, whether they are processes or
  threads of one process. Only a read nested in a read of OUT by the same thread skips the turnstile (it would wait
  for a writer that waits for the outer read); a write from inside such a read is refused at once (it would wait
  for itself).

When the block ends, the reader checks again that OUT is the directory it locked (its descriptor pins the inode, so a
reused inode number cannot fool the check): if a writer went ahead (its wait ran out, or a filesystem without
`flock`, such as some NFS mounts), what was read may be a mix, and the reader raises `CheckpointBusyError` ("being
written, retry"): never a mixed model, never a false "corrupt". Cost per load: two opens, two to four `flock`s,
three `stat`s (benchmarks/reliability.py measures it).
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from .format import CheckpointBusyError

try:
    import fcntl
except ImportError:  # not POSIX: no locks; the identity check still catches a swap
    fcntl = None

READER_WAIT_S = 60.0  # a reader waits this long for a writer's swap (microseconds, unless the writer is stopped)
_POLL_S = 0.002
_ATTEMPTS = 8  # a reader that finds OUT swapped under its lock opens it again, this many times
# (st_dev, st_ino) of the directories each thread reads now: a nested read of one of them in the same thread
# (from_pretrained inside `hf-moe generate`'s read) must not queue at the turnstile behind a writer that waits for the
# outer read. Per thread: another thread's read queues there like another process's, or readers in several threads
# of one process, overlapping, would keep a writer out for good.
_THREAD = threading.local()


def _held_here() -> Counter:
    if not hasattr(_THREAD, "held"):
        _THREAD.held = Counter()
    return _THREAD.held


def _commit_wait_s() -> float:
    text = os.environ.get("HF_MOE_COMMIT_WAIT", "600")
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0:  # (NaN too: it would wait forever)
        raise ValueError(
            f"HF_MOE_COMMIT_WAIT={text!r} is not a number of seconds >= 0: it says how long a save waits for loads "
            "of its directory in progress (default 600; inf waits as long as they take). Set it to such a number, "
            "or unset it."
        )
    return value


def _turnstile(directory: Path) -> Path:
    real = Path(os.path.realpath(directory))  # (where the writer, which resolves OUT, puts it)
    return real.parent / f".{real.name}.hf_moe.lock"


def _open_directory(directory: Path) -> int | None:
    try:
        return os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:  # absent, not a directory, or not readable: the read (or write) reports it
        return None


def _lock(fd: int, kind: int, wait_s: float) -> bool | None:
    """Take `kind` (LOCK_SH or LOCK_EX) on `fd` within `wait_s` seconds. True: held. False: still busy. None: this
    filesystem has no flock (nothing to wait for)."""
    if fcntl is None:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return True
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)


def names(directory: Path, fd: int) -> bool:
    """Whether the path `directory` names the directory open as `fd`."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(directory))
    except OSError:
        return False


def _busy(directory: Path) -> CheckpointBusyError:
    return CheckpointBusyError(
        f"{directory} was replaced by a save while it was being read: it is being written by another process. "
        "Nothing is wrong with it; load it again (the new checkpoint is complete once the save returns)."
    )


def _pass_turnstile(directory: Path) -> None:
    """Wait behind a writer that is waiting to swap `directory` (if any writer ever had to wait for it)."""
    if fcntl is None:
        return
    try:
        fd = os.open(_turnstile(directory), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:  # no turnstile: no writer ever had to wait here (or a read-only place nobody writes to)
        return
    try:
        if _lock(fd, fcntl.LOCK_SH, READER_WAIT_S + _commit_wait_s()) is False:
            raise _busy(directory)
    finally:
        os.close(fd)  # (passing through: released at once)


@contextlib.contextmanager
def reading(directory: str | os.PathLike) -> Iterator[None]:
    """Hold `directory` (a checkpoint) still while the block reads it: a save into it waits for the block to end.
    Raises `CheckpointBusyError` if it was replaced all the same (see the module docstring); any error the block
    raised while it was being replaced is raised as that, with the block's error as its cause."""
    directory = Path(directory)
    fd = None
    for _ in range(_ATTEMPTS):
        if not _held(directory):
            _pass_turnstile(directory)
        fd = _open_directory(directory)
        if fd is None:
            break
        locked = _lock(fd, fcntl.LOCK_SH if fcntl else 0, READER_WAIT_S)
        if locked is False:
            os.close(fd)
            raise _busy(directory)
        if names(directory, fd):
            break
        os.close(fd)  # locked a directory that a writer just swapped out: lock the new one
        fd = None
    else:
        raise _busy(directory)
    if fd is None:  # no such directory (yet): the block reports what is missing
        yield
        return
    info = os.fstat(fd)
    identity = (info.st_dev, info.st_ino)
    held = _held_here()
    held[identity] += 1
    try:
        try:
            yield
        except Exception as err:
            if not names(directory, fd):
                raise _busy(directory) from err
            raise
        if not names(directory, fd):
            raise _busy(directory)
    finally:
        held[identity] -= 1
        if not held[identity]:
            del held[identity]
        os.close(fd)


def _held(directory: Path) -> bool:
    """Whether this thread reads `directory` already (an outer `reading` of it holds its shared lock)."""
    try:
        info = os.stat(directory)
    except OSError:
        return False
    return (info.st_dev, info.st_ino) in _held_here()


def check_not_reading(target: str | os.PathLike) -> None:
    """Refuse to write `target` from inside a read of it in the same thread (`reading(target)`, or a load in
    progress): the write's swap would wait for that read to end, which it cannot while the write runs."""
    if _held(Path(target)):
        raise RuntimeError(
            f"Cannot write {target} from inside a read of it in the same thread (`hf_moe.checkpoint.reading`, or a "
            "load of it in progress): the save would wait for that read to end, and the read cannot end before the "
            "save returns. Save after the `with` block, or into another directory."
        )


@contextlib.contextmanager
def exclusive(target: Path) -> Iterator[None]:
    """Wait (see `HF_MOE_COMMIT_WAIT`) until no reader holds the directory `target` names, and keep readers out while
    the block swaps it. Nothing to wait for when `target` does not exist."""
    target = Path(target)
    check_not_reading(target)
    gate = fd = None
    try:
        for _ in range(_ATTEMPTS):
            fd = _open_directory(target)
            if fd is None:
                break
            locked = _lock(fd, fcntl.LOCK_EX if fcntl else 0, 0.0)
            if locked is False:
                if gate is None:
                    gate = _close_turnstile(target)
                wait_s = _commit_wait_s()
                locked = _lock(fd, fcntl.LOCK_EX, wait_s)
                if locked is False:
                    warnings.warn(f"Loads of {target} still running after {wait_s:.0f}s (HF_MOE_COMMIT_WAIT): "
                                  "replacing it now; they will fail with CheckpointBusyError and can be retried.",
                                  stacklevel=3)
                    break
            if names(target, fd):
                break
            os.close(fd)  # another writer swapped it meanwhile: lock the directory it is now
            fd = None
        yield
    finally:
        if fd is not None:
            os.close(fd)
        if gate is not None:
            os.close(gate)


def _close_turnstile(target: Path) -> int | None:
    """Hold the turnstile of `target` (creating it): new readers queue behind this writer."""
    try:
        gate = os.open(_turnstile(target), os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError:
        return None
    if not _lock(gate, fcntl.LOCK_EX, _commit_wait_s()):
        os.close(gate)
        return None
    return gate
