"""Adapter experts: experts that share the frozen dense MLP and differ by small trainable adapters.

`convert_to_moe(..., method="lora")` (MixLoRA: expert e = W + s B_e A_e) and `method="pesc"` (PESC: the frozen MLP's
output plus a per-expert bottleneck adapter). Exact at initialisation on every family; the computation equals its
materialized experts (forward and every gradient) and, for PESC, a loop over the experts; only adapters and routers
train, through Trainer (activation checkpointing, bf16, resume), TRL's SFTTrainer and a plain Accelerate loop; a
checkpoint holds only what was trained and refers to its base by fingerprint; `materialize` gives an ordinary MoE
that saves, loads and exports to Mixtral with the same logits; the CLI does the same.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, random_ids, tiny_dense, tiny_tokenizer
from test_families import FAMILIES, tiny
from transformers import AutoModelForCausalLM

import hf_moe
import hf_moe_cli
from hf_moe import CheckpointError, MoEForCausalLM, convert_to_moe
from hf_moe.convert.materialize import materialize
from hf_moe.layers.adapter_experts import AdapterExperts
from hf_moe.routing import moe_blocks

ATOL = 2e-5  # a few ulps of the logits, as for upcycling (test_families.py)


def _logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(input_ids=ids, **kwargs).logits


def _randomize_adapters(model, seed: int = 0, std: float = 0.2):
    """Non-zero B (and U): the experts then differ from the dense MLP and from each other."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("_lora_B", "adapter_up")):
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def _adapters(model) -> list[AdapterExperts]:
    return [b.experts for b in moe_blocks(model)]


# --------------------------------------------------------------------------------------------------------------
# Exact at initialisation
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_exact_at_initialisation_on_every_family(family):
    """B = 0 (lora) and U = 0 (pesc): the converted model gives the dense model's logits, on every family that
    upcycling supports (GLU and plain MLPs, biases, fused gate_up, Conv1D, MLPs inline in the decoder layer, MLPs
    that add the residual), with the KV cache too."""
    dense = tiny(family)
    ids = random_ids(2, 24)
    ref = _logits(dense, ids)
    for method in ("lora", "pesc"):
        moe = convert_to_moe(dense, num_experts=4, top_k=2, method=method, rank=4, verify=False)
        with torch.no_grad():
            out = moe(input_ids=ids[:, :16], use_cache=True)
            if out.past_key_values is None:  # (a family without a KV cache, e.g. openai-gpt: the whole sequence)
                logits = moe(input_ids=ids).logits
            else:
                logits = torch.cat([out.logits, moe(input_ids=ids[:, 16:], past_key_values=out.past_key_values).logits], 1)
            torch.testing.assert_close(logits, ref, rtol=0, atol=ATOL)
        assert {type(e) for e in _adapters(moe)} == {AdapterExperts}


# --------------------------------------------------------------------------------------------------------------
# The computation: its materialized experts, forward and backward; PESC against a loop over experts
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "family,router",
    [
        ("llama", {}),  # GLU without biases
        ("gpt2", dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),  # plain MLP, Conv1D, biases (no dropout:
        # the two models are compared in training mode)
        ("phi3", {"capacity_factor": 0.5}),  # fused gate_up; pairs dropped by capacity contribute nothing
        ("qwen2", {"router_type": "expert_choice"}),  # expert choice in training
    ],
)
def test_lora_experts_compute_their_materialized_experts_and_gradients(family, router):
    """The per-token frozen projections and the weighted sum before W_down are an exact rewrite of the MoE whose
    expert e is W + s B_e A_e: same loss (with the balancing loss), same router gradients, and the adapters'
    gradients are the chain rule of the materialized weights' (dL/dB_e = s dL/dW_e A_e^T, dL/dA_e = s B_e^T dL/dW_e)."""
    torch.manual_seed(0)
    ids = random_ids(2, 16)
    dropout = {k: router.pop(k) for k in list(router) if k.endswith("pdrop")}
    model = _randomize_adapters(convert_to_moe(tiny_dense(family, **dropout), num_experts=4, top_k=2, method="lora",
                                               rank=4, **router)).train()
    plain = materialize(_copy(model)).train()
    ours, theirs = model(input_ids=ids, labels=ids), plain(input_ids=ids, labels=ids)
    torch.testing.assert_close(ours.logits, theirs.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.loss, theirs.loss)
    if router.get("router_type") != "expert_choice":  # (expert choice balances by construction: no such loss)
        assert ours.aux_loss is not None and ours.aux_loss.requires_grad
    ours.loss.backward()
    theirs.loss.backward()
    for mine, plain_block in zip(moe_blocks(model), moe_blocks(plain)):
        torch.testing.assert_close(mine.gate.weight.grad, plain_block.gate.weight.grad, rtol=1e-4, atol=1e-6)
        experts, s = mine.experts, mine.experts.scaling
        w_grad = plain_block.experts.gate_up_proj.grad if experts.has_gate else plain_block.experts.up_proj.grad
        inter = experts.intermediate_dim
        grads = {"down": plain_block.experts.down_proj.grad}
        grads.update({"gate": w_grad[:, :inter], "up": w_grad[:, inter:]} if experts.has_gate else {"up": w_grad})
        for role, g in grads.items():
            a, b = getattr(experts, f"{role}_lora_A"), getattr(experts, f"{role}_lora_B")
            torch.testing.assert_close(b.grad, s * g @ a.detach().transpose(1, 2), rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(a.grad, s * b.detach().transpose(1, 2) @ g, rtol=1e-4, atol=1e-6)
    # The frozen weights got no gradient; the input did (so adapters of earlier layers learn).
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)


def _copy(model):
    import copy

    return copy.deepcopy(model)


def test_pesc_block_equals_a_loop_over_its_experts():
    """PESC: out = sum_j w_j (F(x) + s U_j act(D_j F(x))), F the frozen MLP, computed once per token; forward and
    gradients against the plain loop over the experts, with a pair dropped by capacity."""
    torch.manual_seed(0)
    moe = _randomize_adapters(convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, method="pesc", rank=4,
                                             capacity_factor=0.75)).train()
    block = moe_blocks(moe)[0]
    experts = block.experts
    x = torch.randn(10, moe.config.hidden_size, requires_grad=True)
    routing = block.gate(x)
    index, weights = routing.dispatch_index(), routing.top_k_weights
    assert (index < 0).any()  # the capacity drops some pairs: they must contribute nothing
    ours = experts(x, index, weights)

    base = experts.dense_mlp
    y = torch.nn.functional.linear(
        torch.nn.functional.silu(x @ base.gate_proj.t()) * (x @ base.up_proj.t()), base.down_proj)
    rows = []
    for n in range(x.shape[0]):
        total = torch.zeros_like(y[n])
        for j in range(index.shape[1]):
            e = int(index[n, j])
            if e < 0:
                continue
            adapter = experts.adapter_up[e] @ torch.nn.functional.gelu(experts.adapter_down[e] @ y[n])
            total = total + weights[n, j] * (y[n] + experts.scaling * adapter)
        rows.append(total)
    expected = torch.stack(rows)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    params = [x, experts.adapter_down, experts.adapter_up, block.gate.weight]
    got = torch.autograd.grad(ours.square().sum(), params, retain_graph=True)  # (the router graph is shared)
    want = torch.autograd.grad(expected.square().sum(), params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_lora_experts_keep_no_per_pair_tensor_for_the_backward():
    """What a training forward of the lora method keeps for its backward is per token (as a dense MLP with a LoRA
    keeps): the per-pair rows ([M, 2I] gathered gate/up, [M, I] activations; M = k N) are recomputed in the backward,
    and the gradients are those of the block that keeps them."""
    torch.manual_seed(0)
    moe = _randomize_adapters(convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, method="lora", rank=4))
    block = moe_blocks(moe.train())[0]
    n, inter = 12, moe.config.moe_intermediate_size
    x = torch.randn(n, moe.config.hidden_size, requires_grad=True)
    routing = block.gate(x)
    index, weights = routing.dispatch_index(), routing.top_k_weights
    kept = []

    def pack(t):
        kept.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block.experts(x, index, weights)
    m = index.numel()
    assert not [s for s in kept if len(s) == 2 and s[0] == m and s[1] in (inter, 2 * inter)], kept
    params = [x, block.gate.weight, *(p for p in block.experts.parameters() if p.requires_grad)]
    got = torch.autograd.grad(out.square().sum(), params, retain_graph=True)
    import hf_moe.layers.adapter_experts as module

    with pytest.MonkeyPatch.context() as mp:  # the same block keeping every per-pair tensor
        mp.setattr(module, "checkpoint", lambda fn, *args, **_: fn(*args))
        want = torch.autograd.grad(block.experts(x, index, weights).square().sum(), params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_pesc_cannot_be_materialized_and_tools_that_need_expert_weights_say_so():
    moe = convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, method="pesc", rank=4)
    with pytest.raises(ValueError, match="cannot become plain experts"):
        materialize(moe)
    lora = convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, method="lora", rank=4)
    with pytest.raises(AttributeError, match=r"hf_moe\.materialize\(model\)"):
        _ = _adapters(lora)[0].gate_up_proj
    with pytest.raises(ValueError, match="ordinary MoE already"):
        materialize(materialize(lora))


# --------------------------------------------------------------------------------------------------------------
# Training: only adapters and routers change
# --------------------------------------------------------------------------------------------------------------
def _dataset(n=24, length=16, seed=0):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(3, VOCAB, (4, length), generator=g).repeat(n // 4, 1)
    return Dataset.from_dict({"input_ids": rows.tolist(), "labels": rows.tolist()})


def _trained_names(before: dict, model) -> set[str]:
    after = model.state_dict()
    return {k for k in after if not torch.equal(before[k], after[k])}


def _adapter_and_router_names(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture
def dense_dir(tmp_path) -> Path:
    path = tmp_path / "dense"
    tiny_dense("llama").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.mark.slow
def test_trainer_with_checkpointing_and_bf16_trains_only_adapters_and_routers_and_resumes(dense_dir, tmp_path):
    """transformers.Trainer, unchanged: activation checkpointing and bf16 autocast; the balancing loss trains the
    routers; the checkpoints hold only the trained tensors, and resuming from one continues the run exactly."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        str(tmp_path / "run"), per_device_train_batch_size=8, max_steps=4, learning_rate=3e-3, logging_steps=1,
        report_to=[], save_strategy="steps", save_steps=2, disable_tqdm=True, use_cpu=True, seed=0, bf16=True,
        gradient_checkpointing=True, lr_scheduler_type="constant",
    )
    model = convert_to_moe(dense_dir, num_experts=4, top_k=2, method="lora", rank=4)
    trainable = _adapter_and_router_names(model)
    assert trainable and all(("lora_" in n) or ".gate." in n for n in trainable)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    Trainer(model=model, args=args, train_dataset=_dataset()).train()
    assert _trained_names(before, model) == trainable  # every adapter and router, nothing else
    checkpoint = tmp_path / "run" / "checkpoint-2"
    saved = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any("dense_mlp" in k or "embed" in k or "self_attn" in k for k in saved)

    other = convert_to_moe(dense_dir, num_experts=4, top_k=2, method="lora", rank=4, seed=5)  # other adapters
    Trainer(model=other, args=args, train_dataset=_dataset()).train(resume_from_checkpoint=str(checkpoint))
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=name)


def test_accelerate_loop_trains_pesc_experts_and_routers():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = convert_to_moe(tiny_dense("qwen3"), num_experts=4, top_k=2, method="pesc", rank=4).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loader = torch.utils.data.DataLoader(_dataset().with_format("torch"), batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for _ in range(2):
        for batch in loader:
            out = model(input_ids=batch["input_ids"], labels=batch["labels"])
            accelerator.backward(out.loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(out.loss.item())
    assert losses[-1] < losses[0], losses
    assert _trained_names(before, model) == _adapter_and_router_names(model)


@pytest.mark.slow
def test_trl_sft_trainer_trains_lora_experts(tmp_path):
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from conftest import CORPUS

    torch.manual_seed(0)
    model = convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, method="lora", rank=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = SFTConfig(str(tmp_path / "run"), use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
                       max_steps=3, logging_steps=1)
    data = Dataset.from_dict({"text": [CORPUS[i : i + 60] for i in range(0, 200, 20)]})
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tiny_tokenizer())
    assert trainer.aux_loss_enabled
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 3 and all(log["aux_loss"] > 0 for log in logs)
    assert _trained_names(before, model) == _adapter_and_router_names(model)


# --------------------------------------------------------------------------------------------------------------
# Checkpoints: only what was trained, a base checked by fingerprint; materialize; export
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_save_load_materialize_export_give_the_same_logits(dense_dir, tmp_path):
    ids = random_ids(2, 16)
    model = _randomize_adapters(convert_to_moe(dense_dir, num_experts=4, top_k=2, method="lora", rank=4)).eval()
    ref = _logits(model, ids)
    model.save_pretrained(tmp_path / "adapters")

    index = json.loads((tmp_path / "adapters" / "model.safetensors.index.json").read_text())["weight_map"]
    files = {f: sorted(k for k, v in index.items() if v == f) for f in set(index.values())}
    assert sorted(files) == ["model-00001-of-00001.safetensors"] + [f"model-expert-0000{e}.safetensors"
                                                                    for e in range(4)]
    assert all(k.endswith(".gate.weight") for k in files["model-00001-of-00001.safetensors"])  # the routers only
    assert all(f".experts.2.{name}" in " ".join(files["model-expert-00002.safetensors"])
               for name in ("gate_lora_A", "up_lora_B", "down_lora_A"))
    dense_bytes = sum(f.stat().st_size for f in dense_dir.glob("*.safetensors"))
    adapter_bytes = sum(f.stat().st_size for f in (tmp_path / "adapters").glob("*.safetensors"))
    assert adapter_bytes < dense_bytes / 3

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "adapters")  # the base read from the recorded path
    assert isinstance(loaded, MoEForCausalLM)
    torch.testing.assert_close(_logits(loaded, ids), ref, rtol=0, atol=0)
    assert _adapter_and_router_names(loaded) == _adapter_and_router_names(model)
    with pytest.raises(CheckpointError, match="holds adapter experts.*take its `.model`"):
        type(loaded.model).from_pretrained(tmp_path / "adapters")  # the backbone class alone has no base to load
    with pytest.raises(ValueError, match=r"materialize them into plain experts first"):
        hf_moe.export_native(tmp_path / "adapters", tmp_path / "not-exported")
    counts = loaded.parameter_counts()  # the shared frozen MLP runs for every token: active, not per expert
    per_expert = sum(p.numel() for b in moe_blocks(loaded) for p in b.experts.parameters(recurse=False))
    assert counts["expert"] == per_expert and counts["total"] == loaded.num_parameters()
    assert counts["total"] - counts["active"] == per_expert // 2  # top-2 of 4: half the adapters idle per token

    plain = materialize(loaded)
    torch.testing.assert_close(_logits(plain, ids), ref, rtol=1e-5, atol=1e-5)
    assert plain.config.adapter_experts is None and all(p.requires_grad for p in plain.parameters())
    plain.save_pretrained(tmp_path / "plain")
    torch.testing.assert_close(_logits(MoEForCausalLM.from_pretrained(tmp_path / "plain"), ids), ref, rtol=1e-5,
                               atol=1e-5)
    export = hf_moe.export_native(tmp_path / "plain", tmp_path / "mixtral")
    assert export.model_type == "mixtral"
    native = AutoModelForCausalLM.from_pretrained(tmp_path / "mixtral")
    torch.testing.assert_close(_logits(native, ids), ref, rtol=1e-5, atol=1e-5)


def test_a_moved_or_other_base_is_an_error_that_says_which(dense_dir, tmp_path):
    ids = random_ids(2, 16)
    model = _randomize_adapters(convert_to_moe(dense_dir, num_experts=4, top_k=2, method="lora", rank=4)).eval()
    ref = _logits(model, ids)
    model.save_pretrained(tmp_path / "adapters")

    moved = tmp_path / "moved"
    shutil.move(dense_dir, moved)
    with pytest.raises(CheckpointError, match=r"which is not there \(was it moved\?\).*base=PATH"):
        MoEForCausalLM.from_pretrained(tmp_path / "adapters")
    torch.testing.assert_close(_logits(MoEForCausalLM.from_pretrained(tmp_path / "adapters", base=moved), ids), ref,
                               rtol=0, atol=0)

    tiny_dense("llama", seed=1).save_pretrained(tmp_path / "other")  # the same architecture, other weights
    with pytest.raises(CheckpointError, match="names, dtypes and shapes recorded, but other values"):
        MoEForCausalLM.from_pretrained(tmp_path / "adapters", base=tmp_path / "other")
    tiny_dense("llama", hidden_size=32).save_pretrained(tmp_path / "smaller")
    with pytest.raises(CheckpointError, match="differ in names, dtypes or shapes"):
        MoEForCausalLM.from_pretrained(tmp_path / "adapters", base=tmp_path / "smaller")

    (tmp_path / "adapters" / "model-expert-00003.safetensors").unlink()
    with pytest.raises((CheckpointError, FileNotFoundError), match="model-expert-00003"):
        MoEForCausalLM.from_pretrained(tmp_path / "adapters", base=moved)


def test_a_model_converted_in_memory_loads_with_base_given(tmp_path):
    """A dense model built in memory has no checkpoint to refer to: the save records none (and the fingerprint of its
    weights), and loading needs base=: a saved copy of it, or the model object itself."""
    ids = random_ids(2, 16)
    dense = tiny_dense("gpt2")
    model = _randomize_adapters(convert_to_moe(dense, num_experts=4, top_k=2, method="lora", rank=4)).eval()
    assert model.config.adapter_experts["base_model"]["name_or_path"] is None
    ref = _logits(model, ids)
    model.save_pretrained(tmp_path / "adapters")
    with pytest.raises(CheckpointError, match="converted from memory.*base=PATH_OR_MODEL"):
        MoEForCausalLM.from_pretrained(tmp_path / "adapters")
    loaded = MoEForCausalLM.from_pretrained(tmp_path / "adapters", base=dense)
    torch.testing.assert_close(_logits(loaded, ids), ref, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------------------
# Options and the CLI
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "family,options,error",
    [
        ("llama", dict(method="lora", rank=4, r=4), "rank once"),
        ("llama", dict(method="lora", target_modules=["q_proj"]), "target_modules must be a non-empty list"),
        ("gpt2", dict(method="lora", target_modules=["gate_proj"]), "has no gate"),
        ("llama", dict(method="lora", noise=0.1), r"\['noise'\] only apply to method='upcycle'"),
        ("llama", dict(method="pesc", num_shared_experts=1), "num_shared_experts must be 0"),
        ("llama", dict(method="upcycle", rank=4), r"only apply to method='lora'"),
        ("llama", dict(method="lora", lora_dropout=1.5), r"lora_dropout must be in \[0, 1\)"),
    ],
)
def test_bad_options_are_errors(family, options, error):
    with pytest.raises(ValueError, match=error):
        convert_to_moe(tiny_dense(family), num_experts=4, top_k=2, **options)


def test_lora_on_some_projections_with_peft_names():
    moe = convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, method="lora", r=2, lora_alpha=8,
                         target_modules=["up_proj"])
    experts = _adapters(moe)[0]
    assert experts.targets == ("up_proj",) and experts.scaling == 4.0 and experts.up_lora_A.shape == (4, 2, 64)
    assert not hasattr(experts, "gate_lora_A")


@pytest.mark.slow
def test_cli_convert_lora_verify_and_materialize(dense_dir, tmp_path, capsys):
    out, plain = tmp_path / "adapters", tmp_path / "plain"
    assert hf_moe_cli.main(["convert", str(dense_dir), str(out), "--num-experts", "4", "--top-k", "2", "--method",
                            "lora", "--rank", "4", "--target-modules", "gate_proj,up_proj"]) == 0
    printed = capsys.readouterr().out
    assert "trainable parameters (routers and adapters)" in printed and str(dense_dir.resolve()) in printed
    config = json.loads((out / "config.json").read_text())
    assert config["adapter_experts"]["target_modules"] == ["gate_proj", "up_proj"]
    assert (out / "tokenizer.json").is_file()
    assert hf_moe_cli.main(["verify", str(out)]) == 0
    assert hf_moe_cli.main(["materialize", str(out), str(plain)]) == 0
    model = MoEForCausalLM.from_pretrained(plain)
    assert model.config.adapter_experts is None and (plain / "tokenizer.json").is_file()
    ids = random_ids(2, 16)
    torch.testing.assert_close(_logits(model, ids), _logits(MoEForCausalLM.from_pretrained(out), ids), rtol=1e-5,
                               atol=1e-5)

    assert hf_moe_cli.main(["convert", str(dense_dir), str(tmp_path / "pesc"), "--num-experts", "4", "--top-k", "2",
                            "--method", "pesc", "--rank", "4"]) == 0
    assert hf_moe_cli.main(["materialize", str(tmp_path / "pesc"), str(tmp_path / "nope")]) == 2
    assert "cannot become plain experts" in capsys.readouterr().err
