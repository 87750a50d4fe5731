"""The router zoo: every router trains a converted model and round-trips; capacity, drops, expert choice in
generation, aux-free balancing with gradient accumulation, user routers, z-loss, and the routing monitor."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from accelerate import Accelerator
from conftest import VOCAB, random_ids, tiny_dense
from datasets import Dataset
from transformers import Trainer, TrainingArguments

import hf_moe
from hf_moe import MoEForCausalLM, MoEMonitorCallback, Router, RouterOutput, convert_to_moe, register_router
from hf_moe.layers.router import AuxFreeRouter, capacity_kept
from hf_moe.routing import moe_blocks

pytestmark = pytest.mark.oldest

ROUTER_TOP_K = {"topk": 2, "noisy_topk": 2, "switch": 1, "gshard": 2, "prototype": 2, "expert_choice": 2,
                "aux_free": 2}


def _data(n=48, length=16):
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(3, VOCAB, (4, length), generator=g).repeat(n // 4, 1)
    return Dataset.from_dict({"input_ids": rows.tolist(), "labels": rows.tolist()})


def _train(moe, tmp_path, steps=12, **kwargs):
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=8, max_steps=steps, learning_rate=3e-3,
                             logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=True,
                             lr_scheduler_type="constant", seed=0, **kwargs)
    trainer = hf_moe.MoETrainer(model=moe, args=args, train_dataset=_data())  # (it moves the aux_free biases)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.slow
@pytest.mark.parametrize("router_type", sorted(ROUTER_TOP_K))
def test_every_router_trains_and_round_trips(router_type, tmp_path):
    moe = convert_to_moe(tiny_dense(), num_experts=4, top_k=ROUTER_TOP_K[router_type], router_type=router_type)
    assert moe.config.router_type == router_type
    assert type(moe.model.layers[0].mlp.gate) is hf_moe.ROUTERS[router_type]
    losses = _train(moe, tmp_path / "run")
    assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.7 * losses[0], losses

    moe.save_pretrained(tmp_path / "saved")
    loaded = MoEForCausalLM.from_pretrained(tmp_path / "saved")
    assert loaded.config.router_type == router_type
    assert type(loaded.model.layers[0].mlp.gate) is type(moe.model.layers[0].mlp.gate)
    ids = random_ids()
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, moe.eval()(ids).logits)


@pytest.mark.parametrize("router_type", ["topk", "noisy_topk", "gshard", "prototype", "expert_choice", "aux_free"])
def test_upcycling_is_exact_in_eval_with_renormalised_weights(router_type):
    dense = tiny_dense()
    ids = random_ids(2, 16)
    with torch.no_grad():
        ref = dense(ids).logits
    moe = convert_to_moe(dense, num_experts=4, top_k=2, router_type=router_type, eval_capacity_factor=None)
    with torch.no_grad():
        torch.testing.assert_close(moe(ids).logits, ref, rtol=0, atol=2e-5)


def test_router_options_are_validated():
    with pytest.raises(ValueError, match="switch router sends each token to one expert"):
        convert_to_moe(tiny_dense(), num_experts=4, top_k=2, router_type="switch")
    with pytest.raises(ValueError, match="gshard router is top-2"):
        convert_to_moe(tiny_dense(), num_experts=4, top_k=1, router_type="gshard")
    with pytest.raises(ValueError, match="multiples of num_prototypes"):
        convert_to_moe(tiny_dense(), num_experts=6, top_k=2, router_type="prototype", num_prototypes=4)
    with pytest.raises(ValueError, match="Unknown router_type 'nope'.*topk"):
        convert_to_moe(tiny_dense(), num_experts=4, top_k=2, router_type="nope")
    with pytest.raises(ValueError, match="capacity_factor must be positive"):
        convert_to_moe(tiny_dense(), num_experts=4, top_k=2, capacity_factor=0)


def test_paper_defaults_for_switch_and_gshard():
    switch = convert_to_moe(tiny_dense(), num_experts=4, top_k=1, router_type="switch").config
    assert (switch.capacity_factor, switch.eval_capacity_factor, switch.router_jitter_noise) == (1.25, 2.0, 0.01)
    assert (switch.norm_topk_prob, switch.router_weights) == (False, "unit")


def test_switch_router_learns_from_the_lm_loss_and_upcycles_exactly():
    """With norm_topk_prob=True a top-1 weight is p / p = 1 with no gradient: the router's LM-loss gradient was
    1e-9. Unit weights (p / p.detach()) keep the value 1 and pass the gradient of log p."""
    dense = tiny_dense()
    ids = random_ids()
    moe = convert_to_moe(dense, num_experts=4, top_k=1, router_type="switch", router_aux_loss_coef=0.0,
                         capacity_factor=None, eval_capacity_factor=None)  # dropless: nothing else differs
    with torch.no_grad():
        torch.testing.assert_close(moe.eval()(ids).logits, dense(ids).logits, rtol=0, atol=1e-5)
    moe.train()
    moe(ids, labels=ids).loss.backward()
    grad = moe_blocks(moe)[0].gate.weight.grad
    assert grad is not None and grad.norm() > 1e-4
    with pytest.warns(UserWarning, match="norm_topk_prob=True weights every expert output by exactly 1"):
        convert_to_moe(tiny_dense(), num_experts=4, top_k=1, router_type="switch", norm_topk_prob=True)
    gshard = convert_to_moe(tiny_dense(), num_experts=4, top_k=2, router_type="gshard", capacity_factor=None).config
    assert gshard.capacity_factor is None  # the caller's choice wins over the default
    assert convert_to_moe(tiny_dense(), num_experts=4, top_k=2).config.capacity_factor is None  # dropless default


# -- capacity and drops --------------------------------------------------------------------------------------------
def test_capacity_keeps_first_choices_first_then_token_order():
    index = torch.tensor([[0, 1], [0, 1], [0, 2], [1, 0]])
    kept = capacity_kept(index, num_experts=3, capacity=2)
    # Expert 0: first choices of tokens 0 and 1 fill it; token 2's first choice and token 3's second are dropped.
    # Expert 1: token 3's first choice, then token 0's second choice; token 1's second choice is dropped.
    assert kept.tolist() == [[True, True], [True, False], [False, True], [True, False]]


def test_dropped_pairs_contribute_zero_and_are_counted():
    moe = convert_to_moe(tiny_dense(), num_experts=4, top_k=2, capacity_factor=0.25, eval_capacity_factor=0.25)
    block = moe.model.layers[0].mlp.eval()
    x = torch.randn(16, 64)
    routing = block.gate(x)
    capacity = math.ceil(0.25 * 16 * 2 / 4)
    assert routing.kept is not None
    load = routing.expert_load(4)
    assert load.max() <= capacity and int(routing.num_dropped()) == 32 - int(load.sum())
    # The output equals what the kept pairs alone compute: a dropped pair adds nothing.
    index = routing.dispatch_index()
    expected = torch.zeros_like(x)
    experts = block.experts
    for n in range(16):
        for j in range(2):
            e = int(index[n, j])
            if e >= 0:
                gate, up = (experts.gate_up_proj[e] @ x[n]).chunk(2)
                expected[n] += routing.top_k_weights[n, j] * (experts.down_proj[e] @ (experts.act_fn(gate) * up))
    with torch.no_grad():
        torch.testing.assert_close(block(x), expected, rtol=1e-5, atol=1e-5)


def test_drops_are_reported_by_the_monitor(tmp_path):
    moe = convert_to_moe(tiny_dense(), num_experts=4, top_k=2, capacity_factor=0.5)
    monitor = MoEMonitorCallback()
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=8, max_steps=4, logging_steps=2,
                             report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=True)
    Trainer(model=moe, args=args, train_dataset=_data(), callbacks=[monitor]).train()
    assert len(monitor.history) == 2
    assert 0.4 <= monitor.history[-1]["moe/mean/drop_fraction"] < 1.0  # capacity for half the pairs


def test_dropless_by_default_drops_nothing():
    moe = convert_to_moe(tiny_dense(), num_experts=4, top_k=2).train()
    ids = random_ids(4, 16)
    moe(ids, labels=ids)
    assert moe.routing_stats.dropped.sum() == 0


# -- expert choice ---------------------------------------------------------------------------------------------
def test_expert_choice_balances_in_training_and_is_causal_when_generating():
    moe = convert_to_moe(tiny_dense(), num_experts=4, top_k=2, router_type="expert_choice")
    router = moe.model.layers[0].mlp.gate
    x = torch.randn(20, 64)
    routing = router.train()(x)
    assert routing.is_expert_choice and routing.expert_index.shape == (4, 10)  # C = N * k / E
    assert torch.equal(routing.expert_load(4), torch.full((4,), 10.0))
    assert not router.eval()(x).is_expert_choice  # token choice outside training

    moe.eval()
    ids = random_ids(1, 16)
    with torch.no_grad():
        full = moe(ids).logits
        prefix = moe(ids[:, :8]).logits
    torch.testing.assert_close(prefix, full[:, :8], rtol=1e-5, atol=1e-5)  # the future does not change the past
    generated = moe.generate(ids[:, :4], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 10)


# -- aux-free balancing ------------------------------------------------------------------------------------------
def test_aux_free_bias_moves_once_per_optimizer_step_with_gradient_accumulation():
    moe = convert_to_moe(tiny_dense(), num_experts=4, top_k=2, router_type="aux_free").train()
    routers = [b.gate for b in moe_blocks(moe)]
    assert all(isinstance(r, AuxFreeRouter) for r in routers) and moe.config.router_aux_loss_coef == 0.0
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    optimizer = torch.optim.SGD(moe.parameters(), lr=1e-3)
    moe, optimizer = accelerator.prepare(moe, optimizer)
    hf_moe.attach_aux_free(moe, optimizer)  # Accelerate's wrapper: the torch optimizer inside steps once per 2
    batches = [random_ids(4, 12, seed=s) for s in range(4)]
    bias_history = []
    loads = []
    for i, ids in enumerate(batches):
        with accelerator.accumulate(moe):
            out = moe(input_ids=ids, labels=ids)
            loads.append(routers[0].load_since_update.clone())
            accelerator.backward(out.loss)
            optimizer.step()
            optimizer.zero_grad()
        bias_history.append(routers[0].e_score_correction_bias.clone())
    # No step after micro-batch 1 and 3's predecessors: the bias moves only after micro-batches 2 and 4.
    assert torch.equal(bias_history[0], torch.zeros(4))
    assert not torch.equal(bias_history[1], bias_history[0])
    assert torch.equal(bias_history[2], bias_history[1])
    # The update used both micro-batches' loads: b += rate * sign(mean - load).
    load = loads[1]  # accumulated over micro-batches 1 and 2 at the time of the step
    assert load.sum() == 2 * 4 * 12 * 2
    torch.testing.assert_close(bias_history[1], 1e-3 * torch.sign(load.mean() - load))
    assert torch.equal(routers[0].load_since_update, torch.zeros(4))


def _aux_free_step(moe, optimizer, seed=0):
    ids = random_ids(4, 12, seed=seed)
    moe(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_aux_free_bias_moves_only_after_its_own_optimizers_steps():
    """The bias update was a hook on every optimizer of the process: a step of any other optimizer holding the router
    weights (a second optimizer, a probe's) moved this model's bias too. Now only the attached optimizer moves it,
    once per step however often it is attached."""
    torch.manual_seed(0)
    moe = convert_to_moe(tiny_dense(), num_experts=4, top_k=2, router_type="aux_free").train()
    router = moe_blocks(moe)[0].gate
    trains = torch.optim.SGD(moe.parameters(), lr=1e-3)
    other = torch.optim.SGD(moe.parameters(), lr=1e-3)
    handle = hf_moe.attach_aux_free(moe, trains)
    assert hf_moe.attach_aux_free(moe, trains) is handle  # again: still one update per step
    _aux_free_step(moe, other)
    assert torch.equal(router.e_score_correction_bias, torch.zeros(4))  # another optimizer's step: no update
    assert router.load_since_update.sum() > 0  # (its loads wait for the step of the one attached)
    load = router.load_since_update.clone()
    trains.step()
    torch.testing.assert_close(router.e_score_correction_bias, 1e-3 * torch.sign(load.mean() - load))
    second = convert_to_moe(tiny_dense(), num_experts=4, top_k=2, router_type="aux_free").train()
    second_optimizer = torch.optim.SGD(second.parameters(), lr=1e-3)
    hf_moe.attach_aux_free(second, second_optimizer)
    before = router.e_score_correction_bias.clone()
    _aux_free_step(second, second_optimizer)
    assert torch.equal(router.e_score_correction_bias, before)  # the second model's optimizer leaves the first alone
    assert not torch.equal(moe_blocks(second)[0].gate.e_score_correction_bias, torch.zeros(4))
    handle.remove()
    _aux_free_step(moe, trains)
    assert torch.equal(router.e_score_correction_bias, before)


def test_aux_free_training_without_an_attached_optimizer_warns(monkeypatch):
    """Nothing moves the bias of a model whose optimizer was not attached (a plain Trainer, a loop without the call):
    a warning names the fix instead of balancing that silently stops."""
    monkeypatch.setattr(AuxFreeRouter, "UNATTACHED_WARN_AFTER", 3)
    moe = convert_to_moe(tiny_dense(), num_experts=4, top_k=2, router_type="aux_free").train()
    optimizer = torch.optim.SGD(moe.parameters(), lr=1e-3)
    with pytest.warns(RuntimeWarning, match=r"hf_moe.attach_aux_free\(model, optimizer\)"):
        for seed in range(3):
            _aux_free_step(moe, optimizer, seed)
    attached = convert_to_moe(tiny_dense(), num_experts=4, top_k=2, router_type="aux_free").train()
    optimizer = torch.optim.SGD(attached.parameters(), lr=1e-3)
    hf_moe.attach_aux_free(attached, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seed in range(4):
            _aux_free_step(attached, optimizer, seed)


@pytest.mark.slow
def test_trainers_move_the_aux_free_bias(tmp_path):
    """MoETrainer attaches the optimizer it trains with (Trainer makes it when training starts); another Trainer
    (TRL's) attaches its optimizer with one line, as docs/training.md says."""
    moe = convert_to_moe(tiny_dense(), num_experts=4, top_k=2, router_type="aux_free")
    _train(moe, tmp_path / "moe_trainer", steps=2)
    assert all(not torch.equal(b.gate.e_score_correction_bias, torch.zeros(4)) for b in moe_blocks(moe))
    assert all(b.gate.bias_updates_attached for b in moe_blocks(moe))
    plain = convert_to_moe(tiny_dense(), num_experts=4, top_k=2, router_type="aux_free")
    args = TrainingArguments(str(tmp_path / "plain"), per_device_train_batch_size=8, max_steps=2, report_to=[],
                             save_strategy="no", disable_tqdm=True, use_cpu=True)
    trainer = Trainer(model=plain, args=args, train_dataset=_data())
    hf_moe.attach_aux_free(plain, trainer.create_optimizer())
    trainer.train()
    assert all(not torch.equal(b.gate.e_score_correction_bias, torch.zeros(4)) for b in moe_blocks(plain))


def test_aux_free_bias_changes_selection_not_weights():
    moe = convert_to_moe(tiny_dense(), num_experts=4, top_k=2, router_type="aux_free")
    router = moe.model.layers[0].mlp.gate.eval()
    x = torch.randn(30, 64)
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))
    routing = router(x)
    assert set(routing.top_k_index.unique().tolist()) == {0, 1}  # the bias decides the choice...
    scores = routing.router_logits.sigmoid().gather(-1, routing.top_k_index)
    torch.testing.assert_close(routing.top_k_weights, scores / scores.sum(-1, keepdim=True))  # ...not the weights


# -- user-defined routers ----------------------------------------------------------------------------------------
@register_router("test_round_robin")
class RoundRobinRouter(Router):
    """Token t goes to experts t % E, (t + 1) % E, ... with equal weights (ignores the logits' values)."""

    def route(self, hidden_states):
        logits = self.logits(hidden_states)
        n = hidden_states.shape[0]
        index = (torch.arange(n).unsqueeze(1) + torch.arange(self.top_k)) % self.num_experts
        weights = torch.full((n, self.top_k), 1.0 / self.top_k)
        return RouterOutput(logits, logits.softmax(-1), index, weights)


def test_user_router_converts_trains_and_round_trips(tmp_path):
    moe = convert_to_moe(tiny_dense(), num_experts=4, top_k=2, router_type="test_round_robin")
    assert isinstance(moe.model.layers[0].mlp.gate, RoundRobinRouter)
    losses = _train(moe, tmp_path / "run", steps=6)
    assert losses[-1] < losses[0]
    moe.save_pretrained(tmp_path / "saved")
    assert isinstance(MoEForCausalLM.from_pretrained(tmp_path / "saved").model.layers[0].mlp.gate, RoundRobinRouter)
    with pytest.raises(ValueError, match="already registered"):
        register_router("test_round_robin")(type("Other", (Router,), {}))


# -- z-loss ------------------------------------------------------------------------------------------------------
def test_z_loss_is_added_with_its_coefficient():
    moe = convert_to_moe(tiny_dense(), num_experts=4, top_k=2, router_z_loss_coef=0.1, router_aux_loss_coef=0.0)
    moe.train()
    ids = random_ids()
    out = moe(ids, labels=ids)
    lm = moe.loss_function(out.logits, ids, vocab_size=moe.config.vocab_size)
    torch.testing.assert_close(out.loss, lm + 0.1 * out.z_loss)
    logits = moe(ids, output_router_logits=True).router_logits
    expected = torch.stack([torch.logsumexp(r, -1).pow(2).mean() for r in logits]).mean()
    torch.testing.assert_close(out.z_loss, expected)


# -- the monitor -------------------------------------------------------------------------------------------------
def test_monitor_logs_real_numbers_per_layer(tmp_path):
    moe = convert_to_moe(tiny_dense(), num_experts=4, top_k=2)
    monitor = MoEMonitorCallback()
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=8, max_steps=6, logging_steps=3,
                             report_to=["tensorboard"], save_strategy="no", disable_tqdm=True, use_cpu=True)
    trainer = Trainer(model=moe, args=args, train_dataset=_data(), callbacks=[monitor])
    trainer.train()
    assert [h["step"] for h in monitor.history] == [3, 6]
    last = monitor.history[-1]
    for layer in range(3):
        shares = [last[f"moe/layer_{layer}/load/expert_{e}"] for e in range(4)]
        assert sum(shares) == pytest.approx(1.0)
        assert last[f"moe/layer_{layer}/load_cv"] >= 0 and last[f"moe/layer_{layer}/load_max_over_mean"] >= 1
        assert 0 < last[f"moe/layer_{layer}/router_entropy"] <= math.log(4) + 1e-6
        assert last[f"moe/layer_{layer}/aux_loss"] > 0
        assert last[f"moe/layer_{layer}/z_loss"] > 0
    logged = [h for h in trainer.state.log_history if "moe/mean/load_cv" in h]
    assert len(logged) == 2  # in trainer_state.json too
    events = list((tmp_path / "runs").rglob("events.out.tfevents.*"))
    assert events, "nothing written for TensorBoard"


def test_inspect_routing(tmp_path, capsys):
    from conftest import CORPUS, tiny_tokenizer

    from hf_moe.cli import main

    moe = convert_to_moe(tiny_dense(), num_experts=4, top_k=2)
    moe.save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    (tmp_path / "data.txt").write_text(CORPUS * 4)
    assert main(["inspect", str(tmp_path / "m"), "--routing", "--data", str(tmp_path / "data.txt")]) == 0
    out = capsys.readouterr().out
    assert "routing of" in out and "max/mean" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and "%" in line]
    assert len(rows) == 3 and all(sum(float(v) for v in row[1:5]) == pytest.approx(100, abs=0.5) for row in rows)
    assert (tmp_path / "m" / "routing.png").stat().st_size > 1000
    assert main(["inspect", str(tmp_path / "m"), "--routing"]) == 2  # --data is required
