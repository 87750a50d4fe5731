"""Hostile numbers: every number from a user or a file is checked where it enters (finite, in range, the right type),
a saved checkpoint always reloads, and every size a request implies is estimated and refused before anything is
allocated, with the sizes and what to do.

Covered: the MoE config fields however they are set (config.json, `from_pretrained`'s keyword arguments, assignment)
and saved; the scales of int8 linear layers and experts (non-finite from diverged weights, or finite but huge); the
budget of `python -m hf_moe.gpu_check` and of scripts/first_light.sh; the static KV cache of `generate` (Python and
`hf-moe generate`) and the offloaded experts' cache, against the memory free. The module prints one line
(`count_line`, in pytest's closing "counts" section):

    test_hostile_inputs.py: N hostile inputs refused with a message, 0 accepted
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import hostile_support
import pytest
import torch
from conftest import random_ids, tiny_dense, tiny_tokenizer

import hf_moe
import hf_moe.offload.cache as offload_cache
from hf_moe import CheckpointError, MoEConfig, MoEForCausalLM, generation, gpu_check
from hf_moe.checkpoint import INDEX_NAME
from hf_moe.checkpoint.checksums import checksum_files
from hf_moe.cli import main as cli
from hf_moe.decode import ONE_OP, DecodeChoice
from hf_moe.gpu_check.record import Report
from hf_moe.gpu_check.runner import StepSpec, run_steps

ROOT = Path(__file__).resolve().parent.parent
COUNTS = {"refused": 0}


def count_line() -> str:
    """This module's line in pytest's closing "counts" section (tests/conftest.py)."""
    return f"test_hostile_inputs.py: {COUNTS['refused']} hostile inputs refused with a message, 0 accepted"


def refused(call, *names: str, error=ValueError) -> str:
    """hostile_support.refused (`call` must raise `error` naming each of `names`; the message), counted here."""
    message = hostile_support.refused(call, *names, error=error)
    COUNTS["refused"] += 1
    return message


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(random_ids()).logits


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny hf_moe checkpoint (Llama, 4 experts top-2) with its tokenizer."""
    path = tmp_path_factory.mktemp("moe") / "moe"
    hf_moe.convert_to_moe(tiny_dense(), num_experts=4, top_k=2, noise=0.1).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


# --------------------------------------------------------------------------------------------------------------
# The MoE config: every field checked however it is set, and never saved unsound
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [math.nan, -1.0, 1e9, "0.3"], ids=["nan", "-1", "1e9", "str"])
def test_router_skip_threshold_out_of_range_is_refused_where_it_enters(saved, tmp_path, value):
    """`from_pretrained(dir, router_skip_threshold=...)` took NaN, -1 and 1e9 and `save_pretrained` wrote them, after
    which every load refused the checkpoint; the string "0.3" failed only at the first forward, with a TypeError.
    Now each is refused where it enters: the keyword argument, the config's construction, an assignment."""
    refused(lambda: MoEForCausalLM.from_pretrained(saved, router_skip_threshold=value), "router_skip_threshold")
    base = tiny_dense().config
    refused(lambda: MoEConfig.from_base(base, num_experts=4, num_experts_per_tok=2, router_skip_threshold=value),
            "router_skip_threshold")
    model = MoEForCausalLM.from_pretrained(saved)

    def assign():
        model.config.router_skip_threshold = value

    refused(assign, "router_skip_threshold", "[0, 1]" if not isinstance(value, str) else "a number")
    assert model.config.router_skip_threshold == 0.0
    model.save_pretrained(tmp_path / "out")  # what is saved reloads
    MoEForCausalLM.from_pretrained(tmp_path / "out")


FIELDS = {
    "router_aux_loss_coef nan": ("router_aux_loss_coef", math.nan),
    "router_z_loss_coef -1": ("router_z_loss_coef", -1.0),
    "capacity_factor inf": ("capacity_factor", math.inf),
    "eval_capacity_factor 0": ("eval_capacity_factor", 0.0),
    "router_jitter_noise 1.5": ("router_jitter_noise", 1.5),
    "router_init_std nan": ("router_init_std", math.nan),
    "router_bias_update_rate inf": ("router_bias_update_rate", math.inf),
    "moe_output_dropout 1": ("moe_output_dropout", 1.0),
    "num_experts str": ("num_experts", "4"),
    "num_experts_per_tok 9": ("num_experts_per_tok", 9),
    "router_weights bad": ("router_weights", "hard"),
    "moe_layers str": ("moe_layers", ["0"]),
    "hf_moe_format 99": ("hf_moe_format", 99),  # (named by what it means: "checkpoint format 99")
}


@pytest.mark.parametrize("case", list(FIELDS))
def test_every_moe_field_given_to_from_pretrained_is_checked(saved, case):
    """transformers sets `from_pretrained`'s keyword arguments on the config after it is built, past its checks: a NaN
    loss coefficient, an infinite capacity factor, a jitter that flips signs or a top-k above the experts loaded, and
    a checkpoint saved from there was refused by every later load."""
    name, value = FIELDS[case]
    said = "checkpoint format 99" if name == "hf_moe_format" else name
    refused(lambda: MoEForCausalLM.from_pretrained(saved, **{name: value}), said)


@pytest.mark.parametrize("kwargs", [dict(num_experts=10**9), dict(moe_intermediate_size=10**9), dict(moe_layers=[0])])
def test_a_load_cannot_change_the_tensors_the_checkpoint_holds(saved, kwargs):
    """`from_pretrained(dir, num_experts=10**9)` allocated a billion experts (24 GB a layer) and ended in an allocator
    traceback: a keyword argument may change how the model runs, not which tensors it has. The same values as the
    checkpoint's are accepted."""
    name = next(iter(kwargs))
    refused(lambda: MoEForCausalLM.from_pretrained(saved, **kwargs), name, "the checkpoint's")
    refused(lambda: MoEForCausalLM.from_pretrained(saved, offload_experts="disk", max_expert_memory="1GB", **kwargs),
            name)
    MoEForCausalLM.from_pretrained(saved, num_experts=4, moe_layers=[0, 1, 2])


def test_save_never_writes_a_config_that_load_refuses(saved, tmp_path):
    """A config edited into an unsound state (each field in range alone, not together) is refused by the save, and
    nothing is written; a sound edit is saved and reloads as it was."""
    model = MoEForCausalLM.from_pretrained(saved)
    model.config.num_experts_per_tok = 8  # (alone in range; the model has 4 experts)
    refused(lambda: model.save_pretrained(tmp_path / "bad"), "num_experts_per_tok", "num_experts=4")
    assert not (tmp_path / "bad").exists()
    model = MoEForCausalLM.from_pretrained(saved, router_skip_threshold=0.3)
    model.save_pretrained(tmp_path / "good")
    again = MoEForCausalLM.from_pretrained(tmp_path / "good")
    assert again.config.router_skip_threshold == 0.3
    assert torch.equal(logits(again), logits(model))


# --------------------------------------------------------------------------------------------------------------
# int8 scales: never saved unsound, refused on load when non-finite or too large
# --------------------------------------------------------------------------------------------------------------
def test_int8_linear_layers_quantized_from_non_finite_weights_are_not_saved(saved, tmp_path):
    """The scales of an int8 linear layer are max |w| / 127 of its rows: a row holding NaN or infinity (a diverged
    run) gives a NaN or infinite scale, which save_quantized and save_pretrained wrote for `lm_head` and `q_proj`
    and load_quantized then refused. The save refuses now, names the layer, and writes nothing."""
    model = MoEForCausalLM.from_pretrained(saved)
    with torch.no_grad():
        model.lm_head.weight[3, 0] = math.inf
        model.model.layers[0].self_attn.q_proj.weight[1, 1] = math.nan
    hf_moe.quantize_experts(model, "int8", linears=True)
    for save in (lambda: hf_moe.save_quantized(model, tmp_path / "int8"),
                 lambda: model.save_pretrained(tmp_path / "int8")):
        refused(save, "q_proj.weight_scale", "not finite")
        assert not (tmp_path / "int8").exists()
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight_scale[1] = 0.01
    refused(lambda: hf_moe.save_quantized(model, tmp_path / "int8"), "lm_head.weight_scale")


@pytest.fixture(scope="module")
def quantized(saved, tmp_path_factory):
    """`saved` with int8 experts and linear layers (save_quantized), and its logits."""
    directory = tmp_path_factory.mktemp("int8") / "moe"
    model = hf_moe.quantize_experts(MoEForCausalLM.from_pretrained(saved), "int8", linears=True)
    hf_moe.save_quantized(model, directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory, logits(model)


def _set_first(directory: Path, key: str, value: float) -> Path:
    """Set the first value of the F32 tensor `key` to `value` in place, and record the file's checksums as they now
    are (a consistent edit, as another tool would make it). Returns the file."""
    weight_map = json.loads((directory / INDEX_NAME).read_text())["weight_map"]
    path = directory / weight_map[key]
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    struct.pack_into("<f", raw, 8 + n + json.loads(raw[8 : 8 + n])[key]["data_offsets"][0], value)
    path.write_bytes(raw)
    index = json.loads((directory / INDEX_NAME).read_text())
    for name, _, record in checksum_files(directory, [path.name], "checksums"):
        index["metadata"]["checksums"]["files"][name] = record
    (directory / INDEX_NAME).write_text(json.dumps(index))
    return path


@pytest.mark.parametrize("key", ["lm_head.weight_scale", "model.layers.1.mlp.experts.2.down_proj_scale"])
def test_finite_but_huge_int8_scales_are_refused_on_load(quantized, tmp_path, capsys, key):
    """A scale of 1e38 is finite and >= 0, so it passed every check, and the model computed non-finite logits. A
    scale is sound only if 127 x scale x the row's inputs fits in fp32 (where the kernels sum the row's products):
    load_quantized and `hf-moe verify` refuse the rest, naming the file and the tensor."""
    assert torch.equal(logits(hf_moe.load_quantized(quantized[0])), quantized[1])
    directory = tmp_path / "int8"
    shutil.copytree(quantized[0], directory)
    path = _set_first(directory, key, 1e38)
    refused(lambda: hf_moe.load_quantized(directory), path.name, key, "too large", error=CheckpointError)
    capsys.readouterr()
    assert cli(["verify", str(directory)]) == 1
    assert key in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------------------
# The budget of gpu_check and of scripts/first_light.sh
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", ["nan", "inf", "-1", "0", "abc", "1e400"])
def test_a_gpu_check_budget_that_is_not_a_finite_positive_number_is_refused(monkeypatch, capsys, budget):
    """`--budget nan` was accepted: every step's limit became NaN, and a wait with a NaN timeout never times out, so
    a hung step would never have been killed. Now the command line is refused (status 2) before any step runs."""
    monkeypatch.setattr(gpu_check, "run_steps", lambda *a, **k: pytest.fail("a step ran"))
    with pytest.raises(SystemExit) as info:
        gpu_check.main(["--budget", budget, "--out", "unused", "--smoke"])
    assert info.value.code == 2
    assert "--budget" in capsys.readouterr().err
    COUNTS["refused"] += 1


def test_a_gpu_check_budget_under_the_minimum_is_reported_as_given(capsys):
    """`--budget 0.5` was reported as "--budget 0"."""
    with pytest.raises(SystemExit):
        gpu_check.main(["--budget", "0.5", "--out", "unused"])
    assert "--budget 0.5 is under the 225 s" in capsys.readouterr().err
    COUNTS["refused"] += 1


@pytest.mark.parametrize("budget", [math.nan, math.inf, 0.0])
def test_run_steps_refuses_a_budget_no_limit_can_come_from(tmp_path, budget):
    spec = StepSpec("environment", "environment", "hf_moe.gpu_check.steps:step_environment", most=60, least=10)
    refused(lambda: run_steps([spec], Report(tmp_path, "t", {}), budget, True, {}), "budget")


def _first_light(out: Path, budget: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HF_MOE_BACKEND")}
    env.update(OUT=str(out), BUDGET=budget, PYTHON=sys.executable)
    return subprocess.run(["bash", str(ROOT / "scripts" / "first_light.sh")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env, check=False)


@pytest.mark.subprocess
@pytest.mark.parametrize("budget", ["abc", "nan", "inf", "-5", "0", "1e3", "99999999999999999999"])
def test_first_light_refuses_a_budget_that_is_not_a_number_of_seconds(tmp_path, budget):
    """`BUDGET=abc` or `nan` died in bash arithmetic with status 1, which the script documents as "a step failed".
    Now it says what BUDGET must be and exits 2 (documented) before anything runs."""
    done = _first_light(tmp_path / "out", budget)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "BUDGET" in done.stderr and "nothing ran" in done.stderr
    assert not (tmp_path / "out" / "report.md").exists()
    COUNTS["refused"] += 1


@pytest.mark.slow
@pytest.mark.subprocess
def test_first_light_reports_a_fractional_budget_as_given(tmp_path):
    """`BUDGET=0.5` died in bash arithmetic; now gpu_check refuses it as under the steps' minimum, saying 0.5."""
    done = _first_light(tmp_path / "out", "0.5")
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "--budget 0.5 is under" in done.stdout + done.stderr
    COUNTS["refused"] += 1


# --------------------------------------------------------------------------------------------------------------
# Sizes a request implies: the static KV cache, the offloaded experts' cache
# --------------------------------------------------------------------------------------------------------------
def test_hf_moe_generate_refuses_an_absurd_static_cache_before_allocating(saved, capsys):
    """`--cache-implementation static --max-new-tokens 99999999999` ended in an allocator traceback (17.6 TB)."""
    capsys.readouterr()
    assert cli(["generate", str(saved), "abc", "--cache-implementation", "static",
                "--max-new-tokens", "99999999999"]) == 2
    err = capsys.readouterr().err
    assert "static KV cache of" in err and "TB" in err and "max_new_tokens=99,999,999,999" in err
    COUNTS["refused"] += 1
    with pytest.raises(SystemExit):
        cli(["generate", str(saved), "abc", "--max-new-tokens", "0"])
    assert "--max-new-tokens" in capsys.readouterr().err


def test_a_static_cache_past_the_free_memory_is_refused_and_the_plain_call_keeps_a_dynamic_one(saved, monkeypatch):
    """A large but not absurd request would allocate and zero its whole static cache (tens of GB) before the first
    token. With little memory free, a static cache asked for is refused with its size; the plain call, which would
    pick a static cache by itself, keeps transformers' dynamic cache, and gives the same tokens."""
    model = MoEForCausalLM.from_pretrained(saved)
    ids = random_ids(batch=1)
    expected = model.generate(ids, max_new_tokens=8, do_sample=False)
    refused(lambda: model.generate(ids, max_new_tokens=10**9, do_sample=False, cache_implementation="static"),
            "static KV cache", "positions", "max_new_tokens=1,000,000,000")
    monkeypatch.setattr(generation, "free_memory", lambda device: 10_000)  # a static cache of 256 takes 196.6 KB
    message = refused(lambda: model.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static"),
                      "static KV cache of 256 positions", "10.0 KB", "HF_MOE_SKIP_SIZE_CHECK")
    assert "196.6 KB" in message
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), expected)
    # where the one-op step serves the model (an AVX-512 BF16 CPU), the plain call would pick a static cache itself
    monkeypatch.setattr(generation, "choose_decode", lambda model, batch: DecodeChoice(ONE_OP, "(as if)"))
    assert generation.prepare_generate_kwargs(model, (ids,), {"max_new_tokens": 8}) == {"max_new_tokens": 8}
    monkeypatch.setattr(generation, "free_memory", lambda device: 10**12)
    planned = generation.prepare_generate_kwargs(model, (ids,), {"max_new_tokens": 8})
    assert planned["cache_implementation"] == "static" and planned["max_cache_len"] == 256


def test_an_expert_cache_past_the_free_memory_is_refused(saved, monkeypatch):
    """The offloaded experts' cache is taken at its full size (at once on a GPU): a budget past the memory free is
    refused with the cache's size, before the pool is allocated."""
    monkeypatch.setattr(offload_cache, "free_memory", lambda device: 1000)
    refused(lambda: logits(MoEForCausalLM.from_pretrained(saved, offload_experts="disk", max_expert_memory="1GB")),
            "max_expert_memory", "1000 B")
