"""Single-process parts of hf_moe.parallel: `hf-moe plan`, the DCP training state, and the errors without
torch.distributed. The multi-process behaviour is in test_distributed.py."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_ids, tiny_config, tiny_dense

import hf_moe
import hf_moe_cli
from hf_moe import convert_to_moe
from hf_moe.parallel import load_training_state, save_training_state
from hf_moe.parallel.sizing import Layout, estimate
from hf_moe.parallel.training_state import TrainingStateError

pytestmark = pytest.mark.oldest


def _moe(seed: int = 0, num_experts: int = 4):
    return convert_to_moe(tiny_dense(seed=seed), num_experts=num_experts, top_k=2, noise=0.05).train()


# --------------------------------------------------------------------------------------------------------------
# hf-moe plan
# --------------------------------------------------------------------------------------------------------------
def _plan(capsys, *argv) -> tuple[int, str, str]:
    status = hf_moe_cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_plan_prints_every_layout_with_what_fits(tmp_path, capsys):
    tiny_config("llama").save_pretrained(tmp_path / "dense")
    status, out, _ = _plan(capsys, str(tmp_path / "dense"), "--gpus", "2", "--gpu-memory", "1GB", "--nodes", "2",
                           "--num-experts", "8", "--top-k", "2", "--dtype", "fp32", "--seq-len", "64")
    assert status == 0, out
    rows = [line.split() for line in out.splitlines() if line[:4].strip().isdigit()]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(2, 2), (1, 4), (4, 1)]  # EP inside a node first
    assert [("across" in r) for r in rows] == [False, False, True]  # EP 4 spans both nodes of 2 GPUs
    assert all(r[10] == "yes" for r in rows)  # a tiny model fits in 1 GB
    # The printed weights are the arithmetic's (in GB with one decimal: compare through the estimate itself).
    moe = convert_to_moe(tiny_dense(), num_experts=8, top_k=2, verify=False)
    e = estimate(moe, Layout(ep=2, dp=2), dtype=torch.float32, seq_len=64)
    assert f"{e.per_rank['weights'] / 1e9:.1f}G" == rows[0][3]


def test_plan_arithmetic_adds_up_to_the_model():
    """With dp = 1 the ranks' shards add up to the model; fp32 AdamW state is 2 x the weights plus step counters."""
    model = _moe(num_experts=8)
    total = sum(p.numel() for p in model.parameters()) * 4
    for ep in (1, 2, 4, 8):
        e = estimate(model, Layout(ep=ep, dp=1), dtype=torch.float32)
        assert sum(r["weights"] for r in e.by_rank) == total
        tensors = len(list(model.parameters()))
        assert all(r["optimizer"] == 2 * r["weights"] + 4 * tensors for r in e.by_rank)
    bf16 = estimate(model, Layout(ep=2, dp=1), dtype=torch.bfloat16).by_rank[0]
    assert bf16["optimizer"] == 12 * bf16["weights"] // 2 + 4 * tensors  # fp32 m, v and master copy


def test_plan_of_a_saved_moe_and_its_errors(tmp_path, capsys):
    _moe().save_pretrained(tmp_path / "moe")
    status, out, _ = _plan(capsys, str(tmp_path / "moe"), "--gpus", "4", "--gpu-memory", "80GB")
    assert status == 0 and "4 per MoE layer" in out
    status, _, err = _plan(capsys, str(tmp_path / "moe"), "--gpus", "4", "--gpu-memory", "80 gigs")
    assert status == 2 and "--gpu-memory takes a size like 80GB" in err
    status, _, err = _plan(capsys, str(tmp_path / "moe"), "--gpus", "4", "--gpu-memory", "80GB", "--top-k", "2")
    assert status == 2 and "already an MoE model" in err
    tiny_config("llama").save_pretrained(tmp_path / "dense")
    status, _, err = _plan(capsys, str(tmp_path / "dense" / "config.json"), "--gpus", "4", "--gpu-memory", "80GB")
    assert status == 2 and "pass --num-experts and --top-k" in err
    (tmp_path / "bad.json").write_text("{not json")
    status, _, err = _plan(capsys, str(tmp_path / "bad.json"), "--gpus", "4", "--gpu-memory", "80GB")
    assert status == 2 and "not a JSON config" in err


# --------------------------------------------------------------------------------------------------------------
# DCP training state, one process (resharding across process counts: test_distributed.py)
# --------------------------------------------------------------------------------------------------------------
def _train_one_step(model, optimizer, scheduler):
    ids = random_ids(2, 10)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def _setup(seed: int):
    model = _moe(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def test_training_state_round_trip(tmp_path):
    model, optimizer, scheduler = _setup(0)
    _train_one_step(model, optimizer, scheduler)
    torch.manual_seed(123)
    save_training_state(tmp_path / "state", model, optimizer, scheduler=scheduler, data_position={"step": 1})
    expected_rng = torch.rand(3)

    other, other_optimizer, other_scheduler = _setup(5)
    position = load_training_state(tmp_path / "state", other, other_optimizer, scheduler=other_scheduler)
    assert position == {"step": 1}
    torch.testing.assert_close(torch.rand(3), expected_rng, rtol=0, atol=0)  # the RNG continues where it was saved
    for a, b in zip(model.parameters(), other.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    for a, b in zip(model.parameters(), other.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(other_optimizer.state[b][key], optimizer.state[a][key], rtol=0, atol=0)
    assert other_scheduler.state_dict() == scheduler.state_dict()
    # Saving again over it replaces it atomically (no staging directory left behind).
    save_training_state(tmp_path / "state", other, other_optimizer, scheduler=other_scheduler)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]


def test_training_state_is_validated_before_use(tmp_path):
    model, optimizer, scheduler = _setup(0)
    with pytest.raises(TrainingStateError, match="is not a training state"):
        load_training_state(tmp_path / "missing", model, optimizer)
    save_training_state(tmp_path / "state", model, optimizer, data_position={"step": 0})
    with pytest.raises(TrainingStateError, match="does not match this model"):
        bigger = _moe(num_experts=8)
        load_training_state(tmp_path / "state", bigger, torch.optim.AdamW(bigger.parameters()))
    with pytest.raises(TrainingStateError, match="saved without a scheduler"):
        load_training_state(tmp_path / "state", model, optimizer, scheduler=scheduler)
    meta = tmp_path / "state" / "training_state.json"
    for bad, message in [
        ("{", "is corrupt"),
        (json.dumps({"format": 99}), "has format 99"),
        (json.dumps({"format": 1, "world_size": 0}), "world_size must be a positive integer"),
        (json.dumps({"format": 1, "world_size": 1, "mesh": None, "data_position": {"step": -1}}), "non-negative"),
    ]:
        meta.write_text(bad)
        with pytest.raises(TrainingStateError, match=message):
            load_training_state(tmp_path / "state", model, optimizer)
    with pytest.raises(TrainingStateError, match="non-negative integers"):
        save_training_state(tmp_path / "other", model, optimizer, data_position={"step": 1.5})


@pytest.mark.subprocess
def test_expert_parallelism_without_a_process_group_says_how_to_launch():
    for call in (hf_moe.parallelize, hf_moe.expert_parallel):
        with pytest.raises(RuntimeError, match="torchrun --nproc_per_node N"):
            call(_moe())


def test_register_for_checkpointing_names_what_a_plain_model_needs():
    """hf_moe.parallel.register_for_checkpointing is for expert-parallel models; Accelerate saves any other alone."""
    from accelerate import Accelerator

    model = _moe()
    with pytest.raises(ValueError, match="is not expert-parallel: accelerator.save_state saves it without"):
        hf_moe.parallel.register_for_checkpointing(Accelerator(cpu=True), model, torch.optim.AdamW(model.parameters()))
