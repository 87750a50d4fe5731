"""The guarded opener: special files (FIFOs, devices), links out, memory bombs, safetensors headers that
the reader refuses, base config values, config files under the checksums; and no read of a checkpoint's
file in the package bypasses hf_moe/checkpoint/guard.py."""

from __future__ import annotations

import codecs
import contextlib
import json
import math
import os
import re
import shutil
import stat
import struct
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM
from hostile_support import (
    copy_of,
    edit_json,
    expert_file,
    hostile,
    outside,  # noqa: F401 (fixture)
    record_checksums,
    refused,
    refused_under_verify,
    saved,  # noqa: F401 (fixture)
)

import hf_moe.checkpoint as checkpoint
from hf_moe import MoEForCausalLM
from hf_moe.cli import main as cli


ROOT = Path(__file__).resolve().parents[1]


# -- The guarded opener: special files, links out, memory bombs, headers the safetensors reader refuses --------------
class FifoWatchdog:
    """Opens the write end of FIFOs that a reader is blocked on (and closes it: the reader sees end of file), so a
    reader that does block ends instead of hanging the test. `blocked` counts the readers it freed."""

    def __init__(self, *paths: Path):
        import threading

        self.fifos = [p for p in paths if os.path.lexists(p) and stat.S_ISFIFO(os.lstat(p).st_mode)]
        self.blocked, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.wait(0.05):
            for fifo in self.fifos:
                with contextlib.suppress(OSError):  # ENXIO: no reader has it open
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                    self.blocked += 1

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def _special_file(path: Path, kind: str) -> None:
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:  # a character device: /dev/null (which reads as empty, so a reader that does not refuse it cannot hang)
        try:
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("mknod of a character device is not permitted here")


@pytest.mark.parametrize("kind", ["fifo", "chardev"])
@pytest.mark.parametrize("name", ["config.json", checkpoint.INDEX_NAME, "generation_config.json",
                                  "model-expert-00001.safetensors"])
def test_special_files_are_refused_without_blocking(saved, tmp_path, capsys, name, kind):
    """A FIFO or a device where a checkpoint file belongs is refused, naming it, before any read: a FIFO would block
    the loader forever, /dev/zero would fill its memory."""
    directory = copy_of(saved[0], tmp_path / "moe")
    _special_file(directory / name, kind)
    what = "named pipe" if kind == "fifo" else "character device"
    hostile()
    with FifoWatchdog(directory / name) as watchdog:
        refused(lambda: MoEForCausalLM.from_pretrained(directory), name, what)
        capsys.readouterr()
        assert cli(["verify", str(directory)]) == 1
        assert what in capsys.readouterr().err
        refused(lambda: MoEForCausalLM.from_pretrained(directory, offload_experts="disk", max_expert_memory="1GB"),
                name, what)
    assert watchdog.blocked == 0  # no reader ever opened it


def test_a_symlinked_generation_config_is_not_read(saved, outside, tmp_path, capsys):
    """generation_config.json linked out of the checkpoint: transformers would read it with the model (and its values
    would land in model.generation_config); from_pretrained, the Auto classes and export refuse it first."""
    directory = copy_of(saved[0], tmp_path / "moe")
    bait = outside.directory / "generation_config.json"
    bait.write_text(json.dumps({"max_length": 4242, "bos_token_id": 1}))
    (directory / "generation_config.json").unlink()
    os.symlink(bait, directory / "generation_config.json")
    outside.arm()
    hostile()
    refused(lambda: MoEForCausalLM.from_pretrained(directory), "generation_config.json", "outside")
    refused(lambda: AutoModelForCausalLM.from_pretrained(directory), "generation_config.json", "outside")
    assert cli(["export", str(directory), str(tmp_path / "native")]) == 2
    assert "generation_config.json" in capsys.readouterr().err and not (tmp_path / "native").exists()


@pytest.mark.parametrize("how", ["symlinked tokenizer", "fifo tokenizer"])
def test_generate_reads_the_tokenizer_through_the_guard(saved, outside, tmp_path, capsys, how):
    from conftest import tiny_tokenizer

    directory = copy_of(saved[0], tmp_path / "moe")
    tiny_tokenizer().save_pretrained(directory)
    if how == "symlinked tokenizer":
        bait = outside.directory / "tokenizer.json"
        shutil.copy(directory / "tokenizer.json", bait)
        (directory / "tokenizer.json").unlink()
        os.symlink(bait, directory / "tokenizer.json")
    else:
        _special_file(directory / "tokenizer.json", "fifo")
    outside.arm()
    hostile()
    with FifoWatchdog(directory / "tokenizer.json") as watchdog:
        assert cli(["generate", str(directory), "hi", "--max-new-tokens", "2"]) == 2
    assert "tokenizer.json" in capsys.readouterr().err and watchdog.blocked == 0


def _rewrite_header(path: Path, change) -> None:
    """Rewrite a safetensors file with `change(header_dict) -> bytes` as its header (any length; data unchanged)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = change(json.loads(raw[8 : 8 + n]))
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n :])


def _with_zero_size(header: dict, shape, shape_text: str | None = None) -> bytes:
    header["zero"] = {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}
    text = json.dumps(header)
    return (text if shape_text is None else text.replace(json.dumps(shape), shape_text)).encode()


def _every_dtype(header: dict, dtype) -> bytes:
    return json.dumps({k: v if k == "__metadata__" else {**v, "dtype": dtype} for k, v in header.items()}).encode()


HEADER_CASES = {
    "byte-order mark": lambda h: codecs.BOM_UTF8 + json.dumps(h).encode(),
    "UTF-16": lambda h: json.dumps(h).encode("utf-16"),
    "zero-size, a dim past int64": lambda h: _with_zero_size(h, [0, 2**63]),
    "zero-size, overflowing before its 0": lambda h: _with_zero_size(h, [2**40, 2**40, 0]),
    "zero-size, negative zero": lambda h: _with_zero_size(h, [0, 5], "[-0, 5]"),
    "lone surrogate key": lambda h: _with_zero_size(h, [0]).replace(b'"zero"', b'"\\ud800"'),
    "dtype a list": lambda h: _every_dtype(h, ["F32"]),
    "dtype a dict": lambda h: _every_dtype(h, {"F32": 1}),
}


@pytest.mark.parametrize("case", sorted(HEADER_CASES))
def test_headers_the_safetensors_reader_refuses_are_refused_first(saved, tmp_path, capsys, case):
    """Headers that passed hf_moe's checks but not the safetensors reader (verify said OK, loading raised a raw
    error naming no file), or crashed the checks (a list as dtype: unhashable): refused, naming the file, by the
    checks of every load and by `hf-moe verify`, even with checksums recorded to match (a consistent edit)."""
    directory = copy_of(saved[0], tmp_path / "moe")
    path = expert_file(directory)
    _rewrite_header(path, HEADER_CASES[case])
    record_checksums(directory, path)
    hostile()
    refused(lambda: MoEForCausalLM.from_pretrained(directory), path.name)
    capsys.readouterr()
    assert cli(["verify", str(directory)]) == 1
    assert path.name in capsys.readouterr().err


def _json_bomb(values: int) -> bytes:
    """A JSON object holding `values` empty lists (3 bytes each)."""
    return b'{"x": [' + b"[]," * (values - 1) + b"[]]}"


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.mark.parametrize("where", ["header", "index", "config"])
def test_memory_bombs_are_refused_before_parsing(saved, tmp_path, where):
    """JSON that parses into millions of objects (a header of empty lists, each a Python object once parsed), or a
    config or an index past its size limit: refused at once, in bounded memory, naming the file."""
    import time

    directory = copy_of(saved[0], tmp_path / "moe")
    if where == "header":
        path = expert_file(directory)
        _rewrite_header(path, lambda h: _json_bomb(25_000_000))
        record_checksums(directory, path, tensors=False)
        named = path.name
    elif where == "index":  # a consistent index, with 3 million values of junk beside its entries
        index = json.loads((directory / checkpoint.INDEX_NAME).read_text())
        index["junk"] = [0] * 3_000_000
        (directory / checkpoint.INDEX_NAME).write_text(json.dumps(index))
        named = checkpoint.INDEX_NAME
    else:  # a config past the size limit of config files (MAX_CONFIG_BYTES)
        edit_json(directory / "config.json", lambda config: config.update(notes="x" * 20_000_000))
        named = "config.json"
    hostile()
    before, start = _peak_rss_bytes(), time.perf_counter()
    refused(lambda: MoEForCausalLM.from_pretrained(directory), named)
    assert time.perf_counter() - start < 10
    assert _peak_rss_bytes() - before < 400 << 20


def test_absurd_shared_experts_are_refused_before_any_allocation(saved, tmp_path, capsys):
    """num_shared_experts: 5000 in a checkpoint saved with none: verify said OK and loading allocated them before
    transformers noticed the missing tensors. The checks compare every tensor the config calls for with the index."""
    directory = copy_of(saved[0], tmp_path / "moe")
    edit_json(directory / "config.json", lambda config: config.update(num_shared_experts=5000))
    hostile()
    before = _peak_rss_bytes()
    refused(lambda: MoEForCausalLM.from_pretrained(directory), "config.json", "shared_expert")
    assert _peak_rss_bytes() - before < 400 << 20
    capsys.readouterr()
    assert cli(["verify", str(directory)]) == 1


BASE_VALUES = {
    "rms_norm_eps NaN": ({"rms_norm_eps": math.nan}, "rms_norm_eps"),
    "rms_norm_eps -1": ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
    "rope_theta NaN": ({"rope_parameters": {"rope_theta": math.nan, "rope_type": "default"}}, "rope_theta"),
    "attention_dropout 2": ({"attention_dropout": 2.0}, "attention_dropout"),
    "no attention heads": ({"num_attention_heads": 0}, "num_attention_heads"),
    "head_dim 0": ({"head_dim": 0}, "head_dim"),
    "vocab_size a string": ({"vocab_size": "256"}, "vocab_size"),
    "eos_token_id a string": ({"eos_token_id": "2"}, "eos_token_id"),
    "bos_token_id a float": ({"bos_token_id": 1.5}, "bos_token_id"),
    "an attention implementation not installed": ({"_attn_implementation": "flash_attention_2"}, "config.json"),
    "a million layers": ({"num_hidden_layers": 10**6}, "num_hidden_layers"),
}


@pytest.mark.parametrize("case", sorted(BASE_VALUES))
def test_base_config_values_are_checked(saved, tmp_path, capsys, case):
    """The base model's values: NaN or negative epsilons and rope_theta loaded under verification and computed NaN
    (or silently other) logits; zero heads, a string vocabulary, a token id that is no int, an attention
    implementation that is not installed escaped as ZeroDivisionError, AssertionError, ImportError. (A token id past
    the vocabulary loads, as in transformers: tests/test_families.py.) Each is refused
    naming config.json and the field, by every load and by `hf-moe verify` (before any checksum: the message says
    what is wrong, not only that the file changed)."""
    edit, text = BASE_VALUES[case]
    directory = copy_of(saved[0], tmp_path / "moe")
    edit_json(directory / "config.json", lambda config: config.update(edit))
    hostile()
    refused(lambda: MoEForCausalLM.from_pretrained(directory), "config.json", text)
    capsys.readouterr()
    assert cli(["verify", str(directory)]) == 1
    err = capsys.readouterr().err
    assert "config.json" in err and "Traceback" not in err


@pytest.mark.parametrize("name,change", [
    ("config.json", lambda c: c.update(num_experts_per_tok=1)),
    ("config.json", lambda c: c.update(norm_topk_prob=False)),
    ("config.json", lambda c: c.update(auto_map={"AutoModelForCausalLM": "other_module.Model"})),
    ("generation_config.json", lambda c: c.update(max_length=7)),
    ("modeling_hf_moe.py", None),
])
def test_config_files_are_covered_by_the_checksums(saved, tmp_path, capsys, name, change):
    """config.json, generation_config.json and the auto_map shim (which older hf_moe wrote: one added is an edit too)
    decide what the weights compute: an edit is a changed checkpoint (verify used to say OK while the logits changed).
    `hf-moe verify --update` records an edit made on purpose, after which the checkpoint loads with it."""
    directory = copy_of(saved[0], tmp_path / "moe")
    if change is None:
        with open(directory / name, "a") as f:
            f.write("\nimport os  # an edit\n")
    else:
        edit_json(directory / name, change)
    hostile()
    message = refused(lambda: MoEForCausalLM.from_pretrained(directory), name, "hf-moe verify --update")
    assert "changed since the save" in message or (name == "modeling_hf_moe.py" and "added after the save" in message)
    refused_under_verify(directory, name)
    capsys.readouterr()
    assert cli(["verify", str(directory)]) == 1
    assert name in capsys.readouterr().err
    assert cli(["verify", "--update", str(directory)]) == 0
    assert name in capsys.readouterr().out
    if name == "config.json" and "auto_map" not in message:
        MoEForCausalLM.from_pretrained(directory)


# -- One guarded opener: no read of a checkpoint file bypasses hf_moe/checkpoint/guard.py ----------------------------
_READS = re.compile(r"\bopen\(|\.read_bytes\(|\.read_text\(|safe_open\(|load_file\(|torch\.load\(|shutil\.copy|"
                    r"copyfile\(|mmap\.mmap\(|fromfile\(")
# Every other read in the package, with why it is not a read of a checkpoint's file: (file, text of the line).
NOT_CHECKPOINT_FILES = {
    ("hf_moe/ops/extension.py", "data = (csrc / name).read_bytes()"): "hashes hf_moe's C++ sources (the build's key)",
    ("hf_moe/ops/extension.py", "text = path.read_bytes()"): "hf_moe's C++ sources and headers (the compile "
                                                             "estimate)",
    ("hf_moe/ops/extension.py", 'open(build_dir / "hf_moe-build.lock", "a")'): "the extension build cache's lock",
    ("hf_moe/ops/extension.py", "Path(spec.origin).read_bytes()"): "the compiled extension's own file",
    ("hf_moe/model_card.py", "(TEMPLATES / name).read_text()"): "the model card templates shipped in the package",
    ("hf_moe/offload/stats.py", 'open("/proc/self/status")'): "this process's memory statistics",
    ("hf_moe/convert/merge_config.py", 'open(path, "rb")'): "the start of a calibration text file the recipe names",
    ("hf_moe/inputs.py", 'open(path, "rb")'): "a file the user names, parsed whole (a merge recipe, a .json of records)",
    ("hf_moe/inputs.py", 'open(path, encoding="utf-8"'): "the text the user names (--data, calibration_data), in pieces",
    ("hf_moe/convert/stream.py", "os.open(self.directory / filename, flags"): "writes its own staging files",
    ("hf_moe/checkpoint/commit.py", "os.open(lock, "): "creates the writer's lock file beside OUT",
    ("hf_moe/checkpoint/commit.py", "os.open(_lock_path(target, token)"): "locks a writer's lock file beside OUT",
    ("hf_moe/checkpoint/commit.py", "shutil.copytree(src, dst"): "carries the old OUT's unrelated files (links them)",
    ("hf_moe/checkpoint/commit.py", "shutil.copy2(src, dst"): "carries an unrelated file where it cannot be linked",
    ("hf_moe/checkpoint/commit.py", "os.open(staging, "): "writes a file's staged replacement (replace_file)",
    ("hf_moe/memory.py", 'open(os.path.join(proc, "meminfo"))'): "the machine's available memory",
    ("hf_moe/memory.py", 'open(os.path.join(proc, "self", "cgroup"))'): "this process's cgroups",
    ("hf_moe/memory.py", "open(os.path.join(directory, limit_file))"): "a cgroup's memory limit",
    ("hf_moe/memory.py", 'open(os.path.join(directory, "memory.stat"))'): "a cgroup's reclaimable page cache",
    ("hf_moe/memory.py", "open(os.path.join(directory, usage_file))"): "a cgroup's memory use",
    ("hf_moe/checkpoint/snapshot.py", "os.open(directory, os.O_RDONLY"): "opens the directory itself, to lock it",
    ("hf_moe/checkpoint/snapshot.py", "os.open(_turnstile(directory)"): "the readers' turnstile lock beside OUT",
    ("hf_moe/checkpoint/snapshot.py", "os.open(_turnstile(target)"): "the writers' turnstile lock beside OUT",
    ("hf_moe/parallel/training_state.py", "torch.load(io.BytesIO(data)"): "bytes read through the guard",
    ("hf_moe/ops/extension.py", "float(path.read_text()"): "the build cache's record of the last build's seconds",
    ("hf_moe/gpu_check/record.py", "json.loads(path.read_text())"): "gpu_check's own results.json (--out)",
    ("hf_moe/gpu_check/runner.py", 'open(output, "w")'): "writes a step's output file in gpu_check's --out",
    ("hf_moe/gpu_check/runner.py", "output.read_text(errors="): "reads back a step's output file (--out)",
    ("hf_moe/gpu_check/runner.py", 'open(log, "a")'): "appends to gpu_check's logs.txt (--out)",
    ("hf_moe/forkserver.py", 'open("/proc/self/maps")'): "this process's memory map (the OpenBLAS libraries loaded)",
    ("hf_moe/huge_pages.py", 'open("/sys/kernel/mm/transparent_hugepage/enabled")'): "the kernel's huge-page setting",
    ("hf_moe/forkserver.py", "os.open(os.devnull"): "/dev/null, as a forked child's stdin",
    ("hf_moe/forkserver.py", 'os.open(request["output"]'): "writes a forked child's stdout (a file its caller names)",
    ("hf_moe/forkserver.py", 'os.open(request["errors"]'): "writes a forked child's stderr (a file its caller names)",
    ("hf_moe/forkserver.py", 'open(log, "wb")'): "writes the fork server's own stderr (a file its caller names)",
    ("hf_moe/gpu_check/steps.py", "json.loads(found.read_text())"): "gpu_check's kernel launch counts (temp dir)",
    ("hf_moe/gpu_check/bench.py", 'json.loads((report.out / "results.json").read_text())'): "the bench's own "
                                                                                             "results.json (--out)",
    ("hf_moe/gpu_check/decode_bench.py", "json.loads(meta.read_text())"): "the bench's record of its Llama step "
                                                                           "(its work directory)",
    ("hf_moe/gpu_check/decode_bench.py", 'torch.load(saved / "probe.pt")'): "the probe the bench's Llama step saved "
                                                                             "beside its checkpoint",
}


def test_every_read_of_a_checkpoint_file_goes_through_the_guard():
    """Greps the package for reads of files (open, read_bytes, read_text, safe_open, load_file, torch.load, copies,
    mappings): each is in hf_moe/checkpoint/guard.py, or allow-listed here with the reason it reads no checkpoint
    file. A new read of a checkpoint file must go through the guard (or come here with a reason)."""
    found, unused = [], dict(NOT_CHECKPOINT_FILES)
    for path in sorted((ROOT / "hf_moe").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative == "hf_moe/checkpoint/guard.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not _READS.search(line) or line.lstrip().startswith("#"):
                continue
            key = next((k for k in NOT_CHECKPOINT_FILES if k[0] == relative and k[1] in line), None)
            if key is None:
                found.append(f"{relative}:{number}: {line.strip()}")
            unused.pop(key, None)
    assert not found, "reads that bypass hf_moe/checkpoint/guard.py:\n" + "\n".join(found)
    assert not unused, f"allow-list entries that match nothing any more: {sorted(unused)}"
