"""Activations saved for backward by one MoE block, against the dense MLP with the same active FLOPs; and the memory
a request may use (`hf_moe.memory.available_memory`) under cgroup v1 and v2 limits, on fake cgroup trees and on a
real v1 child cgroup where the machine allows one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from hf_moe import MoEConfig, SparseMoeBlock
from hf_moe.memory import available_memory
from hf_moe.ops import use_backend
from hf_moe.profiling import saved_activation_bytes


@pytest.mark.parametrize("num_experts,top_k,inter,backend", [
    (8, 2, 1024, "compiled"), (8, 2, 1024, "torch"), (64, 8, 256, "compiled"),
    pytest.param(64, 8, 256, "torch", marks=pytest.mark.slow),  # (the inner loop has both shapes and both backends)
])
def test_saved_activations_within_1_1x_of_dense(num_experts, top_k, inter, backend):
    hidden, tokens = 512, 512
    base = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1, num_attention_heads=8)
    block = SparseMoeBlock(MoEConfig.from_base(base, num_experts=num_experts, num_experts_per_tok=top_k))
    dense = LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=top_k * inter))
    x = torch.randn(1, tokens, hidden, requires_grad=True)
    with use_backend(backend):
        moe_bytes = saved_activation_bytes(block, x)
    dense_bytes = saved_activation_bytes(dense, x)
    assert moe_bytes <= 1.1 * dense_bytes, (moe_bytes, dense_bytes)
    # No [tokens, experts]-sized masks beyond the router's own logits/probabilities: everything else the block
    # keeps scales with tokens x (hidden + 2 x top_k x intermediate).
    assert moe_bytes < 4 * tokens * (hidden + 2 * top_k * inter + 4 * num_experts) + 64 * tokens * top_k


# ------------------------------------------------------------------------------------------ memory under cgroups
MiB, GiB = 1 << 20, 1 << 30
V1_UNLIMITED = 9223372036854771712  # what cgroup v1 reads back for "no limit" (the largest page count x 4 KiB)


def fake_machine(tmp_path: Path, proc_cgroup: str, files: dict[str, str | int], mem_available: int = 64 * GiB):
    """(proc, cgroup_root) of a fake machine: /proc/meminfo with `mem_available` bytes, /proc/self/cgroup with
    `proc_cgroup`, and `files` (paths under the cgroup root -> contents) as its cgroup filesystems."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: {128 * GiB // 1024} kB\nMemAvailable: {mem_available // 1024} kB\n")
    (proc / "self" / "cgroup").write_text(textwrap.dedent(proc_cgroup).strip() + "\n")
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{text}\n")
    return str(proc), str(root)


V1_CGROUP = """
    5:devices:/
    4:memory:/hf_moe_bench/engine
    1:name=systemd:/
    0::/
"""


def v1_group(path: str, limit: int, usage: int, inactive_file: int = 0, hierarchical: int | None = None):
    stat = f"cache {inactive_file}\ntotal_inactive_file {inactive_file}\n"
    if hierarchical is not None:
        stat += f"hierarchical_memory_limit {hierarchical}\n"
    return {f"memory/{path}/memory.limit_in_bytes": limit, f"memory/{path}/memory.usage_in_bytes": usage,
            f"memory/{path}/memory.stat": stat}


def v2_group(path: str, limit: int | str, usage: int, inactive_file: int = 0):
    prefix = f"{path}/" if path else ""
    stat = f"anon {usage - inactive_file}\nfile {inactive_file}\ninactive_file {inactive_file}"
    return {f"{prefix}memory.max": limit, f"{prefix}memory.current": usage, f"{prefix}memory.stat": stat}


def test_a_cgroup_v1_memory_limit_bounds_the_memory_available(tmp_path):
    files = {**v1_group("", V1_UNLIMITED, 100 * GiB), **v1_group("hf_moe_bench", V1_UNLIMITED, 600 * MiB),
             **v1_group("hf_moe_bench/engine", GiB, 600 * MiB, inactive_file=100 * MiB)}
    assert available_memory(*fake_machine(tmp_path, V1_CGROUP, files)) == GiB - 500 * MiB


def test_the_unlimited_sentinel_of_cgroup_v1_and_max_of_v2_leave_the_host_memory_available(tmp_path):
    files = {**v1_group("", V1_UNLIMITED, 100 * GiB), **v1_group("hf_moe_bench/engine", V1_UNLIMITED, 600 * MiB),
             **v2_group("", "max", 90 * GiB)}
    assert available_memory(*fake_machine(tmp_path, V1_CGROUP, files, mem_available=3 * GiB)) == 3 * GiB
    v2 = {**v2_group("user.slice/app", "max", 5 * GiB), "cgroup.controllers": "memory"}
    assert available_memory(*fake_machine(tmp_path / "v2", "0::/user.slice/app", v2, 3 * GiB)) == 3 * GiB


def test_cgroup_v2_counts_the_reclaimable_page_cache_as_room(tmp_path):
    # 1.9 GiB charged under a 2 GiB limit, 1.5 GiB of it clean page cache the kernel drops before an OOM kill.
    files = {**v2_group("", 2 * GiB, 1900 * MiB, inactive_file=1536 * MiB), "cgroup.controllers": "memory"}
    assert available_memory(*fake_machine(tmp_path, "0::/", files)) == 2 * GiB - (1900 - 1536) * MiB


def test_cgroup_v2_reads_the_process_own_cgroup_not_the_root(tmp_path):
    # The root cgroup has no memory.max; the limit is on the process's own cgroup (a systemd service, a scope).
    files = {"cgroup.controllers": "memory", "memory.stat": "inactive_file 0",
             **v2_group("system.slice/job.service", GiB, 256 * MiB)}
    assert available_memory(*fake_machine(tmp_path, "0::/system.slice/job.service", files)) == GiB - 256 * MiB


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_parent_cgroup_tighter_than_the_process_own_bounds_the_memory_available(tmp_path, version):
    # The parent's 1 GiB limit is 900 MiB used (by siblings too); the process's own cgroup allows 4 GiB.
    if version == "v1":
        files = {**v1_group("hf_moe_bench", GiB, 900 * MiB), **v1_group("hf_moe_bench/engine", 4 * GiB, 100 * MiB)}
        machine = fake_machine(tmp_path, V1_CGROUP, files)
    else:
        files = {**v2_group("bench", GiB, 900 * MiB), **v2_group("bench/engine", 4 * GiB, 100 * MiB)}
        machine = fake_machine(tmp_path, "0::/bench/engine", files)
    assert available_memory(*machine) == GiB - 900 * MiB


def test_a_container_limit_above_the_mounted_cgroup_counts_through_hierarchical_memory_limit(tmp_path):
    # Docker without a cgroup namespace: /proc/self/cgroup names /docker/ID from the host's root, the hierarchy is
    # mounted at the container's own cgroup, and the limit set on a parent shows only in memory.stat.
    files = v1_group("", V1_UNLIMITED, 300 * MiB, inactive_file=200 * MiB, hierarchical=512 * MiB)
    machine = fake_machine(tmp_path, "4:memory:/docker/0123abcd", files)
    assert available_memory(*machine) == 512 * MiB - 100 * MiB


def test_the_memory_available_is_the_least_of_the_host_and_the_cgroup_room(tmp_path):
    files = v1_group("hf_moe_bench/engine", 8 * GiB, GiB)
    assert available_memory(*fake_machine(tmp_path, V1_CGROUP, files, mem_available=2 * GiB)) == 2 * GiB
    assert available_memory(*fake_machine(tmp_path / "b", V1_CGROUP, files, mem_available=16 * GiB)) == 7 * GiB
    # A cgroup over its limit (usage past it while the kernel reclaims) has no room, not a negative one.
    over = v2_group("", GiB, GiB + MiB)
    assert available_memory(*fake_machine(tmp_path / "c", "0::/", over)) == 0


def test_unreadable_cgroup_files_leave_the_host_memory_available(tmp_path):
    files = {**v1_group("hf_moe_bench/engine", 8 * GiB, GiB), "memory/hf_moe_bench/engine/memory.limit_in_bytes": "x",
             **v2_group("", 2 * GiB, GiB), "memory.current": "?"}
    assert available_memory(*fake_machine(tmp_path, V1_CGROUP, files, mem_available=3 * GiB)) == 3 * GiB
    proc, root = fake_machine(tmp_path / "b", "garbage\n4:memory", {})
    assert available_memory(proc, root) == 64 * GiB
    assert available_memory(str(tmp_path / "none"), str(tmp_path / "none")) is None


def own_v1_memory_cgroup() -> tuple[Path | None, str]:
    """(directory of this process's own cgroup v1 memory controller, "") where a child of it can be created here, or
    (None, why not)."""
    if sys.platform != "linux":
        return None, f"cgroups are Linux's, and this is {sys.platform}"
    mount = Path("/sys/fs/cgroup/memory")
    if not (mount / "memory.limit_in_bytes").is_file():
        return None, "no cgroup v1 memory controller mounted at /sys/fs/cgroup/memory"
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    path = next((line.split(":", 2)[2] for line in lines if "memory" in line.split(":", 2)[1].split(",")), None)
    own = mount / path.strip("/") if path is not None else None
    if own is None or not own.is_dir():
        return None, f"this process's memory cgroup ({path}) is not under {mount} (a container's own mount)"
    if os.geteuid() != 0 or not os.access(own, os.W_OK):
        return None, f"creating a child cgroup under {own} needs root (this is uid {os.geteuid()})"
    return own, ""


@pytest.mark.subprocess
def test_a_real_cgroup_v1_limit_bounds_the_memory_available_and_its_page_cache_does_not(tmp_path):
    own, why = own_v1_memory_cgroup()
    if own is None:
        pytest.skip(why)
    limit = 96 * MiB
    group = own / f"hf_moe_test_memory_{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit))
        # A child inside the limit: a plain Python (hf_moe.memory is a leaf, loaded by its path so that importing
        # hf_moe's torch does not fill the cgroup), which then writes a 48 MiB file, charged to the cgroup as clean
        # page cache once synced.
        memory_py = Path(__file__).resolve().parents[1] / "hf_moe" / "memory.py"
        code = textwrap.dedent(f"""
            import importlib.util, os
            spec = importlib.util.spec_from_file_location("memory", {str(memory_py)!r})
            memory = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(memory)
            before = memory.available_memory()
            with open({str(tmp_path / "cache.bin")!r}, "wb") as f:
                for _ in range(48):
                    f.write(b"x" * (1 << 20))
                f.flush()
                os.fsync(f.fileno())
            print(before, memory.available_memory())
        """)
        cmd = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(group / "cgroup.procs"), sys.executable, "-I", "-c", code]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        before, after = map(int, done.stdout.split())
        usage = int((group / "memory.max_usage_in_bytes").read_text())
    finally:
        (group / "memory.force_empty").write_text("0")
        group.rmdir()
    assert available_memory() > 2 * limit  # the host has more: what bounds the child is its cgroup
    assert limit - usage <= before <= limit, (before, usage)
    # The 48 MiB of page cache the child wrote is reclaimable: its room shrank by its own growth, not by the cache.
    assert after >= before - 16 * MiB, (before, after)
