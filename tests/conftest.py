"""Shared fixtures: tiny models of every family the core conversion supports, built from configs (no hub); the tiny
MoE checkpoint every test may read (`tiny_moe`, read-only); and the one-line counts that some modules print."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 128
_DECODER = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4)
# model_type -> tiny config kwargs. Chosen to exercise: GQA, sliding windows, GeGLU, fused gate_up, Conv1D + biases,
# parallel-residual NeoX, and OPT's MLP written inline in the decoder layer.
FAMILIES = {
    "llama": dict(_DECODER, num_key_value_heads=2),
    "mistral": dict(_DECODER, num_key_value_heads=2, sliding_window=6),
    "qwen2": dict(_DECODER, num_key_value_heads=2),
    "qwen3": dict(_DECODER, num_key_value_heads=2, head_dim=16),
    "gemma": dict(_DECODER, num_key_value_heads=1, head_dim=16),
    "phi3": dict(_DECODER, num_key_value_heads=2, pad_token_id=0),
    "gpt2": dict(n_embd=64, n_layer=3, n_head=4, n_positions=64),
    "gpt_neox": dict(_DECODER),
    "opt": dict(hidden_size=64, ffn_dim=96, num_hidden_layers=3, num_attention_heads=4, word_embed_proj_dim=64,
                max_position_embeddings=64),
}
SPECIAL_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


def tiny_config(model_type: str, **overrides):
    kwargs = {"vocab_size": VOCAB, **SPECIAL_IDS, **FAMILIES[model_type], **overrides}
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_dense(model_type: str = "llama", seed: int = 0, **overrides):
    """A randomly initialised dense causal LM in eval mode, fp32."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides)).eval()


def tiny_converted(model_type: str = "llama", seed: int = 0, **convert):
    """`tiny_dense` converted to 4 experts, top-2 (noise 0.1, unverified), in eval mode, fp32: the decode tests'
    model. `convert` goes to `convert_to_moe` (layers, shared experts, ...)."""
    import hf_moe

    torch.manual_seed(seed)
    dense = tiny_dense(model_type, seed=seed)
    return hf_moe.convert_to_moe(dense, num_experts=4, top_k=2, noise=0.1, verify=False, **convert).eval()


class StreamedTokens:
    """A `generate` streamer (transformers' BaseStreamer interface) that keeps what it is given, each put as a list
    (the prompt's [B, T], then each step's [B]), and whether it was ended."""

    def __init__(self):
        self.tokens, self.ended = [], False

    def put(self, value) -> None:
        self.tokens.append(value.tolist())

    def end(self) -> None:
        self.ended = True


def assert_same_greedy(reference, fast, atol: float, rtol: float, near_tie: float = 0.0) -> None:
    """That two greedy `generate` outputs (`return_dict_in_generate=True, output_scores=True`) agree: the same tokens,
    and scores within atol and rtol. With `near_tie` > 0 (bf16, where two engines round in different places), a row
    may part from the reference at a step where the reference scored the other engine's token below its best by at
    most `near_tie` times the best's magnitude (a near tie that either rounding can break); that row is compared up
    to and including that step. Without it, every token must be the same."""
    ref_scores, fast_scores = torch.stack(reference.scores).float(), torch.stack(fast.scores).float()  # [T, B, V]
    steps = ref_scores.shape[0]
    prompt = reference.sequences.shape[1] - steps
    assert torch.equal(reference.sequences[:, :prompt], fast.sequences[:, :prompt])
    for row in range(reference.sequences.shape[0]):
        ref, got = reference.sequences[row, prompt:], fast.sequences[row, prompt:]
        parted = (ref != got).nonzero()
        end = steps if len(parted) == 0 else int(parted[0])
        if end < steps:
            scores = ref_scores[end, row]
            best, other = scores[ref[end]], scores[got[end]]
            assert near_tie > 0 and best - other <= near_tie * best.abs(), (
                f"row {row} parts from the reference at new token {end}: {int(got[end])} (scored {other:.6g} by the "
                f"reference) for {int(ref[end])} (scored {best:.6g}), not a near tie")
        compared = min(end + 1, steps)
        torch.testing.assert_close(ref_scores[:compared, row], fast_scores[:compared, row], atol=atol, rtol=rtol)


def cpu_has_avx2_fma() -> bool:
    """Whether this CPU has AVX2 and FMA (Linux's /proc/cpuinfo; False where it cannot be read), as the test's
    oracle for what hf_moe's kernels pick, independent of them."""
    try:
        with open("/proc/cpuinfo") as f:
            return {"avx2", "fma"} <= set(f.read().split())
    except OSError:
        return False


def random_ids(batch: int = 2, length: int = 12, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


# --------------------------------------------------------------------------------------------------------------------
# Threads: the cores shared out among pytest-xdist's workers
# --------------------------------------------------------------------------------------------------------------------
def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# torch's intra-op threads per test process: the cores over pytest-xdist's workers (None outside xdist). Two workers on
# two cores, each with torch's default of a thread per core, ran every parallel region on four threads over two cores,
# and OpenMP's threads spin while they wait for each other: a Trainer test took 26 s in the suite against 2.8 s alone
# (benchmarks/results/test_durations.txt has the suite's times).
WORKER_THREADS = (max(1, _cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
                  if os.environ.get("PYTEST_XDIST_WORKER_COUNT") else None)


# The environment when the session starts, before any test or library changes it: what `fresh_python` runs under.
SESSION_ENV = pytest.StashKey[dict]()


def pytest_configure(config):
    if WORKER_THREADS is not None:
        torch.set_num_threads(WORKER_THREADS)
        # The processes tests start (CLIs, README blocks, launchers) share the worker's cores too.
        os.environ.setdefault("OMP_NUM_THREADS", str(WORKER_THREADS))
    config.stash[SESSION_ENV] = dict(os.environ)


# --------------------------------------------------------------------------------------------------------------------
# Order: each worker's share of the tests starts with its long files
# --------------------------------------------------------------------------------------------------------------------
DURATIONS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "test_durations.txt"
_FILE_LINE = re.compile(r"^\s*([0-9.]+)\s+[0-9]+\s+(tests/\S+\.py)\s*$")


def file_seconds(table: Path = DURATIONS) -> dict[str, float]:
    """{"tests/test_x.py": seconds} from the "by file" section of the committed durations table ({} without it)."""
    try:
        lines = table.read_text().splitlines()
    except OSError:
        return {}
    return {found[2]: float(found[1]) for found in map(_FILE_LINE.match, lines) if found}


# A file this long by the table is placed whole in one worker's share; the others fill the shares in collection order.
LONG_FILE_S = 20.0


def worker_shares(files: dict[str, list], seconds: dict[str, float], workers: int) -> list[list]:
    """Tests ({file: its tests, in collection order}) in `workers` shares of the sizes pytest-xdist's work stealing
    gives the workers at the start, each share starting with its long files, longest first. The long files go, longest
    first, to the share with the fewest seconds; the short ones then fill every share to its size, in collection
    order."""
    total = sum(len(tests) for tests in files.values())
    sizes, left = [], total
    for k in range(workers):  # as `WorkStealingScheduling.check_schedule` first shares out the pending tests
        sizes.append(left // (workers - k))
        left -= sizes[-1]
    shares: list[list] = [[] for _ in range(workers)]
    loads = [0.0] * workers
    long = sorted((name for name in files if seconds.get(name, 0.0) >= LONG_FILE_S), key=lambda n: -seconds[n])
    for name in long:
        k = min(range(workers), key=lambda k: loads[k])
        shares[k].extend(files[name])
        loads[k] += seconds[name]
    short = [test for name, tests in files.items() if name not in long for test in tests]
    for k, share in enumerate(shares):
        room = max(sizes[k] - len(share), 0)
        share.extend(short[:room])
        del short[:room]
    shares[-1].extend(short)
    return shares


@pytest.hookimpl(trylast=True)  # after `-m` and `-k` have deselected: the shares are of what runs
def pytest_collection_modifyitems(config, items):
    """Each worker's share of the tests starts with its share of the long files (by the committed table). pytest-xdist's
    work stealing gives each worker a contiguous share of the collection, then an idle worker takes half of another's
    queue from its end: with every share front-loaded, what is left to share at the end is short, and no worker idles
    while the other runs a long test. (Every worker sorts the same collection the same way, as xdist requires.)"""
    seconds = file_seconds()
    root = Path(str(config.rootpath))
    files: dict[str, list] = {}
    for item in items:
        try:
            name = item.path.relative_to(root).as_posix()
        except ValueError:
            name = item.path.name
        files.setdefault(name, []).append(item)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    items[:] = [item for share in worker_shares(files, seconds, workers) for item in share]


@pytest.fixture(autouse=True)
def _worker_threads():
    """Each test starts with the worker's threads, whatever the test before it set."""
    if WORKER_THREADS is not None and torch.get_num_threads() != WORKER_THREADS:
        torch.set_num_threads(WORKER_THREADS)
    yield


@pytest.fixture
def two_threads():
    """Two intra-op threads for the test (the C++ kernels split a layer's rows over the threads; with one thread per
    worker that split would go untested)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def tiny_tokenizer():
    """A character-level fast tokenizer with < VOCAB ids, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?'\"-\n"
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(chars)}}
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


CORPUS = (
    "the quick brown fox jumps over the lazy dog. " * 3
    + "a mixture of experts routes each token to a few experts. "
    + "sparse models grow parameters without growing compute. "
)


class _Logits(torch.nn.Module):
    """A causal LM as a function of its input ids alone, returning its logits: what an exporter traces."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def logits_of_a_tiny_moe(which: str) -> torch.nn.Module:
    """A tiny MoE model for the export tests, in eval mode, as `input_ids -> logits`: "converted" (a Llama upcycled
    to 4 experts, with noise so the experts differ), "quantized" (the same with int8 experts) or "native_mixtral"
    (transformers' Mixtral on hf_moe's experts)."""
    import hf_moe

    torch.manual_seed(0)
    if which in ("converted", "quantized"):
        model = hf_moe.convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, noise=0.05)
        if which == "quantized":
            hf_moe.quantize_experts(model, "int8")
    else:
        config = AutoConfig.for_model("mixtral", vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                      num_experts_per_tok=2, intermediate_size=16)
        model = AutoModelForCausalLM.from_config(config, experts_implementation="hf_moe")
    return _Logits(model.eval())


def hub_cache(source: Path, cache: Path, repo: str = "org/moe", revision: str = "main", subfolder: str = "") -> Path:
    """Lay `source` out as huggingface_hub caches a download of `repo` (offline, nothing fetched): each file's bytes in
    blobs/<sha256>, snapshots/<commit>/[subfolder/]<file> a relative link to its blob, refs/<revision> naming the
    commit. Returns the snapshot's directory (the subfolder's)."""
    import hashlib

    root = cache / f"models--{repo.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest()
    snapshot = root / "snapshots" / commit / subfolder
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for path in sorted(source.iterdir()):
        if path.is_file():
            data = path.read_bytes()
            blob = root / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / revision).write_text(commit)
    return snapshot


# --------------------------------------------------------------------------------------------------------------------
# The tiny MoE checkpoint, built once per session (per pytest-xdist worker) and shared read-only
# --------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TinyMoE:
    """A tiny Llama upcycled to 4 experts in every layer, top-2 (exportable as Mixtral), with noise so that the
    experts differ, saved with its tokenizer. `logits` [2, 12, VOCAB]: the model's logits of `random_ids()` before
    saving."""

    path: Path
    logits: torch.Tensor


def _fingerprint(directory: Path) -> dict[str, tuple]:
    """{path relative to `directory`: (mode, size, mtime_ns)} of everything under it, links included."""
    found = {}
    for path in sorted(directory.rglob("*")):
        info = path.lstat()
        found[str(path.relative_to(directory))] = (info.st_mode, info.st_size, info.st_mtime_ns)
    return found


def changes(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    """The paths whose fingerprint differs between `before` and `after` (added, removed or changed)."""
    return sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))


def _set_writable(directory: Path, writable: bool) -> None:
    for path in [directory, *directory.rglob("*")]:
        if not path.is_symlink():
            mode = 0o755 if path.is_dir() else 0o644
            path.chmod(mode if writable else mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory):
    """The shared tiny MoE checkpoint (`TinyMoE`). Read-only: its files and directories have no write permission,
    and a test that changes it anyway (as root, where permissions do not stop a write) fails. A test that edits a
    checkpoint edits `copy_checkpoint(tiny_moe.path, tmp_path / ...)`."""
    import hf_moe

    directory = tmp_path_factory.mktemp("tiny_moe") / "moe"
    model = hf_moe.convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, noise=0.05).eval()
    model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    with torch.no_grad():
        logits = model(random_ids()).logits
    _set_writable(directory, False)
    yield TinyMoE(directory, logits)
    _set_writable(directory, True)  # so that pytest can remove its old temporary directories


@pytest.fixture(autouse=True)
def _tiny_moe_untouched(request):
    """Fails a test that changed the shared checkpoint (files, sizes, times or modes)."""
    if "tiny_moe" not in request.fixturenames:
        yield
        return
    directory = request.getfixturevalue("tiny_moe").path
    before = _fingerprint(directory)
    yield
    changed = changes(before, _fingerprint(directory))
    if changed:
        pytest.fail(f"{request.node.nodeid} changed the shared read-only checkpoint tiny_moe ({', '.join(changed)}): "
                    f"edit a copy, copy_checkpoint(tiny_moe.path, tmp_path / 'moe')", pytrace=False)


def copy_checkpoint(source: Path, destination: Path) -> Path:
    """A writable copy of the checkpoint directory `source` (its links copied as links). Returns `destination`."""
    shutil.copytree(source, destination, symlinks=True, copy_function=shutil.copyfile)
    _set_writable(destination, True)
    return destination


# --------------------------------------------------------------------------------------------------------------------
# The one-line counts some modules print (the hostile files, the fault suite): shown in pytest's closing summary,
# from pytest-xdist's workers too, without -s or -rA
# --------------------------------------------------------------------------------------------------------------------
_PENDING_LINES: list[str] = []
_COUNT_LINES: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _count_line(request):
    """A module's count line: the module's `count_line()` if it has one; every tests/test_hostile_*.py file gets
    hostile_support's (its hostile inputs, accepted ones and reads outside, counted while the module ran)."""
    count_line = getattr(request.module, "count_line", None)
    name = request.path.name
    if count_line is None and name.startswith("test_hostile"):
        import hostile_support

        count_line = hostile_support.counter(name)
    yield
    if count_line is not None:
        _PENDING_LINES.append(count_line())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The module's line rides on the report of its last test's teardown (when module fixtures finish)."""
    outcome = yield
    if call.when == "teardown" and _PENDING_LINES:
        outcome.get_result().user_properties.extend(("count line", line) for line in _PENDING_LINES)
        _PENDING_LINES.clear()


def pytest_runtest_logreport(report):
    _COUNT_LINES.extend(value for key, value in report.user_properties if key == "count line")


def pytest_terminal_summary(terminalreporter):
    if _COUNT_LINES:
        terminalreporter.section("counts")
        for line in _COUNT_LINES:
            terminalreporter.write_line(line)


@pytest.fixture
def plans(monkeypatch):
    """Every plan of the one-op decode step built (one per model, and again when its weights change), each counting
    its calls: a list that fills as plans are made."""
    import hf_moe.decode_one_op

    made = []

    class Recording(hf_moe.decode_one_op.DecodePlan):
        def __init__(self, *args):
            super().__init__(*args)
            self.calls = 0
            made.append(self)

        def __call__(self, *args):
            self.calls += 1
            return super().__call__(*args)

    monkeypatch.setattr(hf_moe.decode_one_op, "DecodePlan", Recording)
    return made


@pytest.fixture(scope="session")
def fresh_python(request, tmp_path_factory):
    """`fresh_python.run(code, *args, set_env=..., cwd=..., timeout=...)`: `python -c CODE ARGS` in a process hf_moe
    has not been imported into, under the session's starting environment and `set_env`, forked where that cannot
    differ from a fresh interpreter (tests/fresh_python.py)."""
    from fresh_python import FreshPython

    runner = FreshPython(tmp_path_factory.mktemp("fresh_python"), request.config.stash[SESSION_ENV])
    yield runner
    runner.close()
