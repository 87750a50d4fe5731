"""A load that overlaps a save into the same directory sees the old or the new checkpoint, whole, or a clear "being
written, retry" error: never a mix, never a false "corrupt".

A saver process writes model A, then B, then A ... into OUT for a bounded time; this process meanwhile loads OUT
in a loop, in turn with `from_pretrained`, offloaded (`offload_experts="disk"`, with a forward pass, so the experts
are read after the load returns) and with `verify_checkpoint`, and tells each result apart: A, B, a mix, "being
written" (`CheckpointBusyError`), or any other error (a false "corrupt": OUT is never corrupt at rest). The module
prints one line:

    C concurrent load/save rounds, 0 mixed, 0 false corrupt

The saver runs as `python tests/test_concurrency.py save OUT A B SECONDS`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
COUNTS = {"rounds": 0, "mixed": 0, "false corrupt": 0}
SECONDS = 12.0


def count_line() -> str:
    """The module's one-line count, which tests/conftest.py shows in pytest's closing summary (CI logs show it,
    from pytest-xdist's workers too, without -s or -rA)."""
    return (f"test_concurrency.py: {COUNTS['rounds']} concurrent load/save rounds, {COUNTS['mixed']} mixed, "
            f"{COUNTS['false corrupt']} false corrupt")


def _models():
    sys.path.insert(0, str(HERE))
    from conftest import tiny_dense

    from hf_moe import convert_to_moe

    return [convert_to_moe(tiny_dense("llama", seed=seed), num_experts=4, top_k=2, noise=0.05) for seed in (0, 1)]


def save_loop(out: Path, seconds: float) -> None:
    """The saver: A, B, A, ... into `out` until `seconds` have passed; prints how many saves it made."""
    torch.set_num_threads(1)
    models = _models()
    print("ready", flush=True)
    start, saves = time.monotonic(), 0
    while time.monotonic() - start < seconds:
        models[saves % 2].save_pretrained(out)
        saves += 1
    print(f"saves {saves}", flush=True)


def _which(state: dict[str, torch.Tensor], references: list[dict[str, torch.Tensor]]) -> str:
    """"A", "B" or "mixed" for a loaded state dict."""
    for name, reference in zip("AB", references):
        if state.keys() == reference.keys() and all(torch.equal(state[k], reference[k]) for k in reference):
            return name
    return "mixed"


def _busy(err: BaseException) -> bool:
    return "being written" in str(err)


@pytest.mark.subprocess
@pytest.mark.slow
def test_loads_during_saves_see_one_checkpoint(tmp_path):
    from conftest import random_ids

    from hf_moe import MoEForCausalLM
    from hf_moe.checkpoint import verify_checkpoint

    torch.set_num_threads(1)
    ids = random_ids()
    references, offloaded = [], []
    for name, model in zip("AB", _models()):
        model.save_pretrained(tmp_path / name)
        references.append({k: v.clone() for k, v in MoEForCausalLM.from_pretrained(tmp_path / name).state_dict().items()})
        with torch.no_grad():
            loaded = MoEForCausalLM.from_pretrained(tmp_path / name, offload_experts="disk", max_expert_memory="1GB")
            offloaded.append(loaded(ids).logits)
    out = tmp_path / "out"
    MoEForCausalLM.from_pretrained(tmp_path / "A").save_pretrained(out)

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_MOE_BACKEND": "torch", "TQDM_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    saver = subprocess.Popen([sys.executable, __file__, "save", str(out), str(SECONDS)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    outcomes: dict[str, int] = {}
    errors: list[str] = []
    try:
        assert saver.stdout.readline().strip() == "ready", saver.stderr.read()[-3000:]
        rounds = 0
        while saver.poll() is None:
            kind = ("load", "offload", "verify")[rounds % 3]
            try:
                with torch.no_grad():
                    if kind == "load":
                        outcome = _which(MoEForCausalLM.from_pretrained(out).state_dict(), references)
                    elif kind == "offload":
                        model = MoEForCausalLM.from_pretrained(out, offload_experts="disk", max_expert_memory="1GB")
                        got = model(ids).logits
                        outcome = next((n for n, want in zip("AB", offloaded) if torch.equal(got, want)), "mixed")
                    else:
                        report = verify_checkpoint(out)
                        outcome = "verified" if not report.problems else "false corrupt"
                        errors += report.problems[:2]
            except Exception as err:  # noqa: BLE001 - each is counted and shown
                outcome = "busy" if _busy(err) else "false corrupt"
                if outcome != "busy":
                    errors.append(f"{kind}: {type(err).__name__}: {str(err)[:300]}")
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            rounds += 1
    finally:
        saver.kill() if saver.poll() is None else None
        tail, err_tail = saver.communicate()
    assert saver.returncode == 0, err_tail[-3000:]
    saves = int(tail.split()[-1])
    COUNTS["rounds"] += rounds
    COUNTS["mixed"] += outcomes.get("mixed", 0)
    COUNTS["false corrupt"] += outcomes.get("false corrupt", 0)
    print(f"{rounds} rounds against {saves} saves: {outcomes}")
    assert outcomes.get("mixed", 0) == 0 and outcomes.get("false corrupt", 0) == 0, (outcomes, errors[:6])
    assert saves >= 4 and rounds >= 6, (saves, rounds)  # the two did overlap, both ways
    assert outcomes.get("A", 0) + outcomes.get("B", 0) > 0
    assert torch.equal(MoEForCausalLM.from_pretrained(out).state_dict()["lm_head.weight"],
                       references[(saves - 1) % 2]["lm_head.weight"])  # the last save is what OUT holds


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_save_waits_for_a_load_then_the_load_is_told(tmp_path):
    """A save waits for a load in progress (here one that does not end: it holds its read open) for
    HF_MOE_COMMIT_WAIT seconds, then swaps anyway; the load then raises CheckpointBusyError, "being written": it
    never returns what it read across the swap."""
    from hf_moe import MoEForCausalLM
    from hf_moe.checkpoint import CheckpointBusyError, reading

    out = tmp_path / "out"
    _models()[0].save_pretrained(out)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "HF_MOE_COMMIT_WAIT": "2",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with pytest.raises(CheckpointBusyError, match="being written"):
        with reading(out):
            saver = subprocess.run([sys.executable, __file__, "save-once", str(out)], capture_output=True,
                                   text=True, env=env, cwd=ROOT, timeout=300)
            assert saver.returncode == 0, saver.stderr[-3000:]
            waited = float(saver.stdout.split()[-1])
    assert waited >= 2.0 and "still running after 2s" in saver.stderr, (waited, saver.stderr[-2000:])
    MoEForCausalLM.from_pretrained(out)  # the save is complete


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_reader_process_with_several_threads_does_not_starve_a_save(tmp_path, monkeypatch):
    """A reader process whose threads overlap their reads (each passed the turnstile unchecked while another held a
    read: a nested read, as the process saw it) kept a save waiting the full HF_MOE_COMMIT_WAIT (600 s), then its
    loads got CheckpointBusyError; two reader processes let it through at once. A nested read is now one of the same
    thread: other threads queue behind the writer like other processes."""
    import warnings

    from hf_moe import MoEForCausalLM
    from hf_moe.checkpoint import reading

    models = _models()
    out = tmp_path / "out"
    models[0].save_pretrained(out)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    readers = subprocess.Popen([sys.executable, __file__, "read-threads", str(out), "4"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        assert readers.stdout.readline().strip() == "ready", readers.stderr.read()[-3000:]
        monkeypatch.setenv("HF_MOE_COMMIT_WAIT", "30")
        for model in (models[1], models[0]):  # (the first save makes the turnstile: the second finds it in place)
            start = time.monotonic()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model.save_pretrained(out)
            assert time.monotonic() - start < 15, time.monotonic() - start
            assert not [w for w in caught if "still running" in str(w.message)]  # (starved: swapped after the wait)
        assert readers.poll() is None, readers.stderr.read()[-3000:]  # the readers read on
    finally:
        readers.kill()
        readers.communicate()
    COUNTS["rounds"] += 2
    with reading(out):
        assert torch.equal(MoEForCausalLM.from_pretrained(out).lm_head.weight, models[0].lm_head.weight)


def test_a_save_inside_a_read_of_its_own_directory_fails_at_once(tmp_path, monkeypatch):
    """save_pretrained(OUT) inside `reading(OUT)` in the same thread waited HF_MOE_COMMIT_WAIT for a read that could
    not end before it returned, then blamed "another process". It is refused at once, saying why; the read is
    unharmed."""
    from hf_moe import MoEForCausalLM
    from hf_moe.checkpoint import reading

    models = _models()
    out = tmp_path / "out"
    models[0].save_pretrained(out)
    monkeypatch.setenv("HF_MOE_COMMIT_WAIT", "5")
    start = time.monotonic()
    with reading(out):
        with pytest.raises(RuntimeError, match="inside a read of it in the same thread"):
            models[1].save_pretrained(out)
        loaded = MoEForCausalLM.from_pretrained(out)
    assert time.monotonic() - start < 4
    assert torch.equal(loaded.lm_head.weight, models[0].lm_head.weight)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.hf_moe-")]


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_commit_wait_that_is_no_number_of_seconds_is_named(tmp_path, monkeypatch):
    """HF_MOE_COMMIT_WAIT=nan waited forever (every comparison with NaN is false); a negative or non-numeric value was
    taken silently. A save that has to wait now says what is wrong with it (here, waiting for a read held by this
    process, in a child process with a timeout); "inf" waits as long as the reads take."""
    from hf_moe.checkpoint import reading
    from hf_moe.checkpoint.snapshot import _commit_wait_s

    for value in ("-1", "ten", ""):
        monkeypatch.setenv("HF_MOE_COMMIT_WAIT", value)
        with pytest.raises(ValueError, match="is not a number of seconds"):
            _commit_wait_s()
    monkeypatch.setenv("HF_MOE_COMMIT_WAIT", "inf")
    assert _commit_wait_s() == float("inf")
    out = tmp_path / "out"
    _models()[0].save_pretrained(out)
    monkeypatch.setenv("HF_MOE_COMMIT_WAIT", "nan")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_MOE_BACKEND": "torch"}  # (the save needs no kernel: no wait for a build of the extension elsewhere)
    with reading(out):  # the save has to wait for this read
        saver = subprocess.run([sys.executable, __file__, "save-once", str(out)], capture_output=True, text=True,
                               env=env, cwd=ROOT, timeout=120)
    assert saver.returncode != 0 and "HF_MOE_COMMIT_WAIT='nan' is not a number of seconds" in saver.stderr, (
        saver.stderr[-2000:])


def read_threads(out: Path, threads: int) -> None:
    """Readers: `threads` threads of this process, each reading `out` in a loop (50 ms per read, staggered so that
    some thread always holds a read), until killed."""
    import threading

    from hf_moe.checkpoint import reading

    def loop(offset: float) -> None:
        time.sleep(offset)
        while True:
            with reading(out):
                time.sleep(0.05)

    for i in range(threads):
        threading.Thread(target=loop, args=(i * 0.05 / threads,), daemon=True).start()
    time.sleep(0.2)
    print("ready", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    if sys.argv[1] == "read-threads":
        read_threads(Path(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1] == "save":
        save_loop(Path(sys.argv[2]), float(sys.argv[3]))
    elif sys.argv[1] == "save-once":  # model B into OUT; prints the seconds the save took
        model = _models()[1]
        start = time.monotonic()
        model.save_pretrained(Path(sys.argv[2]))
        print(f"saved {time.monotonic() - start:.3f}")
