"""The tool matrix: the tools users bring, each run for real and unpatched on a tiny converted model.

TRL's SFTTrainer, PEFT LoRA (attention and the fused expert parameters) with save, reload and merge,
AutoPeftModelForCausalLM, DeepSpeed ZeRO-3 against ZeRO-2, lm-eval's HFLM and `pipeline("text-generation")`. The tools
that build the model from a path (AutoPeftModel, lm-eval, pipeline) are also run in a fresh process, which imports
hf_moe (without it, the model type is unknown to transformers: the error names hf_moe). torch.compile without graph
breaks is tested in test_integration.py. docs/tools.md is the summary of this file, and the README's "Works with"
table the summary of that.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import CORPUS, SPECIAL_IDS, VOCAB, random_ids, tiny_dense, tiny_tokenizer
from transformers import AutoConfig, AutoModelForCausalLM

from hf_moe import MoEForCausalLM, convert_to_moe
from hf_moe.routing import moe_blocks

ROOT = Path(__file__).resolve().parents[1]
LORA = dict(
    r=4,
    lora_alpha=8,
    target_modules=["q_proj", "v_proj"],
    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    init_lora_weights=False,  # non-zero adapters from the start: merging must then change the expert weights
)


def _fresh(fresh_python, code: str, timeout: int = 300) -> str:
    """Run `code` in a process that has not imported hf_moe (which imports it itself, where it does); its stdout.
    Fails with its stderr. stdin is /dev/null, so a trust_remote_code prompt answers "no" instead of waiting."""
    result = fresh_python.run(textwrap.dedent(code), timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


@pytest.fixture(scope="module")
def saved(tiny_moe) -> Path:
    """A converted tiny llama (4 experts, top-2) with its tokenizer, saved: conftest's tiny_moe (read-only)."""
    return tiny_moe.path


def _text_dataset():
    from datasets import Dataset

    return Dataset.from_dict({"text": [CORPUS[i : i + 60] for i in range(0, 200, 20)]})


def _changed(before: dict, after: dict) -> dict:
    keys = sorted(before.keys() | after.keys())
    return {k: (before.get(k), after.get(k)) for k in keys if before.get(k) != after.get(k)}


def _sft_config(output_dir, **kwargs):
    from trl import SFTConfig

    # TRL's defaults (bf16, gradient checkpointing, its fused LM head, the aux loss from the model config), except
    # use_cpu: TRL defaults to bf16 and transformers refuses bf16 on a machine without a GPU unless told.
    return SFTConfig(str(output_dir), use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True, **kwargs)


# --------------------------------------------------------------------------------------------------------------
# TRL
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_trl_sft_trainer_trains_with_the_aux_loss(tmp_path):
    """TRL's fused LM head runs the backbone and computes Mixtral's `load_balancing_loss_func` from its
    `router_logits`; on a converted model it crashed (`BaseModelOutputWithPast` has no `router_logits`)."""
    pytest.importorskip("trl")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    from trl import SFTTrainer

    torch.manual_seed(0)
    moe = convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2)
    coef = moe.config.router_aux_loss_coef
    assert coef == 0.01
    trainer = SFTTrainer(
        model=moe, args=_sft_config(tmp_path / "run", max_steps=5, logging_steps=1), train_dataset=_text_dataset(),
        processing_class=tiny_tokenizer(),
    )
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == coef

    # One batch, the way TRL computes its loss: the aux loss is non-zero, has a gradient for the routers, is what
    # transformers' function gives on the router logits of the model's own forward, and enters the loss.
    batch = next(iter(trainer.get_train_dataloader()))
    moe.train()
    out = moe(**batch, use_cache=False, output_router_logits=True, fused_lm_head=True)
    assert out.aux_loss.item() > 0 and out.aux_loss.requires_grad
    gates = [block.gate.weight for block in moe_blocks(moe)]
    grads = torch.autograd.grad(out.aux_loss, gates)
    assert all(g.abs().sum() > 0 for g in grads)
    with torch.no_grad():
        head = moe(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True)
        expected_aux = load_balancing_loss_func(head.router_logits, 4, 2, batch["attention_mask"])
    torch.testing.assert_close(out.aux_loss.detach(), expected_aux, rtol=1e-6, atol=0)
    loss = trainer.compute_loss(moe, dict(batch))
    nll = -out.log_probs.sum() / out.label_mask.sum()
    torch.testing.assert_close(loss.detach(), (nll + coef * out.aux_loss).detach(), rtol=1e-6, atol=0)

    trainer.train()
    steps = [log for log in trainer.state.log_history if "loss" in log]
    assert len(steps) == 5 and all(log["aux_loss"] > 0 and torch.isfinite(torch.tensor(log["loss"])) for log in steps)
    assert moe.routing_stats.forwards > 0  # the backbone alone still fed the routing statistics

    trainer.save_model(str(tmp_path / "final"))
    config = json.loads((tmp_path / "final" / "config.json").read_text())
    assert config["router_aux_loss_coef"] == coef
    assert config["output_router_logits"] is True  # set by TRL on the live config, as for Mixtral (next test)
    # The checkpoint holds the trained weights. (Compared as tensors: Trainer leaves the live model's forward
    # wrapped in accelerate's bf16 autocast, so its logits are not the fp32 ones of a reloaded model.)
    reloaded = MoEForCausalLM.from_pretrained(tmp_path / "final").state_dict()
    trained = moe.state_dict()
    assert reloaded.keys() == trained.keys() and all(torch.equal(reloaded[k], trained[k]) for k in trained)


def _trl_trainer(kind: str, model, output_dir):
    """TRL's SFT, DPO or GRPO trainer for one step, with TRL's defaults otherwise (see `_sft_config`)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTTrainer

    common = dict(use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True, max_steps=1, logging_steps=1)
    pieces = [CORPUS[i : i + 20] for i in range(0, 160, 20)]
    if kind == "sft":
        return SFTTrainer(model=model, args=_sft_config(output_dir, max_steps=1), train_dataset=_text_dataset(),
                          processing_class=tiny_tokenizer())
    if kind == "dpo":
        pairs = Dataset.from_dict({"prompt": pieces, "chosen": pieces[1:] + pieces[:1], "rejected": pieces[::-1]})
        return DPOTrainer(model=model, ref_model=copy.deepcopy(model), train_dataset=pairs,
                          args=DPOConfig(str(output_dir), per_device_train_batch_size=2, **common),
                          processing_class=tiny_tokenizer())

    def reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    return GRPOTrainer(model=model, reward_funcs=reward, train_dataset=Dataset.from_dict({"prompt": pieces}),
                       args=GRPOConfig(str(output_dir), per_device_train_batch_size=4, num_generations=2,
                                       max_completion_length=8, **common),
                       processing_class=tiny_tokenizer())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sft", "dpo", "grpo"])
def test_trl_trainers_weigh_the_balancing_loss_as_trainer_does(kind, tmp_path):
    """TRL's SFT, DPO and GRPO trainers add `router_aux_loss_coef` x transformers' `load_balancing_loss_func` of the
    backbone's router logits (their fused LM head); `transformers.Trainer` adds the same coefficient x the head's own
    `aux_loss`. The two are on one scale (it was k times hf_moe's), so one coefficient gives one weight. Compared on
    every forward of a real training step, against the model's own forward on the same inputs. One MoE layer: with
    several, transformers pools the layers' router logits where hf_moe averages the layers' losses (docs/tools.md)."""
    pytest.importorskip("trl")
    torch.manual_seed(0)
    moe = convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, layers=[1])
    trainer = _trl_trainer(kind, moe, tmp_path / kind)
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == moe.config.router_aux_loss_coef == 0.01

    compared = []

    def compare(module, args, kwargs, output):
        if not kwargs.get("fused_lm_head") or output.aux_loss is None:
            return  # the model's own forward (below), or a forward without the balancing loss
        inputs = {k: kwargs[k] for k in ("input_ids", "attention_mask") if kwargs.get(k) is not None}
        with torch.no_grad():
            own = module(**inputs, output_router_logits=True, use_cache=False).aux_loss
        compared.append((output.aux_loss.detach().float(), own.float()))

    moe.register_forward_hook(compare, with_kwargs=True)
    trainer.train()
    assert compared and all(trl > 1.5 for trl, _ in compared)  # near k = 2 for a near-uniform top-2 routing
    for trl, own in compared:
        torch.testing.assert_close(trl, own, rtol=1e-5, atol=0)
    logged = [log["aux_loss"] for log in trainer.state.log_history if "aux_loss" in log]
    assert logged and logged[0] > 1.5


def test_trl_changes_the_same_config_fields_as_on_mixtral(tmp_path):
    """SFTTrainer sets `output_router_logits` (and Trainer `use_cache`) on the live config; a converted model gets
    exactly what transformers' own Mixtral gets, and `router_aux_loss_coef` stays the model's."""
    pytest.importorskip("trl")
    from trl import SFTTrainer

    mixtral = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "mixtral", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **SPECIAL_IDS,
    ))
    moe = convert_to_moe(tiny_dense("llama", num_hidden_layers=2), num_experts=4, top_k=2)
    changes = []
    for model in (mixtral, moe):
        before = model.config.to_dict()
        SFTTrainer(model=model, args=_sft_config(tmp_path / "run"), train_dataset=_text_dataset(),
                   processing_class=tiny_tokenizer())
        changes.append(_changed(before, model.config.to_dict()))
    assert changes[0] == changes[1] == {"output_router_logits": (False, True), "use_cache": (True, False)}


# --------------------------------------------------------------------------------------------------------------
# PEFT
# --------------------------------------------------------------------------------------------------------------
def test_peft_lora_on_attention_and_experts_save_reload_merge(saved, tmp_path):
    """LoRA on q/v and on the fused 3-D expert parameters (`target_parameters`): it trains, saves, reloads onto a
    freshly loaded base to equal logits, and merges into an MoE model whose logits match the adapted model's."""
    pytest.importorskip("peft")
    from peft import LoraConfig, PeftModel, get_peft_model

    ids = random_ids()
    base = MoEForCausalLM.from_pretrained(saved).eval()
    with torch.no_grad():
        base_logits = base(ids).logits
    experts = {n: p.detach().clone() for n, p in base.named_parameters() if ".experts." in n}
    torch.manual_seed(0)
    peft_model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **LORA))
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert all("lora_" in n for n in trainable)
    assert sum(".experts." in n for n in trainable) == 2 * 2 * 3  # A and B, gate_up and down, 3 MoE layers

    peft_model.train()
    peft_model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad}
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if ".experts." in n)

    peft_model.eval()
    with torch.no_grad():
        adapted = peft_model(ids).logits
    assert (adapted - base_logits).abs().max() > 1e-2  # the adapters do something
    peft_model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(MoEForCausalLM.from_pretrained(saved), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, adapted, rtol=0, atol=0)

    merged = reloaded.merge_and_unload()
    assert isinstance(merged, MoEForCausalLM)
    assert all(not torch.equal(p, experts[n]) for n, p in merged.named_parameters() if n in experts)
    with torch.no_grad():
        merged_logits = merged(ids).logits
    # W x + B (A x) against (W + B A) x: the same function, summed in another order (fp32 rounding, ~1e-7 here; the
    # adapters move the logits by more than 1e-2).
    torch.testing.assert_close(merged_logits, adapted, rtol=1e-5, atol=1e-5)
    merged.save_pretrained(tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(
            MoEForCausalLM.from_pretrained(tmp_path / "merged")(ids).logits, merged_logits, rtol=0, atol=0
        )


@pytest.fixture(scope="module")
def adapters(saved, tmp_path_factory):
    """LoRA adapters over `saved`, one saved with task_type="CAUSAL_LM" and one without, and their logits."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("adapters")
    ids = random_ids()
    torch.save(ids, root / "ids.pt")
    for name, task_type in (("causal_lm", "CAUSAL_LM"), ("no_task_type", None)):
        torch.manual_seed(0)
        model = get_peft_model(MoEForCausalLM.from_pretrained(saved), LoraConfig(task_type=task_type, **LORA)).eval()
        model.save_pretrained(root / name)
        with torch.no_grad():
            torch.save(model(ids).logits, root / f"{name}.pt")
    return root


@pytest.mark.subprocess
@pytest.mark.slow
def test_auto_peft_model_with_task_type_in_a_fresh_process(fresh_python, adapters):
    """With task_type="CAUSAL_LM", AutoPeftModelForCausalLM loads the base through AutoModelForCausalLM: in a
    process that never imported hf_moe its model type is unknown (the error names it); after `import hf_moe` it
    loads."""
    root = adapters
    _fresh(fresh_python, f"""
        import sys, torch
        from peft import AutoPeftModelForCausalLM
        try:
            AutoPeftModelForCausalLM.from_pretrained({str(root / 'causal_lm')!r}, trust_remote_code=True)
            raise SystemExit("loaded an hf_moe model without hf_moe")
        except ValueError as err:
            assert "model type `hf_moe`" in str(err), err
        assert "hf_moe" not in sys.modules
        import hf_moe
        model = AutoPeftModelForCausalLM.from_pretrained({str(root / 'causal_lm')!r})
        assert type(model.get_base_model()).__module__ == "hf_moe.modeling"
        with torch.no_grad():
            torch.save(model(torch.load({str(root / 'ids.pt')!r})).logits, {str(root / 'fresh_causal_lm.pt')!r})
    """)
    torch.testing.assert_close(
        torch.load(root / "fresh_causal_lm.pt"), torch.load(root / "causal_lm.pt"), rtol=0, atol=0
    )


@pytest.mark.subprocess
@pytest.mark.slow
def test_auto_peft_model_without_task_type_needs_import_allowlist(fresh_python, adapters):
    """Saved without task_type, an adapter records the base class's module (`hf_moe.modeling`), and PEFT refuses to
    import a library outside its allowlist: its own safeguard. The documented way is `import_allowlist=["hf_moe"]`
    (then PEFT imports hf_moe itself, and trust_remote_code is not needed)."""
    root = adapters
    config = json.loads((root / "no_task_type" / "adapter_config.json").read_text())
    assert config["task_type"] is None
    assert config["auto_mapping"] == {"base_model_class": "MoELlamaForCausalLM", "parent_library": "hf_moe.modeling"}
    _fresh(fresh_python, f"""
        import sys, torch
        from peft import AutoPeftModelForCausalLM
        try:
            AutoPeftModelForCausalLM.from_pretrained({str(root / 'no_task_type')!r}, trust_remote_code=True)
            raise SystemExit("PEFT imported a library outside its allowlist")
        except ValueError as err:
            assert "import allowlist" in str(err), err
        assert "hf_moe" not in sys.modules
        model = AutoPeftModelForCausalLM.from_pretrained({str(root / 'no_task_type')!r}, import_allowlist=["hf_moe"])
        with torch.no_grad():
            torch.save(model(torch.load({str(root / 'ids.pt')!r})).logits, {str(root / 'fresh_no_task_type.pt')!r})
    """)
    torch.testing.assert_close(
        torch.load(root / "fresh_no_task_type.pt"), torch.load(root / "no_task_type.pt"), rtol=0, atol=0
    )


# --------------------------------------------------------------------------------------------------------------
# DeepSpeed
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.distributed
def test_deepspeed_zero3_matches_zero2(tmp_path):
    """ZeRO-3 on CPU with 2 gloo processes failed on the first backward (`The size of tensor a (0) must match the
    size of tensor b (64)`): its hooks did not look inside the router's dataclass output. It now trains, with every
    parameter partitioned, to the losses of ZeRO-2.

    Tolerance: relative 1e-5 on the losses of 4 steps (seen: 1e-7). The forward is the same, but ZeRO-3 wraps every
    module's inputs and outputs in autograd functions of its own, which changes the order in which autograd sums the
    gradient of a tensor read by several modules (a hidden state feeding q, k and v, or a router and its experts):
    the first step's gradients differ from ZeRO-2's in the last fp32 bit, and a plain dense llama shows the same
    differences (about 4e-8 on gradients of up to 0.2), so it is DeepSpeed's rounding, not hf_moe's. No gradient
    clipping, whose norm would add another summation order."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (scripts/test.sh installs it; see docs/tools.md)")
    out = tmp_path / "losses.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "dist" / "deepspeed_zero.py"), str(out)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    skip = [line for line in result.stdout.splitlines() if line.startswith("SKIP")]
    if result.returncode == 0 and skip:
        pytest.skip(skip[0][5:])
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    losses = json.loads(out.read_text())
    zero2, zero3 = losses["zero2"], losses["zero3"]
    assert zero3["local_numel"] == 0 and zero3["numel"] == zero2["numel"] == zero2["local_numel"]  # it did shard
    torch.testing.assert_close(zero3["loss"], zero2["loss"], rtol=1e-5, atol=0)
    torch.testing.assert_close(zero3["aux_loss"], zero2["aux_loss"], rtol=1e-5, atol=0)
    assert all(a > 0 for a in zero3["aux_loss"])
    assert zero3["loss"][-1] < zero3["loss"][0]  # the steps trained


# --------------------------------------------------------------------------------------------------------------
# lm-eval and pipeline: by path
# --------------------------------------------------------------------------------------------------------------
def _loglikelihood(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """log p(continuation | context) computed directly from the model's logits, on the tokens lm-eval feeds it
    (context + continuation without its last token)."""
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    n = len(whole) - len(tokenizer(context, add_special_tokens=False).input_ids)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([whole[:-1]])).logits, dim=-1)[0, -n:]
    target = torch.tensor(whole[-n:])
    return float(logprobs.gather(-1, target[:, None]).sum()), bool((logprobs.argmax(-1) == target).all())


REQUESTS = [("the quick", " brown fox"), ("a mixture of", " experts"), ("", "sparse models")]


@pytest.mark.subprocess
@pytest.mark.slow
def test_lm_eval_hflm_loglikelihood_by_path_in_a_fresh_process(fresh_python, saved, tmp_path):
    """lm-eval builds the model from the path, in a process that imported hf_moe (in one that did not, transformers
    does not know the model type: docs/tools.md says how to run its command line); its log-likelihoods equal the
    model's own."""
    pytest.importorskip("lm_eval")
    out = tmp_path / "loglikelihood.json"
    _fresh(fresh_python, f"""
        import json, sys
        from lm_eval.api.instance import Instance
        from lm_eval.models.huggingface import HFLM
        import hf_moe
        lm = HFLM(pretrained={str(saved)!r}, batch_size=1, device="cpu")
        assert type(lm.model).__name__ == "MoELlamaForCausalLM"
        requests = [Instance("loglikelihood", {{}}, r, i) for i, r in enumerate({REQUESTS!r})]
        json.dump(lm.loglikelihood(requests, disable_tqdm=True), open({str(out)!r}, "w"))
    """)
    model, tokenizer = MoEForCausalLM.from_pretrained(saved).eval(), tiny_tokenizer()
    # An empty context is conditioned on a prefix token (lm-eval's `prefix_token_id`: BOS if the tokenizer has one,
    # else EOS); this tokenizer has BOS.
    expected = [_loglikelihood(model, tokenizer, c or tokenizer.bos_token, x) for c, x in REQUESTS]
    assert [tuple(r) for r in json.loads(out.read_text())] == expected


def _greedy(model, tokenizer, prompt: str, n: int) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    return model.generate(ids, max_new_tokens=n, do_sample=False)[0].tolist()


def test_pipeline_text_generation_after_import(saved):
    """After `import hf_moe`, pipeline("text-generation", model=path) needs nothing more; its greedy tokens equal
    `model.generate`'s."""
    from transformers import pipeline

    generator = pipeline("text-generation", model=str(saved))
    assert isinstance(generator.model, MoEForCausalLM)
    out = generator("the quick", max_new_tokens=8, do_sample=False, return_tensors=True)
    model = MoEForCausalLM.from_pretrained(saved).eval()
    assert out[0]["generated_token_ids"] == _greedy(model, tiny_tokenizer(), "the quick", 8)


@pytest.mark.subprocess
@pytest.mark.slow
def test_pipeline_text_generation_in_a_fresh_process(fresh_python, saved, tmp_path):
    """Without `import hf_moe`, pipeline(...) (trust_remote_code=True too) is an error that names the model type
    `hf_moe`; in the same process after `import hf_moe`, it generates the model's greedy tokens."""
    out = tmp_path / "tokens.json"
    _fresh(fresh_python, f"""
        import json, sys
        from transformers import pipeline
        try:
            pipeline("text-generation", model={str(saved)!r}, trust_remote_code=True)
            raise SystemExit("loaded an hf_moe model without hf_moe")
        except ValueError as err:
            assert "model type `hf_moe`" in str(err), err
        assert "hf_moe" not in sys.modules
        import hf_moe
        generator = pipeline("text-generation", model={str(saved)!r})
        assert type(generator.model).__name__ == "MoELlamaForCausalLM"
        out = generator("the quick", max_new_tokens=8, do_sample=False, return_tensors=True)
        json.dump(out[0]["generated_token_ids"], open({str(out)!r}, "w"))
    """)
    model = MoEForCausalLM.from_pretrained(saved).eval()
    assert json.loads(out.read_text()) == _greedy(model, tiny_tokenizer(), "the quick", 8)


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_tokenizer_loads_without_a_question_in_a_fresh_process(saved):
    """Where hf_moe was not imported, the tokenizer loads asking nothing and warning nothing (stdin closed: a question
    would fail), with or without trust_remote_code and through its class; the three agree (the plain call's own test
    is in test_tokenizer_without_hf_moe.py)."""
    code = textwrap.dedent(f"""
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
        a = AutoTokenizer.from_pretrained({str(saved)!r}, trust_remote_code=True)
        b = PreTrainedTokenizerFast.from_pretrained({str(saved)!r})
        c = AutoTokenizer.from_pretrained({str(saved)!r})
        print(a("the fox").input_ids == b("the fox").input_ids == c("the fox").input_ids)
    """)
    result = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=300,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0 and result.stdout.strip() == "True", result.stderr[-3000:]
    assert "custom code" not in result.stderr and "warn" not in result.stderr.lower(), result.stderr[-3000:]
