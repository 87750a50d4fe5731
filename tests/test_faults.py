"""Fault injection: no kill point and no failing filesystem leaves OUT damaged or staging behind.

`save_pretrained`, the streaming `convert_checkpoint` and `export_native` each write a new model over an old one in
OUT, and are
  * killed with SIGKILL at evenly spread points of their run, plus every point of the commit: a point is a marker,
    the call or return of a function of hf_moe's checkpoint, streaming or export code, or a call of an os/io
    function that touches files, counted by a profile hook (`sys.setprofile`) in the process that runs it;
  * failed mid-write: RLIMIT_FSIZE (EFBIG, and the SIGXFSZ kill), EMFILE (RLIMIT_NOFILE), and ENOSPC on a small tmpfs
    mounted in a private mount namespace (where this machine allows one; the count says how many ran).
`save_pretrained` is also killed at every commit point with RENAME_EXCHANGE disabled (two renames, recovered on
the next load). After each fault OUT must load as exactly the old or the new model (equal logits, the same files),
and the next save must leave nothing beside OUT. The module prints one line:

    N faults injected, 0 damaged, 0 leaked

The faults run in a driver process (`python tests/test_faults.py WORK`), which builds the models once and forks one
child per fault, so a fault costs the operation, not an interpreter start.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
COUNTS = {"faults": 0, "damaged": 0, "leaked": 0}
EVENLY_SPREAD = 20  # kill points per operation, evenly spread over its markers (plus every commit point)


@pytest.fixture(scope="module", autouse=True)
def _report_counts(request):
    """Print the module's one-line count past pytest's output capture (CI logs show it without -s or -rA)."""
    yield
    line = f"test_faults.py: {COUNTS['faults']} faults injected, {COUNTS['damaged']} damaged, {COUNTS['leaked']} leaked"
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        print(f"\n{line}", flush=True)


@pytest.mark.slow
def test_no_fault_damages_out_or_leaks_staging(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_MOE_BACKEND": "torch", "TQDM_DISABLE": "1",
           "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, env=env,
                            cwd=ROOT, timeout=900)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    faults = json.loads((tmp_path / "faults.json").read_text())
    COUNTS["faults"] += len(faults)
    damaged = [f for f in faults if not f["state"] in ("old", "new")]
    leaked = [f for f in faults if f["leaked"]]
    COUNTS["damaged"] += len(damaged)
    COUNTS["leaked"] += len(leaked)
    assert not damaged and not leaked, json.dumps(damaged[:5] + leaked[:5], indent=1)
    kinds = {}
    for fault in faults:
        kinds.setdefault((fault["op"], fault["kind"]), []).append(fault)
    for op in ("save", "stream", "export"):
        kills = kinds[(op, "SIGKILL")]
        assert len(kills) >= 20, (op, len(kills))
        assert {f["state"] for f in kills} == {"old", "new"}, op  # the points span the whole operation
        for kind in ("EFBIG", "EMFILE"):
            assert any(f["error"] for f in kinds[(op, kind)]), (op, kind)  # the fault did make the operation fail
    assert len(kinds[("save", "SIGKILL, two renames")]) >= 8
    assert any(f["absent_before_load"] for f in kinds[("save", "SIGKILL, two renames")])  # the window was hit
    from hf_moe.checkpoint import _renameat2

    if _renameat2() is not None:  # with RENAME_EXCHANGE, OUT is never absent
        assert not any(f["absent_before_load"] for f in faults if f["kind"] == "SIGKILL")


# --------------------------------------------------------------------------------------------------------------
# The driver (a separate process: it forks, which a pytest process with thread pools should not)
# --------------------------------------------------------------------------------------------------------------
IO_CALLS = {
    "open", "write", "pwrite", "close", "rename", "replace", "link", "symlink", "unlink", "rmdir", "mkdir",
    "ftruncate", "fsync", "copy_file_range", "preadv", "readinto", "flock", "serialize_file", "listdir", "scandir",
    "copyfile", "utime", "chmod",
}
OUR_FILES = {
    str(ROOT / "hf_moe" / name) for name in ("checkpoint.py", "export.py", "export_files.py", "convert/stream.py")
}
COMMIT_MARKERS = {"_commit", "_commit:return", "_exchange", "_exchange:return", "os.rename", "_carry_unrelated",
                  "_release", "_unlock", "_finish", "_new_staging:return", "write_text"}


class Markers:
    """A profile hook counting markers; at marker `kill_at` the process SIGKILLs itself."""

    def __init__(self, kill_at: int | None = None, record: bool = False):
        self.kill_at, self.count, self.names = kill_at, 0, [] if record else None

    def __call__(self, frame, event, arg):
        if event == "c_call":
            name = getattr(arg, "__name__", "")
            if name not in IO_CALLS:
                return
            name = f"os.{name}"
        elif event in ("call", "return") and frame.f_code.co_filename in OUR_FILES:
            name = frame.f_code.co_name + (":return" if event == "return" else "")
        else:
            return
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
    """One operation that writes a new model over an old one in `out`, and how to tell the two apart.

    write_new(out): the operation under test. write_old(out): the next save, which puts the old model back (a
    cheaper save of the same model where there is one). load(out): the logits of what `out` holds.
    """

    def __init__(self, name, write_new, write_old, load, out: Path, create_old=None):
        self.name, self.write_new, self.write_old, self.load, self.out = name, write_new, write_old, load, out
        (create_old or write_old)(out)
        write_old(out)
        self.old, self.old_files = self.fingerprint(out)
        self.old_digest = digest(out)
        scratch = out.parent / "reference-new"
        write_new(scratch)
        self.new, self.new_files = self.fingerprint(scratch)
        assert not self.same(self.old, self.new), name

    def fingerprint(self, out: Path):
        return self.load(out), sorted(p.name for p in out.iterdir())

    @staticmethod
    def same(a, b) -> bool:
        import torch

        return torch.equal(a, b)

    def state(self, out: Path) -> str:
        """'old', 'new', or what is wrong."""
        try:
            logits, files = self.fingerprint(out)
        except Exception as err:  # noqa: BLE001
            return f"damaged: {type(err).__name__}: {str(err)[:300]}"
        for name, (want, want_files) in (("old", (self.old, self.old_files)), ("new", (self.new, self.new_files))):
            if self.same(logits, want):
                return name if files == want_files else f"damaged: {name} logits but files {files}"
        return "damaged: other logits"


def digest(out: Path) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    for path in sorted(out.iterdir()):
        h.update(path.name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"(dir)"))
    return h.hexdigest()


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.hf_moe"))


def operations(work: Path) -> list[Operation]:
    import torch

    sys.path.insert(0, str(HERE))
    from conftest import random_ids, tiny_dense

    from hf_moe import MoEForCausalLM, convert_checkpoint, convert_to_moe, export_native
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
    tiny_dense("llama").save_pretrained(dense)
    models = {
        seed: convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, noise=0.05, seed=seed) for seed in (0, 1)
    }
    sources = {}
    for seed, model in models.items():
        sources[seed] = work / f"moe-{seed}"
        model.save_pretrained(sources[seed])

    def stream(seed):
        return lambda out: convert_checkpoint(dense, out, 4, 2, noise=0.05, seed=seed, progress=False)

    for name in ("save", "stream", "export"):
        (work / name).mkdir()
    stream(0)(work / "streamed-0")
    streamed_old = MoEForCausalLM.from_pretrained(work / "streamed-0")
    return [
        Operation("save", models[1].save_pretrained, models[0].save_pretrained, moe_logits, work / "save" / "out"),
        Operation("stream", stream(1), streamed_old.save_pretrained, moe_logits, work / "stream" / "out",
                  create_old=stream(0)),
        Operation("export", lambda out: export_native(sources[1], out),
                  lambda out: export_native(models[0], out, verify=False), native_logits, work / "export" / "out",
                  create_old=lambda out: export_native(sources[0], out, verify=False)),
    ]


def kill_points(names: list[str], evenly: int) -> list[int]:
    """`evenly` points spread over the run, and every commit marker (1-based)."""
    total = len(names)
    points = {1 + round(i * (total - 1) / (evenly - 1)) for i in range(evenly)}
    points |= {i + 1 for i, name in enumerate(names) if name in COMMIT_MARKERS}
    return sorted(points)


def _two_renames():
    import hf_moe.checkpoint as checkpoint

    checkpoint._exchange = lambda a, b: False  # as on a platform without RENAME_EXCHANGE


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
    used = sum(p.stat().st_size for p in op.out.iterdir())
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
    notes = []
    for op in operations(work):
        op.write_old(op.out)

        def record(kind, report, point=None):
            absent = not op.out.exists()
            state = op.state(op.out)  # (a load: it also restores a model a kill between two renames hid)
            early = leftovers(op.out) if report.get("signal") is None else []  # an error cleans up after itself
            op.write_old(op.out)  # the next save
            faults.append({
                "op": op.name, "kind": kind, "point": point, "state": state, "error": report.get("error"),
                "signal": report.get("signal"), "absent_before_load": absent,
                "leaked": early + leftovers(op.out) + ([] if digest(op.out) == op.old_digest else ["(not reset)"]),
            })

        dry = run_in_child(lambda: op.write_new(op.out), markers=Markers(record=True))
        assert dry["error"] is None and dry["signal"] is None, dry
        op.write_old(op.out)
        points = kill_points(dry["names"], EVENLY_SPREAD)
        for point in points:
            report = run_in_child(lambda: op.write_new(op.out), markers=Markers(kill_at=point))
            if report["signal"] != "SIGKILL":
                notes.append(f"{op.name}: kill point {point} was not reached")
                op.write_old(op.out)
                continue
            record("SIGKILL", report, point)
        if op.name == "save":
            commit = [i + 1 for i, name in enumerate(dry["names"]) if name in COMMIT_MARKERS]
            for point in kill_points(dry["names"], 4) + [c for c in commit if c not in points]:
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
        print(f"{op.name}: {len(dry['names'])} markers, {sum(f['op'] == op.name for f in faults)} faults", flush=True)
    (work / "faults.json").write_text(json.dumps(faults, indent=1))
    print("\n".join(notes))


if __name__ == "__main__":
    drive(Path(sys.argv[1]))
