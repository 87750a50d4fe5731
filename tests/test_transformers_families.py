"""Every MoE family of the installed transformers, tiny and random, on `experts_implementation="hf_moe"`.

The families are read from transformers itself: every modeling module whose experts carry
`@use_experts_implementation` (and so dispatch through the ExpertsInterface), with a causal-LM class, so a family
that a new transformers adds is checked without a change here. Each is built from its own default config shrunk to a
few layers of width 32 (`tiny_config`: the layers kept are the first of each kind its per-layer lists name, so a
hybrid keeps its attention, its linear attention, its dense and its MoE layers), and compared with its default
experts: logits, loss, every gradient, greedy generation, and a save and reload; hf_moe's experts function must have
run. Families whose layout hf_moe's kernels do not take (transposed or interleaved weights, custom gating, a norm after
each expert) are passed on to transformers' grouped_mm by that function, as `hf_moe.ops.experts_interface` says; the
test records which.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, model_type_to_module_name
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import hf_moe  # noqa: F401  (registers "hf_moe" in transformers' ExpertsInterface)
from hf_moe.compat import ALL_EXPERTS_FUNCTIONS
from hf_moe.ops import experts_interface

VOCAB, WIDTH, HEADS, HEAD_DIM, EXPERTS, TOP_K = 64, 32, 2, 16, 4, 2
MAX_LAYERS = 6
# What the generic shrinking cannot know: fields whose defaults leave a family without MoE layers, or that it checks
# against each other. A new family that fails to build tiny gets an entry here.
OVERRIDES = {
    "dots3_note_text": dict(head_dim=HEAD_DIM),  # (its sliding layers take head_dim = nope + rope)
    "gemma4_text": dict(enable_moe_block=True, num_experts=EXPERTS, top_k_experts=TOP_K, moe_intermediate_size=WIDTH),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),  # (the default has no attention)
    "jamba": dict(attn_layer_period=2, attn_layer_offset=0, expert_layer_period=2, expert_layer_offset=1,
                  use_mamba_kernels=False),
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv"]),  # (the default's None does not build)
    "qwen4_exp_text": dict(indexer_n_heads=HEADS, indexer_kv_heads=1, indexer_head_dim=HEAD_DIM, indexer_budget=4,
                           indexer_compress_ratio=2, ngram_vocab_size_base=VOCAB, ple_embed_dim=WIDTH, hc_lowrank=8),
    "zaya": dict(num_experts_per_tok=1),  # (ZAYA takes top-1 only)
}


def moe_families() -> list[str]:
    """The model types (one per modeling module) whose experts use transformers' ExpertsInterface and that have a
    causal-LM class, read from the installed transformers."""
    root = pathlib.Path(transformers.__file__).parent / "models"
    modules = {p.parent.name for p in root.glob("*/modeling_*.py") if "@use_experts_implementation" in p.read_text()}
    families = {}  # module -> its causal-LM model type, the text model's where a multimodal family has one
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        module = model_type_to_module_name(model_type)
        if module in modules and (module not in families or model_type.endswith("_text")):
            families[module] = model_type
    return sorted(families.values())


def _kept_layers(d: dict) -> list[int]:
    """The layers a tiny model keeps: the first of each kind in every per-layer list, the first MoE layer after
    dense ones, at least two."""
    n = d["num_hidden_layers"]
    keep = {0, 1}
    for key, value in d.items():
        if isinstance(value, list) and len(value) == n and key != "num_attention_heads_per_layer":
            firsts = {}
            for i, kind in enumerate(value):
                firsts.setdefault(repr(kind), i)
            keep |= set(firsts.values())
    for key in ("first_k_dense_replace", "num_dense_layers"):
        if isinstance(d.get(key), int) and 0 < d[key] < n:
            keep.add(d[key])
    if isinstance(d.get("mlp_only_layers"), list):
        keep.add(next((i for i in range(n) if i not in d["mlp_only_layers"]), 0))
    if isinstance(d.get("per_layer_config"), dict):  # {"05": {field: value}}: layers that differ from the rest
        firsts = {}
        for k, v in sorted(d["per_layer_config"].items()):
            firsts.setdefault(repr(v), int(k))
        keep |= set(firsts.values())
    kept = sorted(i for i in keep if i < n)
    assert len(kept) <= MAX_LAYERS, f"{len(kept)} kinds of layers: raise MAX_LAYERS or pick fewer"
    return kept


def _shrunk(d: dict, kept: list[int] | None, mla: bool = False) -> dict:
    """`d` (a config's dict) at the tiny sizes; nested configs (`text_config`, ...) too. `mla`: multi-head latent
    attention (DeepSeek's), where keys and values have a head each and `head_dim` is the rotary part."""
    n = d.get("num_hidden_layers")
    if kept is None and isinstance(n, int):
        kept = _kept_layers(d)
    mla = mla or isinstance(d.get("qk_rope_head_dim"), int)
    out = {}
    for key, value in d.items():
        out[key] = value
        if key == "per_layer_config" and isinstance(value, dict):
            out[key] = {str(kept.index(int(k))).zfill(len(k)): _shrunk(v, [], mla) for k, v in value.items()
                        if int(k) in kept}
        elif isinstance(value, dict) and key.endswith("_config"):
            out[key] = _shrunk(value, None)
        elif isinstance(value, list) and kept is not None and len(value) == n:
            out[key] = [HEADS if "heads" in key else value[i] for i in kept]
        elif key == "num_hidden_layers" and kept is not None:
            out[key] = len(kept)
        elif key in ("first_k_dense_replace", "num_dense_layers") and isinstance(value, int) and kept is not None:
            out[key] = sum(i < value for i in kept)
        elif key == "mlp_only_layers" and isinstance(value, list) and kept is not None:
            out[key] = [kept.index(i) for i in value if i in kept]
        elif isinstance(value, bool) or not isinstance(value, (int, type(None))):
            continue
        else:
            size = _size(key, value, mla, d)
            if size is not None:
                out[key] = size
    return out


def _size(key: str, value, mla: bool, d: dict):
    """The tiny value of an int (or None) field, or None to keep it."""
    if key.endswith("_token_id"):
        return 1 if isinstance(value, int) and value >= VOCAB else None
    if value is None and key not in ("num_experts_per_tok", "n_routed_experts", "n_shared_experts", "head_dim"):
        return None
    if key.startswith("vocab_size") or key.endswith("vocab_size"):
        return VOCAB
    if key in ("qk_rope_head_dim", "qk_nope_head_dim"):
        return HEAD_DIM // 2
    if key == "qk_head_dim":
        return HEAD_DIM
    if key == "head_dim" and mla:
        return HEAD_DIM // 2  # (MLA families: the rotary part)
    if key.startswith("mamba_") or key == "ssm_state_size":  # (heads x head size = expand x hidden)
        return {"mamba_n_heads": 4, "mamba_num_heads": 4, "mamba_d_head": 16, "mamba_head_dim": 16,
                "mamba_d_state": 16, "ssm_state_size": 16, "mamba_chunk_size": 16, "mamba_dt_rank": 8,
                "mamba_n_groups": 1}.get(key)
    if key in ("n_group", "topk_group", "num_expert_group", "n_groups"):
        return 1
    if re.search(r"shared_experts$", key):
        return 1 if value is None else min(value, 1)
    if re.search(r"(experts_per_tok(en)?|top_?k|topk_experts|top_k_experts|moe_k)$", key) and "index" not in key:
        return TOP_K
    if re.search(r"(num_experts|n_routed_experts|num_local_experts|moe_num_experts)$", key):
        return EXPERTS
    if re.search(r"(intermediate_size|hidden_size_per_layer_input)$", key) or key == "hidden_size":
        return WIDTH
    if re.search(r"(key_value_heads)$", key):
        return HEADS if mla else 1  # (MLA projects keys and values per head)
    if re.search(r"(attention_heads|n_heads|num_heads)$", key):
        return HEADS
    if re.search(r"(head_dim|_rank)$", key) or key == "v_head_dim":
        return HEAD_DIM
    if key in ("index_topk", "index_block_size"):
        return 4
    if key == "index_topk_blocks":
        return 2
    return None


def tiny_config(model_type: str):
    """The family's default config at the tiny sizes (random weights; nothing is downloaded)."""
    d = _shrunk(CONFIG_MAPPING[model_type]().to_dict(), None)
    d.update(OVERRIDES.get(model_type, {}))
    for key in ("model_type", "transformers_version", "architectures"):
        d.pop(key, None)
    return AutoConfig.for_model(model_type, **d)


FAMILIES = moe_families()


def _build(model_type: str, implementation: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type), experts_implementation=implementation).eval()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Models this small gain nothing from threads, and on a loaded machine OpenMP's waiting makes them much slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def count_calls():
    """[(supported by hf_moe's kernels?)] for each call of hf_moe's experts function while the test runs."""
    calls = []
    real = ALL_EXPERTS_FUNCTIONS[experts_interface.NAME]

    def counted(self, *args):
        calls.append(experts_interface._supported(self))
        return real(self, *args)

    ALL_EXPERTS_FUNCTIONS.register(experts_interface.NAME, counted)
    try:
        yield calls
    finally:
        ALL_EXPERTS_FUNCTIONS.register(experts_interface.NAME, real)


def test_the_families_are_read_from_transformers():
    """The list is transformers' own: Mixtral, Qwen3-MoE and OLMoE are in it, and every entry's experts dispatch
    through the ExpertsInterface (so `experts_implementation="hf_moe"` reaches hf_moe)."""
    assert {"mixtral", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"} <= set(FAMILIES)
    assert len(FAMILIES) >= 25


@pytest.mark.slow
@pytest.mark.parametrize("model_type", FAMILIES)
def test_family_on_hf_moe_experts_matches_its_default_experts(model_type, count_calls, tmp_path):
    """Logits, loss and every gradient equal the default experts' to fp32 rounding, greedy tokens are the same, a save
    and reload gives the same logits, and hf_moe's experts function ran (on hf_moe's kernels, or passing a layout
    they do not take on to grouped_mm)."""
    ours, ref = _build(model_type, "hf_moe"), _build(model_type, "eager")
    assert ours.config.get_text_config()._experts_implementation == experts_interface.NAME
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    out, expected = ours(ids, labels=ids), ref(ids, labels=ids)
    assert count_calls, f"{model_type}: hf_moe's experts function did not run"
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    expected.loss.backward()
    ref_params = dict(ref.named_parameters())
    for name, param in ours.named_parameters():
        want = ref_params[name].grad
        if want is None:
            assert param.grad is None, name
            continue
        torch.testing.assert_close(param.grad, want, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{model_type} {name}: {m}")

    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids[:1], **kwargs), ref.generate(ids[:1], **kwargs))
        ours.save_pretrained(tmp_path)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation=experts_interface.NAME)
        torch.testing.assert_close(reloaded.eval()(ids).logits, ours(ids).logits, rtol=0, atol=0)
