"""Fault injection: no kill point and no failing filesystem leaves OUT damaged or staging behind.

The writers: `save_pretrained`, `hf-moe convert` (streaming, the tokenizer included), the DCP training state
(`save_training_state`) and `export_native` (without its check, which only reads). Each writes a new state over an
old one in OUT, and is
  * killed with SIGKILL before EVERY step of its run, one run per step: a step is a call that can change what is on
    disk (an os function that creates, writes, renames, links or removes; a write, flush or close of a file object;
    the file writers of safetensors and torch) or a call or return of a function of the commit (its directory swap
    is a C call through ctypes, which the profiler does not report), counted by a profile hook (`sys.setprofile`)
    in the process that runs it. Killing before each step leaves, in turn, every state the writer can leave. Reads
    are not steps: an open by hf_moe's guarded opener (`open_fd`, read-only by contract) and the close of a
    descriptor it opened change nothing on disk, and a kill there leaves what the kill after the step before it
    leaves (counted, they made the export's kill points 383 instead of 74, for no new state);
  * failed mid-write: RLIMIT_FSIZE (EFBIG, and the SIGXFSZ kill), EMFILE (RLIMIT_NOFILE), and ENOSPC on a small tmpfs
    mounted in a private mount namespace (where this machine allows one; the count says how many ran).
`save_pretrained` and the training state are also killed before every step of their commit with RENAME_EXCHANGE
disabled (two renames, recovered on the next load). After each fault OUT must load as exactly the old or the new
state (equal logits or tensors, the same files, the same tokenizer bytes), and the next write must leave nothing
beside OUT. The module prints one line:

    N kill points over 4 writers (every step), 0 damaged; M filesystem faults, 0 damaged; 0 leaked

The faults run in a driver process (`python tests/test_faults.py WORK`), which builds the models once and forks one
child per fault, so a fault costs the operation, not an interpreter start.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
COUNTS = {"kills": 0, "kills damaged": 0, "faults": 0, "faults damaged": 0, "leaked": 0, "writers": 0}
WRITERS = ("save", "convert", "training_state", "export")


def count_line() -> str:
    """The module's one-line count, which tests/conftest.py shows in pytest's closing summary (CI logs show it,
    from pytest-xdist's workers too, without -s or -rA)."""
    return (f"test_faults.py: {COUNTS['kills']} kill points over {COUNTS['writers']} writers (every step), "
            f"{COUNTS['kills damaged']} damaged; {COUNTS['faults']} filesystem faults, {COUNTS['faults damaged']} "
            f"damaged; {COUNTS['leaked']} leaked")


@pytest.mark.subprocess
@pytest.mark.slow
def test_no_fault_damages_out_or_leaks_staging(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_MOE_BACKEND": "torch", "TQDM_DISABLE": "1",
           "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, env=env,
                            cwd=ROOT, timeout=1500)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    faults = json.loads((tmp_path / "faults.json").read_text())
    steps = json.loads((tmp_path / "steps.json").read_text())
    kills = [f for f in faults if f["kind"].startswith("SIGKILL")]
    damaged = [f for f in faults if f["state"] not in ("old", "new")]
    leaked = [f for f in faults if f["leaked"]]
    COUNTS["writers"] = len({f["op"] for f in kills})
    COUNTS["kills"] += len(kills)
    COUNTS["kills damaged"] += sum(f in damaged for f in kills)
    COUNTS["faults"] += len(faults) - len(kills)
    COUNTS["faults damaged"] += sum(f in damaged for f in faults if f not in kills)
    COUNTS["leaked"] += len(leaked)
    assert not damaged and not leaked, json.dumps(damaged[:5] + leaked[:5], indent=1)
    kinds = {}
    for fault in faults:
        kinds.setdefault((fault["op"], fault["kind"]), []).append(fault)
    for op in WRITERS:
        points = sorted(f["point"] for f in kinds[(op, "SIGKILL")])
        assert points == list(range(1, steps[op] + 1)), (op, steps[op], points[:5])  # every step, each reached
        assert {f["state"] for f in kinds[(op, "SIGKILL")]} == {"old", "new"}, op  # the points span the write
        for kind in ("EFBIG", "EMFILE"):
            assert any(f["error"] for f in kinds[(op, kind)]), (op, kind)  # the fault did make the operation fail
    for op in ("save", "training_state"):
        assert len(kinds[(op, "SIGKILL, two renames")]) == steps[f"{op} commit"]
        assert any(f["absent_before_load"] for f in kinds[(op, "SIGKILL, two renames")])  # the window was hit
    for fault in kinds[("convert", "EFBIG")]:  # a file-size limit is a clean CLI error (exit 2), not a traceback
        assert fault["error"] in (None, "RuntimeError: hf-moe convert exited 2"), fault  # (None: every file fit)
    from hf_moe.checkpoint.commit import _renameat2

    if _renameat2() is not None:  # with RENAME_EXCHANGE, OUT is never absent
        assert not any(f["absent_before_load"] for f in faults if f["kind"] == "SIGKILL")


# --------------------------------------------------------------------------------------------------------------
# The driver (a separate process: it forks, which a pytest process with thread pools should not)
# --------------------------------------------------------------------------------------------------------------
# Calls that can change what is on disk: os functions (and os.open, whose mode the profiler does not show) ...
OS_STEPS = {
    "open", "write", "pwrite", "pwritev", "writev", "close", "rename", "replace", "link", "symlink", "unlink",
    "remove", "rmdir", "mkdir", "ftruncate", "truncate", "fsync", "fdatasync", "copy_file_range", "sendfile", "utime",
    "chmod", "flock",
}
# ... methods of open files (the builtin open's objects: a write, a flush, a close that flushes) ...
FILE_STEPS = {"write", "writelines", "flush", "close", "truncate", "__exit__"}
# ... and the file writers of safetensors (Rust) and torch.save (C++), and the builtin open itself.
WRITER_STEPS = {"serialize_file", "write_record", "write_end_of_file", "open"}
# Writes of a file's content: a run of them with no other step between is one step (a kill anywhere inside it leaves
# the same file half-written; the kill before its first write is the one that counts).
DATA_WRITES = {"os.write", "os.pwrite", "os.pwritev", "os.writev", "os.copy_file_range", "os.sendfile", "file.write",
               "file.writelines", "file.flush", "write_record", "write_end_of_file"}
# The commit, and its swap: their calls and returns bracket the directory swap (renameat2 through ctypes).
COMMIT_FILE = str(ROOT / "hf_moe" / "checkpoint" / "commit.py")
# hf_moe's guarded opener: every descriptor it returns is open for reading (checkpoint/guard.py, O_RDONLY).
READ_OPENER = (str(ROOT / "hf_moe" / "checkpoint" / "guard.py"), "open_fd")
# Every C function a step can call is named in one of these: the hook looks no further at any other (it runs on every
# call and return of the writer, hundreds of thousands, and its cost is most of a fault's).
C_STEP_NAMES = frozenset(OS_STEPS | FILE_STEPS | WRITER_STEPS)


def _written_on_disk(file) -> bool:
    """Whether a file object is a file on disk open for writing (not a BytesIO, which torch.save and DCP serialise
    into; not a file open for reading, whose close changes nothing)."""
    if getattr(file, "mode", "w") in ("r", "rb"):
        return False
    try:
        file.fileno()
    except io.UnsupportedOperation:
        return False
    except (ValueError, OSError):  # closed: it was a file
        return True
    return True


def _is_step(event: str, frame, arg) -> str | None:
    """The name of the step an event is, or None."""
    if event == "c_call":
        name = getattr(arg, "__name__", "")
        owner = getattr(arg, "__self__", None)
        if getattr(owner, "__name__", None) in ("posix", "nt", "fcntl") and name in OS_STEPS:
            return f"os.{name}"
        if isinstance(owner, io.IOBase):
            return f"file.{name}" if name in FILE_STEPS and _written_on_disk(owner) else None
        if name in WRITER_STEPS:
            return name
    elif event in ("call", "return") and frame.f_code.co_filename == COMMIT_FILE and frame.f_code.co_name in (
        "commit", "_exchange"
    ):
        return frame.f_code.co_name + (":return" if event == "return" else "")
    return None


def _in_read_opener(frame) -> bool:
    """(The name first: it is compared on every C call, and it rarely matches.)"""
    return frame.f_code.co_name == READ_OPENER[1] and frame.f_code.co_filename == READ_OPENER[0]


class Markers:
    """A profile hook counting steps (see `_is_step`, `DATA_WRITES`); before step `kill_at` the process SIGKILLs
    itself. The guarded opener's opens, and the closes of the descriptors it returned, are reads, not steps."""

    def __init__(self, kill_at: int | None = None, record: bool = False):
        self.kill_at, self.count, self.names = kill_at, 0, [] if record else None
        self.writing = False
        self.read_fds: set[int] = set()  # descriptors open for reading (by the guarded opener), not yet closed

    def _is_read(self, name: str, frame) -> bool:
        if name == "os.open" and _in_read_opener(frame):
            return True
        if name == "os.close":  # (the profiler does not show arguments: the caller's `fd`, as hf_moe names it)
            fd = frame.f_locals.get("fd")
            if fd in self.read_fds:
                self.read_fds.discard(fd)
                return True
        return False

    def __call__(self, frame, event, arg):
        if event == "c_call":
            if _in_read_opener(frame) and isinstance(frame.f_locals.get("fd"), int):
                self.read_fds.add(frame.f_locals["fd"])  # (open_fd's checks of the descriptor it just opened)
            if getattr(arg, "__name__", "") not in C_STEP_NAMES:
                return
        elif event != "call" and event != "return":
            return
        name = _is_step(event, frame, arg)
        if name is None:
            return
        if self._is_read(name, frame):
            self.writing = False  # (a read still ends a run of writes: the next write is a step of its own)
            return
        if name in DATA_WRITES:
            if self.writing:
                return
            self.writing = True
        else:
            self.writing = False
        self.count += 1
        if self.names is not None:
            self.names.append(name)
        if self.count == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def run_in_child(work, prepare=None, markers: Markers | None = None) -> dict:
    """Fork; in the child run `prepare()` then `work()` under `markers`; return what the child reported (its error
    or markers) and how it ended."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_end)
        report = {"error": None}
        try:
            if prepare is not None:
                prepare()
            sys.setprofile(markers)
            try:
                work()
            finally:
                sys.setprofile(None)
        except BaseException as err:  # noqa: BLE001 - reported to the parent
            report["error"] = f"{type(err).__name__}: {err}"[:400]
        if markers is not None:
            report.update(count=markers.count, names=markers.names)
        with os.fdopen(write_end, "w") as pipe:
            json.dump(report, pipe)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        text = pipe.read()
    _, status = os.waitpid(pid, 0)
    report = json.loads(text) if text else {"error": None}
    report["signal"] = signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status) else None
    return report


class Operation:
    """One writer that writes a new state over an old one in `out`, and how to tell the two apart.

    write_new(out): the operation under test. write_old(out): the next write, which puts the old state back.
    load(out): a tensor of what `out` holds (logits, or the training state's tensors).
    """

    def __init__(self, name, write_new, write_old, load, out: Path):
        self.name, self.write_new, self.write_old, self.load, self.out = name, write_new, write_old, load, out
        write_old(out)
        write_old(out)
        self.old = self.fingerprint(out)
        self.old_digest = digest(out)
        scratch = out.parent / "reference-new"
        write_new(scratch)
        self.new = self.fingerprint(scratch)
        self.new_digest = digest(scratch)
        assert not self.same(self.old, self.new), name

    def fingerprint(self, out: Path):
        """(what it computes or holds, its file names, its tokenizer's bytes)."""
        return self.load(out), sorted(p.name for p in out.iterdir()), tokenizer_digest(out)

    @staticmethod
    def same(a, b) -> bool:
        import torch

        return torch.equal(a[0], b[0]) and a[1:] == b[1:]

    def state(self, out: Path) -> str:
        """'old', 'new', or what is wrong."""
        if os.path.isdir(out) and digest(out) in (self.old_digest, self.new_digest):  # byte for byte: no load
            return "old" if digest(out) == self.old_digest else "new"
        try:
            found = self.fingerprint(out)
        except Exception as err:  # noqa: BLE001
            return f"damaged: {type(err).__name__}: {str(err)[:300]}"
        for name, want in (("old", self.old), ("new", self.new)):
            if self.same(found, want):
                return name
        return f"damaged: files {found[1]}"


def digest(out: Path) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    for path in sorted(out.iterdir()):
        h.update(path.name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"(dir)"))
        if path.is_dir():
            h.update(digest(path).encode())
    return h.hexdigest()


def tokenizer_digest(out: Path) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (out / name).is_file():
            h.update(name.encode() + b"\0" + (out / name).read_bytes())
    return h.hexdigest()


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.hf_moe"))


def operations(work: Path) -> list[Operation]:
    import torch

    sys.path.insert(0, str(HERE))
    from conftest import random_ids, tiny_dense, tiny_tokenizer

    from hf_moe import MoEForCausalLM, convert_to_moe, export_native
    from hf_moe.cli import main as cli
    from hf_moe.parallel.training_state import load_training_state, save_training_state
    from transformers import AutoModelForCausalLM

    ids = random_ids()

    def logits_of(model):
        with torch.no_grad():
            return model.eval()(ids).logits

    def moe_logits(out):
        return logits_of(MoEForCausalLM.from_pretrained(out))

    def native_logits(out):
        return logits_of(AutoModelForCausalLM.from_pretrained(out))

    dense = work / "dense"
    tiny_dense("llama", num_hidden_layers=2).save_pretrained(dense)
    tiny_tokenizer().save_pretrained(dense)
    models = {
        seed: convert_to_moe(tiny_dense("llama", num_hidden_layers=2), num_experts=4, top_k=2, noise=0.05, seed=seed)
        for seed in (0, 1)
    }
    sources = {}
    for seed, model in models.items():
        sources[seed] = work / f"moe-{seed}"
        model.save_pretrained(sources[seed])

    def convert(seed):
        def run(out):
            status = cli(["convert", str(dense), str(out), "--num-experts", "4", "--top-k", "2", "--noise", "0.05",
                          "--seed", str(seed)])
            if status != 0:
                raise RuntimeError(f"hf-moe convert exited {status}")
        return run

    def optimizer_after_a_step(model):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model.train()(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return optimizer

    trained = {seed: (model, optimizer_after_a_step(model)) for seed, model in models.items()}

    def save_state(seed):
        model, optimizer = trained[seed]
        return lambda out: save_training_state(out, model, optimizer, data_position={"step": seed + 1})

    def state_tensors(out):
        model = convert_to_moe(tiny_dense("llama", num_hidden_layers=2), num_experts=4, top_k=2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        position = load_training_state(out, model, optimizer)
        moments = [t.flatten() for s in optimizer.state.values() for t in s.values() if t.dim()]
        return torch.cat([p.detach().flatten() for p in model.parameters()] + moments
                         + [torch.tensor([float(position["step"])])])

    for name in WRITERS:
        (work / name).mkdir()
    return [
        Operation("save", models[1].save_pretrained, models[0].save_pretrained, moe_logits, work / "save" / "out"),
        Operation("convert", convert(1), convert(0), moe_logits, work / "convert" / "out"),
        Operation("training_state", save_state(1), save_state(0), state_tensors, work / "training_state" / "out"),
        # (The export's check reads the staged files back and runs both models: it changes nothing on disk, so a kill
        # inside it leaves what a kill after it leaves, and it was 1.5 s of every later kill point's run.)
        Operation("export", lambda out: export_native(sources[1], out, verify=False),
                  lambda out: export_native(sources[0], out, verify=False), native_logits, work / "export" / "out"),
    ]


def _two_renames():
    import hf_moe.checkpoint.commit as commit

    commit._exchange = lambda a, b: False  # as on a platform without RENAME_EXCHANGE


def _limit(resource_id, soft):
    import resource

    resource.setrlimit(resource_id, (soft, resource.getrlimit(resource_id)[1]))


def _free_descriptors(extra: int) -> int:
    """A soft limit leaving `extra` descriptors free, besides the one this listing uses and frees."""
    used = {int(fd) for fd in os.listdir("/proc/self/fd")}
    limit = 0
    while sum(1 for fd in range(limit) if fd not in used) < extra or limit in used:
        limit += 1
    return limit


def filesystem_faults(op: Operation):
    """(kind, prepare) of each filesystem failure to run `op` under."""
    import resource

    def fsize(limit, ignore_signal=True):
        def prepare():  # (Python ignores SIGXFSZ: the write fails with EFBIG; SIG_DFL makes it a kill)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN if ignore_signal else signal.SIG_DFL)
            _limit(resource.RLIMIT_FSIZE, limit)
        return prepare

    def nofile(extra):
        return lambda: _limit(resource.RLIMIT_NOFILE, _free_descriptors(extra))

    faults = [("EFBIG", fsize(n)) for n in (4096, 65536, 200_000)]
    faults.append(("SIGXFSZ", fsize(65536, ignore_signal=False)))
    faults += [("EMFILE", nofile(n)) for n in (0, 1, 3)]
    return faults


_libc = ctypes.CDLL(None, use_errno=True)
MS_REMOUNT, MS_REC, MS_PRIVATE, CLONE_NEWNS = 32, 16384, 1 << 18, 0x00020000


def _mount(source, target, fstype, flags, data) -> None:
    if _libc.mount(source, os.fsencode(target), fstype, flags, data) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno), str(target))


def enospc_fault(op: Operation, free_fraction: float, work: Path) -> dict:
    """Run `op` with OUT on a tmpfs (in a private mount namespace, gone with the child) that holds the old model and
    `free_fraction` of the new one; then check OUT there, grow the tmpfs and save again. Runs in a child."""
    import shutil

    mount = work / f"tmpfs-{op.name}"
    mount.mkdir(exist_ok=True)
    used = sum(p.stat().st_size for p in op.out.rglob("*") if p.is_file())
    size = (int(used + free_fraction * used) // 4096 + 8) * 4096
    report_file = work / f"enospc-{op.name}.json"
    report_file.unlink(missing_ok=True)

    def work_in_tmpfs():
        if _libc.unshare(CLONE_NEWNS) != 0:
            raise PermissionError("unshare(CLONE_NEWNS) refused: no private mount namespace here")
        _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
        _mount(b"tmpfs", mount, b"tmpfs", 0, f"size={size}".encode())
        out = mount / "out"
        shutil.copytree(op.out, out)
        error = None
        try:
            op.write_new(out)
        except BaseException as err:  # noqa: BLE001
            error = f"{type(err).__name__}: {err}"[:300]
        left = leftovers(out)
        state = op.state(out)
        _mount(None, mount, None, MS_REMOUNT, b"size=64m")
        op.write_old(out)  # the next save, with room
        report_file.write_text(json.dumps({"tmpfs_error": error, "tmpfs_state": state,
                                           "tmpfs_leaked": left + leftovers(out)}))

    report = run_in_child(work_in_tmpfs)
    if report["error"] is not None or not report_file.is_file():
        return {"skipped": report["error"] or report["signal"]}
    return json.loads(report_file.read_text())


def drive(work: Path) -> None:
    import torch

    torch.set_num_threads(1)
    faults = []
    steps = {}
    notes = []
    for op in operations(work):
        op.write_old(op.out)

        def record(kind, report, point=None):
            absent = not op.out.exists()
            state = op.state(op.out)  # (a load: it also restores a model a kill between two renames hid)
            early = leftovers(op.out) if report.get("signal") is None else []  # an error cleans up after itself
            op.write_old(op.out)  # the next write
            reset = digest(op.out) == op.old_digest or op.state(op.out) == "old"
            faults.append({
                "op": op.name, "kind": kind, "point": point, "state": state, "error": report.get("error"),
                "signal": report.get("signal"), "absent_before_load": absent,
                "leaked": early + leftovers(op.out) + ([] if reset else ["(not reset)"]),
            })

        dry = run_in_child(lambda: op.write_new(op.out), markers=Markers(record=True))
        assert dry["error"] is None and dry["signal"] is None, dry
        op.write_old(op.out)
        steps[op.name] = len(dry["names"])
        for point in range(1, steps[op.name] + 1):  # every step
            report = run_in_child(lambda: op.write_new(op.out), markers=Markers(kill_at=point))
            if report["signal"] != "SIGKILL":
                notes.append(f"{op.name}: kill point {point} was not reached")
                op.write_old(op.out)
                continue
            record("SIGKILL", report, point)
        if op.name in ("save", "training_state"):  # every step of the commit, with two renames instead of the swap
            renames = run_in_child(lambda: op.write_new(op.out), prepare=_two_renames, markers=Markers(record=True))
            assert renames["error"] is None and "os.rename" in renames["names"], renames
            op.write_old(op.out)
            names = renames["names"]  # (the commit starts at its call, or at the first rename of a writer's own)
            first = names.index("commit") if "commit" in names else names.index("os.rename")
            steps[f"{op.name} commit"] = len(renames["names"]) - first
            for point in range(first + 1, len(renames["names"]) + 1):
                report = run_in_child(lambda: op.write_new(op.out), prepare=_two_renames,
                                      markers=Markers(kill_at=point))
                if report["signal"] == "SIGKILL":
                    record("SIGKILL, two renames", report, point)
        for kind, prepare in filesystem_faults(op):
            record(kind, run_in_child(lambda: op.write_new(op.out), prepare=prepare))
        for fraction in (0.1, 0.5, 0.9):
            result = enospc_fault(op, fraction, work)
            if "skipped" in result:
                notes.append(f"{op.name}: ENOSPC skipped ({result['skipped']})")
                break
            faults.append({
                "op": op.name, "kind": "ENOSPC", "point": fraction, "state": result["tmpfs_state"],
                "error": result["tmpfs_error"], "signal": None, "absent_before_load": False,
                "leaked": result["tmpfs_leaked"],
            })
        print(f"{op.name}: {steps[op.name]} steps, {sum(f['op'] == op.name for f in faults)} faults", flush=True)
    (work / "faults.json").write_text(json.dumps(faults, indent=1))
    (work / "steps.json").write_text(json.dumps(steps))
    print("\n".join(notes))


if __name__ == "__main__":
    drive(Path(sys.argv[1]))
