"""Offloaded inference (hf_moe/offload): same tokens and logits as the fully loaded model, a bounded cache that
fetches only routed experts, prefetch, policies, clear errors, and `hf-moe generate`."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import random_ids, tiny_dense, tiny_tokenizer

from hf_moe import CheckpointError, MoEForCausalLM, convert_to_moe
from hf_moe.compat import cache_kwargs, output_cache
from hf_moe.offload import (
    DEFAULT_POLICY,
    ExpertLayout,
    OffloadedExperts,
    expert_cache,
    expert_slots,
    parse_memory_size,
)
from hf_moe.offload.policy import LFU, LRU, DecayedLFU, NextUse
from hf_moe.offload.simulate import simulate
from hf_moe.routing import moe_blocks

E, K = 8, 2
EXPERT_BYTES = 3 * 64 * 96 * 4  # GLU llama tiny: gate_up [192, 64] + down [64, 96], fp32
NUM_EXPERTS_TOTAL = 3 * E  # 3 MoE layers


def _save(tmp_path, router: str = "topk", **options):
    """A tiny llama MoE whose experts differ (noise) and whose routing matters, saved per expert."""
    moe = convert_to_moe(tiny_dense("llama"), num_experts=E, top_k=K, noise=0.5, router_type=router, **options)
    if router == "aux_free":  # a selection bias that changes the choices, as after training
        for block in moe_blocks(moe):
            block.gate.e_score_correction_bias.copy_(torch.randn(E) * 0.05)
    moe.save_pretrained(tmp_path / router)
    return tmp_path / router


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("offload"))


def _left_padded(batch: int = 3, length: int = 10):
    ids = random_ids(batch, length, seed=1)
    mask = torch.ones_like(ids)
    for row, pad in enumerate([4, 0, 2][:batch]):
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return ids, mask


def _generate(model, ids, mask, new_tokens: int = 6):
    """Greedy generation on transformers' eager path (a dynamic cache asked for: the fully loaded model's plain call
    may run the one-op decode step, whose kernels round otherwise)."""
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
            return_dict_in_generate=True, pad_token_id=0, eos_token_id=None, use_cache=True,
            cache_implementation="dynamic",
        )


# ------------------------------------------------------------------------------------------------------------------
# Same results as the fully loaded model
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("router", ["topk", "prototype", "aux_free"])
@pytest.mark.parametrize("mode", ["disk", "cpu"])
def test_generate_equals_fully_loaded(tmp_path, router, mode):
    """Greedy tokens and every step's logits (KV cache, batched left-padded prompts) match the fully loaded model,
    with a budget of one layer's k experts (several passes per prefill layer) and of a quarter of the experts."""
    directory = _save(tmp_path, router)
    full = MoEForCausalLM.from_pretrained(directory).eval()
    ids, mask = _left_padded()
    expected = _generate(full, ids, mask)
    for slots in (K, NUM_EXPERTS_TOTAL // 4):
        model = MoEForCausalLM.from_pretrained(directory, offload_experts=mode, max_expert_memory=slots * EXPERT_BYTES,
                                               offload_prefetch=slots > K)
        assert isinstance(model, type(full)) and type(model) is type(full)
        assert all(isinstance(b.experts, OffloadedExperts) for b in moe_blocks(model))
        got = _generate(model, ids, mask)
        assert torch.equal(got.sequences, expected.sequences)
        for a, b in zip(got.logits, expected.logits):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        cache = expert_cache(model)
        assert cache.num_slots == slots and cache.stats.uses > 0


def test_generate_equals_fully_loaded_with_torch_backend_bitwise(saved):
    """On the pure-torch ops the offloaded forward computes the very same products: logits are bit-identical."""
    from hf_moe.ops import use_backend

    full = MoEForCausalLM.from_pretrained(saved).eval()
    model = MoEForCausalLM.from_pretrained(saved, offload_experts="disk", max_expert_memory=3 * EXPERT_BYTES)
    ids, mask = _left_padded()
    with use_backend("torch"):
        expected, got = _generate(full, ids, mask, 4), _generate(model, ids, mask, 4)
    assert torch.equal(got.sequences, expected.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, expected.logits))


def test_model_follows_dtype_change(saved):
    """`model.to(torch.bfloat16)` moves the cache with it (rebuilt empty in the new dtype)."""
    full = MoEForCausalLM.from_pretrained(saved).eval().to(torch.bfloat16)
    model = MoEForCausalLM.from_pretrained(saved, offload_experts="disk", max_expert_memory="1MiB").to(torch.bfloat16)
    ids = random_ids(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, full(ids).logits, rtol=0, atol=0)
    assert expert_cache(model).dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------------------------------
# What is fetched, and the budget
# ------------------------------------------------------------------------------------------------------------------
def test_only_routed_experts_are_read_and_cache_is_bounded(saved):
    """Without prefetch, the experts read are exactly those the routers picked; never more resident than fit."""
    budget = 5 * EXPERT_BYTES + 100
    model = MoEForCausalLM.from_pretrained(saved, offload_experts="disk", max_expert_memory=budget,
                                           offload_prefetch=False)
    cache = expert_cache(model)
    reads = []
    read = cache.store.read_into

    def counting_read(layer, expert, dst):
        reads.append((layer, expert))
        assert len(cache.table) <= cache.num_slots
        return read(layer, expert, dst)

    cache.fetcher.read = counting_read
    ids = random_ids(1, 6)
    with torch.no_grad(), model.base_model.router_recorder.recording() as routings:
        model(ids)
    routed = {(layer, e) for layer, r in enumerate(routings) for e in r.top_k_index.unique().tolist()}
    assert set(reads) == routed and len(reads) == len(routed)
    assert cache.num_slots == 5 and cache.pool_bytes() <= budget
    assert cache.stats.demand_fetches == len(routed) and cache.stats.prefetches == 0


def test_prefetch_predicts_next_layer_and_reports_accuracy(saved):
    """Prefetch reads layer l+1's predicted experts while layer l runs; the router recorder still sees one routing
    per layer (the prediction calls the router outside its block); hit rate and accuracy are reported."""
    model = MoEForCausalLM.from_pretrained(saved, offload_experts="cpu", max_expert_memory=NUM_EXPERTS_TOTAL * EXPERT_BYTES,
                                           offload_prefetch=True)
    cache = expert_cache(model)
    cache.trace = []
    ids = random_ids(1, 5)
    blocks = moe_blocks(model)
    inputs = []
    handle = blocks[0].register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
    with torch.no_grad(), model.base_model.router_recorder.recording() as routings:
        out = model(ids, use_cache=True)
        model(ids[:, :1], **cache_kwargs(output_cache(out)), use_cache=True)
    handle.remove()
    assert len(routings) == 2 * 3
    s = cache.stats
    assert s.prefetches > 0 and 0 < s.prefetches_used <= s.prefetches
    assert 0 < s.prefetch_accuracy <= 1 and 0 < s.hit_rate <= 1
    assert "hit rate" in s.summary() and "prefetch accuracy" in s.summary()
    # The guess for layer 1 is layer 1's router applied to layer 0's hidden states; the last layer guesses nothing.
    layer0, used0, predicted1 = cache.trace[0]
    with torch.no_grad():
        expected = blocks[1].gate(inputs[0].reshape(-1, inputs[0].shape[-1])).top_k_index.unique().tolist()
    assert layer0 == 0 and used0 and predicted1 == expected
    assert cache.trace[2][2] == []


def test_read_failure_is_clear_and_leaves_cache_consistent(saved, tmp_path):
    """A file truncated after loading: the read error names it, and the failed slot is not left as resident."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)
    model = MoEForCausalLM.from_pretrained(copy, offload_experts="disk", max_expert_memory="1MiB",
                                           offload_prefetch=False)
    for name in os.listdir(copy):
        if name.startswith("model-expert-"):
            with open(copy / name, "r+b") as f:
                f.truncate(200)
    with pytest.raises(CheckpointError, match="truncated or replaced"), torch.no_grad():
        model(random_ids(1, 4))
    assert len(expert_cache(model).table) == 0


# ------------------------------------------------------------------------------------------------------------------
# Clear errors
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("budget", "error", "match"),
    [
        (K * EXPERT_BYTES - 1, ValueError, "fewer than the 2 experts one layer needs"),
        (-5, ValueError, "must be a positive size"),
        ("-1GiB", ValueError, "must be a positive size"),
        (0, ValueError, "must be a positive size"),
        ("lots", ValueError, "is not a size"),
        ("1.5GiB", ValueError, "is not a size"),
        (1.5e9, TypeError, "takes bytes"),
        (None, ValueError, "needs max_expert_memory"),
    ],
)
def test_bad_budgets_are_clear_errors(saved, budget, error, match):
    with pytest.raises(error, match=match):
        MoEForCausalLM.from_pretrained(saved, offload_experts="disk", max_expert_memory=budget)


def test_auto_class_loads_offloaded(saved):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(saved, offload_experts="disk", max_expert_memory="1MiB")
    cache = expert_cache(model)
    assert isinstance(model, MoEForCausalLM) and cache.num_slots == 14
    assert cache.prefetch is False  # a CPU cache: prefetching off by default (measured, see ExpertCache)


def test_budget_parsing():
    assert parse_memory_size("1GiB") == 2**30
    assert parse_memory_size(" 512MiB ") == 512 * 2**20
    assert parse_memory_size("2GB") == 2 * 10**9
    assert parse_memory_size("123456") == 123456
    assert parse_memory_size(4096) == 4096
    assert expert_slots(10**12, 1000, 2, 24) == 24  # capped at every expert of the model


def test_bad_mode_and_incompatible_options_are_clear_errors(saved):
    with pytest.raises(ValueError, match="offload_experts must be 'disk'"):
        MoEForCausalLM.from_pretrained(saved, offload_experts="gpu", max_expert_memory="1MiB")
    with pytest.raises(ValueError, match="do not compose"):
        MoEForCausalLM.from_pretrained(saved, offload_experts="disk", max_expert_memory="1MiB", expert_parallel=True)
    with pytest.raises(ValueError, match="runs on the CPU"):
        MoEForCausalLM.from_pretrained(saved, offload_experts="disk", max_expert_memory="1MiB", device_map="cuda")
    with pytest.raises(FileNotFoundError, match="local directory"):
        MoEForCausalLM.from_pretrained(saved / "nope", offload_experts="disk", max_expert_memory="1MiB")
    with pytest.raises(ValueError, match="Unknown expert cache policy"):
        MoEForCausalLM.from_pretrained(saved, offload_experts="disk", max_expert_memory="1MiB", offload_policy="mru")


def test_inference_only_and_no_save(saved, tmp_path):
    model = MoEForCausalLM.from_pretrained(saved, offload_experts="disk", max_expert_memory="1MiB")
    model.get_input_embeddings().weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="for inference"):
        model(random_ids(1, 4))
    with pytest.raises(RuntimeError, match="Load it without offload_experts to save it"):
        model.save_pretrained(tmp_path / "resaved")
    assert not (tmp_path / "resaved").exists()


@pytest.mark.parametrize(
    "checksums, message",
    [
        (True, r"its header \(tensor names, dtypes, shapes, offsets\) differs"),
        (False, r"stores model.layers.0.mlp.experts.3.down_proj with shape \[96, 64\], but config.json makes it"),
    ],
    ids=["header-checksum", "no-checksums"],
)
def test_corrupt_expert_header_is_refused_at_load(saved, tmp_path, checksums, message):
    """An expert tensor whose header shape disagrees with the config is refused before anything is read.

    The header hash saved in the index names it; in a checkpoint without checksums (saved by an older hf_moe) the shape
    check against the config still does.
    """
    import shutil
    import struct

    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)
    path = copy / "model-expert-00003.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    key = next(k for k in header if k.endswith("down_proj"))
    header[key]["shape"] = header[key]["shape"][::-1]  # same byte count, wrong shape
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    text = text.ljust(n)
    path.write_bytes(raw[:8] + text + raw[8 + n :])
    if not checksums:
        index_path = copy / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        del index["metadata"]["checksums"]
        index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=message):
        MoEForCausalLM.from_pretrained(copy, offload_experts="disk", max_expert_memory="1MiB")


def test_layout_matches_experts_module(saved):
    from hf_moe import MoEConfig

    layout = ExpertLayout.from_config(MoEConfig.from_pretrained(saved))
    full = MoEForCausalLM.from_pretrained(saved)
    experts = moe_blocks(full)[0].experts
    assert {n: tuple(p.shape[1:]) for n, p in experts.named_parameters()} == layout.shapes
    assert layout.expert_bytes(torch.float32) == EXPERT_BYTES


# ------------------------------------------------------------------------------------------------------------------
# Policies
# ------------------------------------------------------------------------------------------------------------------
def test_policies_choose_their_victims():
    lru, lfu, decayed, next_use = LRU(), LFU(), DecayedLFU(half_life=2), NextUse()
    for policy in (lru, lfu, decayed):
        for key in [(0, 1), (0, 1), (0, 1), (0, 2), (0, 3)]:
            policy.use(key)
    assert lru.victim([(0, 1), (0, 2), (0, 3)]) == (0, 1)  # least recent
    assert lfu.victim([(0, 1), (0, 2), (0, 3)]) == (0, 2)  # least frequent, then least recent
    for _ in range(6):
        decayed.use((0, 3))
    decayed.use((0, 2))
    assert decayed.victim([(0, 1), (0, 2), (0, 3)]) == (0, 1)  # its three old uses have decayed away
    # next_use: equal frequencies; layer 2 just ran, so its expert is wanted last in the loop.
    for layer in (0, 1, 2):
        next_use.visit(layer, 3)
        next_use.use((layer, 0))
    assert next_use.victim([(0, 0), (1, 0), (2, 0)]) == (2, 0)


def test_simulated_policies_on_a_skewed_loop():
    """Layers visited in a loop with skewed routing: frequency keeps the hot experts better than recency, Belady
    bounds them all, and prefetching the (here exactly known) next layer's experts turns misses into hits."""
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([8.0, 4, 2, 1, 1, 1, 1, 1])
    trace = []
    for _ in range(200):
        for layer in range(4):
            picked = sorted(torch.multinomial(probs, 2, generator=g).tolist())
            trace.append([layer, picked, []])
    for i in range(len(trace) - 1):
        trace[i][2] = trace[i + 1][1] if trace[i + 1][0] == trace[i][0] + 1 else []
    rates = {p: simulate(trace, 8, 8, 2, p, prefetch=False).hit_rate for p in ("lru", "lfu", "next_use", "belady")}
    assert rates["lru"] + 0.05 < rates["lfu"] <= rates["belady"] and rates["next_use"] <= rates["belady"]
    ahead = simulate(trace, 8, 8, 2, DEFAULT_POLICY, prefetch=True)
    assert ahead.hit_rate > rates[DEFAULT_POLICY] and ahead.prefetch_accuracy == 1.0


# ------------------------------------------------------------------------------------------------------------------
# hf-moe generate
# ------------------------------------------------------------------------------------------------------------------
def test_cli_generate_streams_and_reports(saved, tmp_path, capsys):
    from hf_moe.cli import main

    tiny_tokenizer().save_pretrained(saved)
    code = main(["generate", str(saved), "the quick", "--offload-experts", "disk", "--max-expert-memory", "300KB",
                 "--max-new-tokens", "5"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.strip()  # the streamed text
    assert "decode" in err and "tok/s" in err and "peak RSS" in err and "hit rate" in err
    full = MoEForCausalLM.from_pretrained(saved).eval()
    tok = tiny_tokenizer()
    ids = tok("the quick", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = full.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.strip() == tok.decode(expected[0, ids.shape[1]:], skip_special_tokens=True).strip()

    assert main(["generate", str(saved), "x", "--offload-experts", "disk", "--max-expert-memory", "1KB"]) == 2
    assert "fewer than the 2 experts" in capsys.readouterr().err
    assert main(["generate", str(saved), "x", "--offload-experts", "disk", "--max-expert-memory", "much"]) == 2
    assert "is not a size" in capsys.readouterr().err


def _storage_reads() -> int:
    """Bytes this process has had read from storage (page cache misses, read-ahead included)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def _evict(directory) -> None:
    os.sync()
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@pytest.mark.skipif(not os.path.exists("/proc/self/io") or not hasattr(os, "posix_fadvise"),
                    reason="needs Linux's /proc/self/io and posix_fadvise to count reads from storage")
def test_an_expert_read_takes_only_its_bytes_from_storage(saved):
    """Reading an expert from disk reads its bytes and no read-ahead: under a memory limit smaller than the model,
    read-ahead pages (the kernel's default window reaches other experts) are evicted before use and read again, so
    every read cost several times its bytes."""
    model = MoEForCausalLM.from_pretrained(saved, offload_experts="disk", max_expert_memory=3 * EXPERT_BYTES)
    store = expert_cache(model).store
    whole = os.path.join(saved, "model-expert-00000.safetensors")
    _evict(saved)
    before = _storage_reads()
    with open(whole, "rb") as f:
        f.read()
    if _storage_reads() - before < os.path.getsize(whole):
        pytest.skip("this filesystem does not report reads from storage in /proc/self/io (tmpfs?)")
    _evict(saved)
    dst = {name: torch.empty(shape) for name, shape in store.layout.shapes.items()}
    before = _storage_reads()
    assert store.read_into(0, 0, dst) == EXPERT_BYTES  # the first layer's: where the file's read-ahead starts
    extra = _storage_reads() - before - EXPERT_BYTES
    assert extra <= 2 * len(dst) * 4096, f"{extra} bytes read beyond the expert's {EXPERT_BYTES} (read-ahead)"
