"""`hf_moe.export_native`: the export loads in plain transformers (hf_moe never imported) with the same logits."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
from conftest import SPECIAL_IDS, VOCAB, random_ids, tiny_dense
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

import hf_moe
from hf_moe import NativeExportError, export_native
from hf_moe.export_verify import dot_width, logit_tolerance

pytestmark = pytest.mark.oldest

# Loads every exported folder in a fresh interpreter that imports transformers, never hf_moe.
PLAIN_TRANSFORMERS = """
import json, sys, torch
from transformers import AutoModelForCausalLM
dirs, ids = json.loads(sys.argv[1]), torch.load(sys.argv[2])
out = {}
for name, path in dirs.items():
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        out[name] = (type(model).__name__, model.config.model_type, model.dtype == torch.float32, model(ids).logits)
assert "hf_moe" not in sys.modules, "hf_moe was imported"
torch.save(out, sys.argv[3])
"""
IDS = random_ids(batch=2, length=16, seed=3)  # longer than mistral's sliding window (6)


def tiny_olmo2():
    """Olmo2 is not among conftest's families: a tiny one built the same way (GQA, post-norms, q/k norms)."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "olmo2", vocab_size=VOCAB, **SPECIAL_IDS, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2,
    )
    return AutoModelForCausalLM.from_config(config).eval()


# case -> (dense model factory, convert_to_moe kwargs, native architecture, a native per-expert key on disk)
CASES = {
    # rope scaling and tied embeddings must be carried into Mixtral's config
    "llama": (
        lambda: tiny_dense("llama", tie_word_embeddings=True,
                           rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}),
        {}, "MixtralForCausalLM", "model.layers.0.block_sparse_moe.experts.3.w1.weight",
    ),
    "mistral": (lambda: tiny_dense("mistral"), {}, "MixtralForCausalLM",
                "model.layers.2.block_sparse_moe.experts.0.w3.weight"),
    # head_dim (32) differs from hidden_size / heads (16): Qwen3-MoE must be told
    "qwen3": (lambda: tiny_dense("qwen3", head_dim=32), {}, "Qwen3MoeForCausalLM",
              "model.layers.1.mlp.experts.2.gate_proj.weight"),
    "qwen3_partial": (lambda: tiny_dense("qwen3", head_dim=32), {"layers": [0, 2]}, "Qwen3MoeForCausalLM",
                      "model.layers.1.mlp.gate_proj.weight"),
    "olmo2": (tiny_olmo2, {}, "FlexOlmoForCausalLM", "model.layers.0.mlp.experts.1.up_proj.weight"),
}


def _convert(case: str):
    make, kwargs, _, _ = CASES[case]
    return hf_moe.convert_to_moe(make(), num_experts=4, top_k=2, noise=0.01, **kwargs).eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory, fresh_python):
    """Every case converted, exported, and run by plain transformers in one fresh interpreter.

    Returns {case: (moe_logits, plain-transformers output, NativeExport, export dir)}.
    """
    root = tmp_path_factory.mktemp("export")
    models, results = {}, {}
    for case in CASES:
        models[case] = _convert(case)
        results[case] = export_native(models[case], root / case)
    torch.save(IDS, root / "ids.pt")
    dirs = {case: str(root / case) for case in CASES}
    done = fresh_python.run(PLAIN_TRANSFORMERS, json.dumps(dirs), root / "ids.pt", root / "out.pt", cwd=root)
    assert done.returncode == 0, done.stderr[-4000:]
    plain = torch.load(root / "out.pt")
    out = {}
    for case, moe in models.items():
        with torch.no_grad():
            out[case] = (moe(IDS).logits, plain[case], results[case], root / case)
    return out


@pytest.mark.subprocess
@pytest.mark.parametrize("case", list(CASES))
def test_export_loads_in_plain_transformers_with_equal_logits(exported, case):
    moe_logits, (architecture, _, is_fp32, logits), result, _ = exported[case]
    assert architecture == CASES[case][2] == result.architecture and is_fp32
    diff = (logits - moe_logits).abs().max().item()
    print(f"{case}: max |logit difference| {diff:.2e}")
    torch.testing.assert_close(logits, moe_logits, rtol=0, atol=1e-5)
    assert result.max_abs_logit_diff is not None and result.max_abs_logit_diff < 1e-5 and result.same_argmax


@pytest.mark.subprocess
@pytest.mark.parametrize("case", list(CASES))
def test_files_are_in_the_native_layout(exported, case):
    path = exported[case][3]
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [CASES[case][2]] and "moe_conversion" not in config
    keys = set()
    for file in path.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            keys.update(f.keys())
    assert CASES[case][3] in keys
    assert not any("gate_up_proj" in k for k in keys)  # transformers' own per-expert names, not hf_moe's fused ones
    assert (path / "generation_config.json").is_file()


@pytest.mark.subprocess
def test_carried_config_fields(exported):
    config = lambda case: json.loads((exported[case][3] / "config.json").read_text())  # noqa: E731
    assert config("mistral")["sliding_window"] == 6 and config("llama")["sliding_window"] is None
    assert config("llama")["rope_parameters"]["factor"] == 2.0 and config("llama")["tie_word_embeddings"] is True
    assert config("qwen3")["head_dim"] == 32 and config("qwen3")["mlp_only_layers"] == []
    assert config("qwen3_partial")["mlp_only_layers"] == [1] and config("qwen3_partial")["norm_topk_prob"] is True
    assert config("llama")["router_aux_loss_coef"] == 0.01 and config("llama")["router_jitter_noise"] == 0.0


@pytest.mark.subprocess
def test_model_card(exported):
    card = (exported["qwen3_partial"][3] / "README.md").read_text()
    result = exported["qwen3_partial"][2]
    assert result.verified_layers == (2, 3) and result.tensors_checked == 56  # an MoE layer (0) and a dense one (1)
    assert f"logits within {result.max_abs_logit_diff:.2e} on a random probe" in card and "greedy tokens equal" in card
    assert "every tensor equals the hf_moe model's, bit for bit (all 56 read back after writing)" in card
    assert "its first 2 of 3 decoder layers with the embeddings, final norm and LM head" in card
    assert "`Qwen3MoeForCausalLM`" in card and "no hf_moe import" in card and "from_pretrained" in card
    assert "2 of 3: 0, 2; dense MLP in 1" in card and "4 per MoE layer, top-2" in card
    assert "active per token" in card and "`upcycle` (noise=0.01)" in card
    assert "\nlicense:" not in card  # unknown for a model built from a config: not invented
    assert "{" not in card.split("```python")[0]  # every field filled


@pytest.mark.subprocess
def test_test_is_sensitive_to_expert_and_gate_up_order(exported):
    """The noise makes the experts differ, so a wrong expert order or a swapped gate/up would change the logits: by
    more than 20x the export's tolerance, which the measured differences (rounding) stay far below."""
    moe = _convert("llama")
    experts = moe.model.layers[0].mlp.experts
    with torch.no_grad():
        reference = moe(IDS).logits
        tolerance = logit_tolerance(reference.abs().max().item(), dot_width(moe.config))
        assert tolerance < 1e-5  # what the README states for the test models
        i = experts.intermediate_dim
        gate_up = experts.gate_up_proj.clone()
        experts.gate_up_proj.copy_(torch.cat([gate_up[:, i:], gate_up[:, :i]], dim=1))
        assert (moe(IDS).logits - reference).abs().max() > 1e-3 > 200 * tolerance
        experts.gate_up_proj.copy_(gate_up.flip(0))
        assert (moe(IDS).logits - reference).abs().max() > 1e-4 > 20 * tolerance
    for case, (_, _, result, _) in exported.items():
        assert result.max_abs_logit_diff < tolerance / 4, case


# --------------------------------------------------------------------------------------------------------------
# What does not fit
# --------------------------------------------------------------------------------------------------------------
def _error(moe, tmp_path) -> str:
    with pytest.raises(NativeExportError) as info:
        export_native(moe, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written
    return str(info.value)


def test_family_without_a_native_target_lists_every_reason(tmp_path):
    moe = hf_moe.convert_to_moe(tiny_dense("gpt2"), num_experts=4, top_k=2)
    message = _error(moe, tmp_path)
    assert "`gpt2` has no native transformers MoE architecture" in message
    assert "llama -> mixtral" in message and "qwen3 -> qwen3_moe" in message
    assert "expert_glu=False" in message and "expert_hidden_act='gelu_new'" in message and "expert_bias=True" in message


def test_qwen2_is_not_offered_because_of_the_shared_expert(tmp_path):
    message = _error(hf_moe.convert_to_moe(tiny_dense("qwen2"), num_experts=4, top_k=2), tmp_path)
    assert "`qwen2` has no native" in message and "shared expert" in message


def test_router_and_capacity_that_do_not_fit(tmp_path):
    moe = hf_moe.convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=1, router_type="switch")
    message = _error(moe, tmp_path)
    assert "router_type='switch'" in message and "router_type='topk'" in message
    assert "capacity_factor=1.25" in message and "eval_capacity_factor=2.0" in message and "dropless" in message


def test_capacity_on_the_topk_router_does_not_fit(tmp_path):
    moe = hf_moe.convert_to_moe(tiny_dense("qwen3"), num_experts=4, top_k=2, capacity_factor=2.0)
    message = _error(moe, tmp_path)
    assert "capacity_factor=2.0" in message and "router_type" not in message


def test_mixtral_needs_every_layer_moe_and_renormalised_weights(tmp_path):
    moe = hf_moe.convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, layers=[0], norm_topk_prob=False)
    message = _error(moe, tmp_path)
    assert "MoE in layers [0] of 3: mixtral has an MoE block in every layer" in message
    assert "norm_topk_prob=False: mixtral always renormalises" in message


def test_qwen3_with_mixed_sliding_and_full_attention_does_not_fit(tmp_path):
    dense = tiny_dense("qwen3", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    message = _error(hf_moe.convert_to_moe(dense, num_experts=4, top_k=2), tmp_path)
    assert "mixes sliding (4) and full attention" in message


def test_qwen3_without_renormalisation_exports(tmp_path):
    """Qwen3-MoE's norm_topk_prob is a config field, so raw softmax weights fit (unlike Mixtral)."""
    moe = hf_moe.convert_to_moe(tiny_dense("qwen3"), num_experts=4, top_k=2, noise=0.01, norm_topk_prob=False)
    result = export_native(moe, tmp_path / "out")
    assert result.max_abs_logit_diff < 1e-5
    assert json.loads((tmp_path / "out" / "config.json").read_text())["norm_topk_prob"] is False


def test_split_with_shared_experts_and_unit_weights_does_not_fit(tmp_path):
    """A split model weights its experts by 1 and keeps an always-active shared expert: neither has a native twin."""
    moe = hf_moe.convert_to_moe(tiny_dense("llama"), num_experts=3, top_k=2, method="split", num_shared_experts=1)
    message = _error(moe, tmp_path)
    assert "router_weights='unit'" in message and "num_shared_experts=1" in message
    assert "mixtral" in message and "qwen2_moe's is sigmoid-gated" in message


def test_split_with_softmax_weights_exports(tmp_path):
    """Split experts are ordinary SiLU-GLU experts: with softmax weights the model exports, equal to the hf_moe one."""
    moe = hf_moe.convert_to_moe(tiny_dense("qwen3"), num_experts=4, top_k=2, method="split",
                                router_weights="softmax").eval()
    result = export_native(moe, tmp_path / "out")
    assert result.architecture == "Qwen3MoeForCausalLM" and result.max_abs_logit_diff < 1e-5


@pytest.mark.subprocess
def test_metadata_the_gguf_loader_adds_is_carried_not_refused(tmp_path):
    """transformers' GGUF loader adds `_model_name_or_path` and `unk_token_id` to a Llama config (the quickstart's
    SmolLM2 has both). Neither changes what the model computes, so export carries them instead of refusing."""
    dense = tiny_dense("llama")
    dense.save_pretrained(tmp_path / "dense")
    config_path = tmp_path / "dense" / "config.json"
    config = json.loads(config_path.read_text())
    config.update(_model_name_or_path="/tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf", unk_token_id=0)
    config_path.write_text(json.dumps(config))
    moe = hf_moe.convert_to_moe(str(tmp_path / "dense"), num_experts=4, top_k=2)
    moe.save_pretrained(tmp_path / "moe")
    assert json.loads((tmp_path / "moe" / "config.json").read_text())["unk_token_id"] == 0
    export_native(str(tmp_path / "moe"), tmp_path / "native")
    exported = json.loads((tmp_path / "native" / "config.json").read_text())
    assert exported["model_type"] == "mixtral" and exported["unk_token_id"] == 0


# --------------------------------------------------------------------------------------------------------------
# Written tensor by tensor: the files transformers' own save_pretrained writes, at the memory of one tensor
# --------------------------------------------------------------------------------------------------------------
def _native_save_pretrained(moe, out):
    """The reference: the native model built on the meta device, given the hf_moe model's own tensors (the
    in-memory names match one to one), saved by transformers' `save_pretrained` (what export did before streaming)."""
    config = copy.deepcopy(hf_moe.export.native_config(moe.config))
    with torch.device("meta"):
        native = AutoModelForCausalLM.from_config(config)
    source = {**dict(moe.named_parameters(remove_duplicate=False)), **dict(moe.named_buffers(remove_duplicate=False))}
    for module_name, module in native.named_modules(remove_duplicate=False):
        for store in (module._parameters, module._buffers):
            for name in [n for n, t in store.items() if t is not None]:
                store[name] = source[f"{module_name}.{name}" if module_name else name]
    native.generation_config = copy.deepcopy(moe.generation_config)
    native.save_pretrained(out)


def _tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for file in directory.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.subprocess
@pytest.mark.parametrize("case", list(CASES))
def test_streamed_files_are_what_native_save_pretrained_writes(exported, case, tmp_path):
    """Same tensor names, bytes, config and generation config as transformers' own `save_pretrained` of the native
    model: the on-disk layout export writes is transformers', in every release CI runs."""
    _native_save_pretrained(_convert(case), tmp_path / "reference")
    ours, reference = _tensors(exported[case][3]), _tensors(tmp_path / "reference")
    assert sorted(ours) == sorted(reference)
    for key, tensor in reference.items():
        assert ours[key].dtype == tensor.dtype and torch.equal(ours[key], tensor), key
    for name in ("config.json", "generation_config.json"):
        read = lambda path: json.loads((path / name).read_text())  # noqa: E731
        assert read(exported[case][3]) == read(tmp_path / "reference"), name


def test_sharded_export_and_full_verification(tmp_path):
    result = export_native(_convert("mistral"), tmp_path / "out", max_shard_size="100KB", verify="full")
    assert result.verified_layers == (3, 3) and result.max_abs_logit_diff < 1e-5
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert all((tmp_path / "out" / f).stat().st_size <= 100_000 + 20_000 for f in files)  # (+ a header)


def test_a_tensor_damaged_on_the_way_to_disk_is_an_error(tmp_path, monkeypatch):
    import hf_moe.export_files as export_files

    write = export_files.write_weights

    def write_then_damage(source, outputs, directory, max_shard_size):
        write(source, outputs, directory, max_shard_size)
        with open(directory / "model.safetensors", "r+b") as f:
            f.seek(-3, 2)
            byte = f.read(1)
            f.seek(-3, 2)
            f.write(bytes([byte[0] ^ 0x10]))

    monkeypatch.setattr(hf_moe.export, "write_weights", write_then_damage)
    with pytest.raises(NativeExportError, match="1 tensors of the export differ from the hf_moe model's"):
        export_native(_convert("llama"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


PEAK_RSS = """
import json, sys
import torch, transformers, hf_moe
def rss():  # VmHWM: the peak RSS of this process's memory (ru_maxrss would keep the forking parent's)
    return next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM'))
baseline = rss()
hf_moe.export_native(sys.argv[1], sys.argv[2], verify=sys.argv[3] == "verify")
print(json.dumps({"baseline": baseline, "peak": rss()}))
"""


@pytest.fixture(scope="module")
def moe_250mb(tmp_path_factory):
    """A 0.24 GB hf_moe checkpoint: Llama, hidden 384, 8 layers of 8 experts (0.23 GB of it in experts)."""
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=1024, hidden_size=384, intermediate_size=768,
                                  num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2)
    moe = hf_moe.convert_to_moe(AutoModelForCausalLM.from_config(config), num_experts=8, top_k=2, inplace=True)
    path = tmp_path_factory.mktemp("moe-250mb") / "moe"
    moe.save_pretrained(path)
    return path


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("verify", ["verify", "write"])
def test_export_peak_memory_is_bounded_by_the_model_size(moe_250mb, verify, tmp_path):
    """Peak RSS (VmHWM) of a fresh process exporting a 0.24 GB checkpoint, over its baseline (torch, transformers and
    hf_moe imported): writing takes the memory of a tensor; the default check, that of the first 2 of 8 layers
    loaded by hf_moe and then by transformers (which maps the files while it stacks the experts: twice their size).
    Before streaming, the export grew by several times the model's size (docs/exporting.md)."""
    size = sum(p.stat().st_size for p in moe_250mb.glob("*.safetensors"))
    out = subprocess.run([sys.executable, "-c", PEAK_RSS, str(moe_250mb), str(tmp_path / "out"), verify],
                         check=True, capture_output=True, text=True, cwd=tmp_path)
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    growth = (rss["peak"] - rss["baseline"]) / size
    print(f"{verify}: model {size / 1e9:.3f} GB, baseline {rss['baseline'] / 1e9:.2f} GB, growth {growth:.2f}x")
    assert growth <= (0.2 if verify == "write" else 1.0)


# --------------------------------------------------------------------------------------------------------------
# The model card's base_model: a Hub id only when the source was one
# --------------------------------------------------------------------------------------------------------------
def _front_matter(path) -> str:
    return (path / "README.md").read_text().split("\n---\n", 1)[0]


def _gguf_base_models(path):
    """What llama.cpp's converter (gguf-py's `Metadata`) reads from the card: the base models it links to."""
    from pathlib import Path

    from gguf.metadata import Metadata

    return Metadata.load(model_path=Path(path)).base_models


def test_card_base_model_is_a_hub_id_only_when_the_source_was_one(tmp_path):
    """A local source directory recorded as `base_model` became `https://huggingface.co/<path>` in every GGUF that
    llama.cpp's converter made from the export. A local source gets no `base_model`; a Hub id keeps it."""
    pytest.importorskip("gguf.metadata")  # (the `gguf` extra: llama.cpp's own reader of model cards)
    tiny_dense("llama").save_pretrained(tmp_path / "dense-model")
    local = hf_moe.convert_to_moe(str(tmp_path / "dense-model"), num_experts=4, top_k=2)
    hub_dense = tiny_dense("llama")
    hub_dense.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"  # as from_pretrained(<Hub id>) records it
    hub = hf_moe.convert_to_moe(hub_dense, num_experts=4, top_k=2)
    for name, moe in (("local", local), ("hub", hub)):
        moe.save_pretrained(tmp_path / f"{name}-moe")
        export_native(str(tmp_path / f"{name}-moe"), tmp_path / f"{name}-native")
    for path in (tmp_path / "local-moe", tmp_path / "local-native"):
        assert "base_model:" not in _front_matter(path)
        assert str(tmp_path / "dense-model") in (path / "README.md").read_text()  # still named in the text
        assert not _gguf_base_models(path)
    for path in (tmp_path / "hub-moe", tmp_path / "hub-native"):
        assert "\nbase_model: HuggingFaceTB/SmolLM2-135M-Instruct\n" in _front_matter(path) + "\n"
        (found,) = _gguf_base_models(path)
        assert found["repo_url"] == "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct"


def test_card_of_a_checkpoint_converted_before_the_hub_id_was_recorded(tmp_path):
    """Older checkpoints record only `base_model`: a path is told from a Hub id by its form and by whether it exists."""
    from hf_moe.model_card import hub_model_id

    assert hub_model_id("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert hub_model_id("/root/.cache/huggingface/hub/models--Qwen--Qwen3-0.6B/snapshots/abc123") == "Qwen/Qwen3-0.6B"
    (tmp_path / "work" / "dense").mkdir(parents=True)
    for local in ("/tmp/smollm2-moe-work/smollm2-135m-instruct", "./dense", "~/models/x", str(tmp_path / "work"),
                  "a/b/c", "LlamaForCausalLM", "", None):
        assert hub_model_id(local) is None, local
    moe = _convert("llama")
    moe.config.moe_conversion = {"method": "upcycle", "base_model": "/tmp/smollm2-moe-work/smollm2-135m-instruct"}
    export_native(moe, tmp_path / "native")
    assert "base_model:" not in _front_matter(tmp_path / "native")
