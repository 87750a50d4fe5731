"""Neuron-split conversion, shared experts and Drop-Upcycling."""

from __future__ import annotations

import pytest
import torch
from conftest import CORPUS, random_ids, tiny_dense, tiny_tokenizer

from hf_moe import MoEForCausalLM, convert_to_moe
from hf_moe.dense_mlp import DenseMLP, extract_mlp, find_mlp
from hf_moe.convert.split import balanced_kmeans, partition
from hf_moe.layers.router import unit_weights

# Families covering GLU, GeGLU, fused gate_up, Conv1D + biases, parallel residual and an inline MLP.
SPLIT_FAMILIES = ["llama", "gemma", "phi3", "gpt2", "gpt_neox", "opt"]


def _assert_same_model(moe, dense, atol=2e-5):
    ids = random_ids()
    moe.eval()
    with torch.no_grad():
        got, want = moe(ids).logits, dense(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(moe.generate(ids[:1], **greedy), dense.generate(ids[:1], **greedy))


@pytest.mark.parametrize("model_type", SPLIT_FAMILIES)
@pytest.mark.parametrize("partition_name", ["random", "kmeans"])
def test_split_with_every_expert_active_is_exact(model_type, partition_name):
    dense = tiny_dense(model_type)
    moe = convert_to_moe(tiny_dense(model_type), 4, 4, method="split", partition=partition_name)
    assert moe.config.router_weights == "unit"
    assert moe.config.moe_intermediate_size == _intermediate(dense) // 4
    _assert_same_model(moe, dense)
    assert moe.config.moe_conversion["max_abs_logit_diff"] < 2e-5


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "opt"])
def test_split_with_shared_experts_is_exact(model_type):
    dense = tiny_dense(model_type)
    moe = convert_to_moe(tiny_dense(model_type), 2, 2, method="split", num_shared_experts=2)
    block = moe.get_submodule(f"{moe.config.decoder_layers_path}.0.{moe.config.moe_block_path}")
    assert block.shared_experts is not None and block.bias is None  # the output bias went to the shared experts
    _assert_same_model(moe, dense)


@pytest.mark.parametrize("model_type", ["llama", "phi3", "gpt2", "opt"])
def test_upcycle_with_shared_experts_is_exact(model_type):
    dense = tiny_dense(model_type)
    moe = convert_to_moe(tiny_dense(model_type), 4, 2, num_shared_experts=1)
    assert moe.config.shared_expert_intermediate_size + moe.config.moe_intermediate_size == _intermediate(dense)
    _assert_same_model(moe, dense)


def test_split_biased_mlp_adds_the_output_bias_once_whatever_the_routing():
    dense = tiny_dense("gpt2")
    moe = convert_to_moe(tiny_dense("gpt2"), 4, 1, method="split").eval()
    assert moe.config.moe_output_bias
    block = moe.transformer.h[0].mlp
    torch.testing.assert_close(block.bias, dense.transformer.h[0].mlp.c_proj.bias, rtol=0, atol=0)
    assert torch.count_nonzero(block.experts.down_proj_bias) == 0
    # top-1 of 4 parts: the block computes the chosen quarter of the MLP's neurons plus the bias.
    x = torch.randn(5, 64)
    with torch.no_grad():
        out = block(x)
        chosen = block.gate(x).top_k_index[:, 0]
        h = torch.nn.functional.gelu(
            torch.einsum("nh,nih->ni", x, block.experts.up_proj[chosen]) + block.experts.up_proj_bias[chosen],
            approximate="tanh",
        )
        want = torch.einsum("ni,nhi->nh", h, block.experts.down_proj[chosen]) + block.bias
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_router_starts_at_the_partition_centroids():
    moe = convert_to_moe(tiny_dense("llama"), 4, 2, method="split", partition="kmeans")
    block = moe.model.layers[0].mlp
    size = moe.config.moe_intermediate_size
    gates = block.experts.gate_up_proj[:, :size]  # [E, I/E, H]
    torch.testing.assert_close(block.gate.weight, gates.mean(1), rtol=1e-6, atol=1e-6)


def test_coactivation_partition_from_calibration_text(tmp_path):
    dense = tiny_dense("llama")
    dense.save_pretrained(tmp_path / "dense")
    tiny_tokenizer().save_pretrained(tmp_path / "dense")
    data = tmp_path / "calib.jsonl"
    data.write_text("\n".join(f'{{"text": "{line}"}}' for line in CORPUS.split(". ")))
    moe = convert_to_moe(
        tmp_path / "dense", 4, 4, method="split", partition="coactivation", calibration_data=str(data)
    )
    _assert_same_model(moe, dense)
    assert moe.config.moe_conversion["options"]["calibration_data"] == str(data)


def test_partitions_are_balanced_and_cover_every_neuron():
    mlp = _mlp(intermediate=48)
    activations = torch.randn(40, 48)
    for method, acts in [("random", None), ("kmeans", None), ("coactivation", activations)]:
        groups = partition(mlp, 6, method, acts, torch.Generator().manual_seed(0))
        assert [len(g) for g in groups] == [8] * 6
        assert sorted(torch.cat(groups).tolist()) == list(range(48))


def test_kmeans_recovers_planted_clusters():
    generator = torch.Generator().manual_seed(0)
    centres = torch.randn(4, 16, generator=generator) * 5
    truth = torch.arange(32) % 4
    features = centres[truth] + 0.1 * torch.randn(32, 16, generator=generator)
    labels = balanced_kmeans(features, 4, generator=generator)
    for cluster in range(4):  # every planted cluster lands in one group
        assert labels[truth == cluster].unique().numel() == 1
    assert labels.unique().numel() == 4


def test_unit_weights_are_ones_and_still_pass_gradients():
    weights = torch.tensor([[0.7, 0.2], [0.5, 0.0]], requires_grad=True)
    out = unit_weights(weights)
    assert torch.equal(out, torch.ones(2, 2))
    (out * torch.tensor([[1.0, 2.0], [3.0, 4.0]])).sum().backward()
    torch.testing.assert_close(weights.grad, torch.tensor([[1 / 0.7, 2 / 0.2], [3 / 0.5, 0.0]]))


def test_split_model_trains_router_and_shared_experts():
    moe = convert_to_moe(tiny_dense("llama"), 3, 2, method="split", num_shared_experts=1).train()
    ids = random_ids()
    moe(input_ids=ids, labels=ids).loss.backward()
    block = moe.model.layers[0].mlp
    for param in (block.gate.weight, block.shared_experts.up_proj.weight, block.experts.down_proj):
        assert param.grad is not None and param.grad.abs().sum() > 0


def test_split_checkpoint_round_trip(tmp_path):
    moe = convert_to_moe(tiny_dense("gpt2"), 3, 2, method="split", num_shared_experts=1).eval()
    moe.save_pretrained(tmp_path / "m")
    loaded = MoEForCausalLM.from_pretrained(tmp_path / "m").eval()
    ids = random_ids()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, moe(ids).logits)
    moe = convert_to_moe(tiny_dense("opt"), 4, 2, method="split").eval()  # with the block's output bias
    moe.save_pretrained(tmp_path / "o")
    loaded = MoEForCausalLM.from_pretrained(tmp_path / "o").eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, moe(ids).logits)


def test_drop_upcycling_redraws_a_different_fraction_per_expert():
    dense = tiny_dense("llama")
    moe = convert_to_moe(tiny_dense("llama"), 4, 2, reinit_fraction=0.25)
    assert moe.config.moe_conversion["options"]["reinit_fraction"] == 0.25
    mlp = dense.model.layers[1].mlp
    gate_up = moe.model.layers[1].mlp.experts.gate_up_proj  # [E, 2I, H]
    down = moe.model.layers[1].mlp.experts.down_proj  # [E, H, I]
    redrawn = []
    for e in range(4):
        changed = (gate_up[e, :96] != mlp.gate_proj.weight).any(1)
        assert torch.equal(changed, (gate_up[e, 96:] != mlp.up_proj.weight).any(1))
        assert torch.equal(changed, (down[e] != mlp.down_proj.weight).any(0))
        assert int(changed.sum()) == 24  # round(0.25 * 96)
        redrawn.append(changed)
    assert not all(torch.equal(redrawn[0], r) for r in redrawn[1:])


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(method="split", num_experts=5), "do not split|does not divide"),
        (dict(method="split", partition="coactivation"), "calibration_data=PATH"),
        (dict(method="split", partition="spectral"), "Unknown partition"),
        (dict(method="split", partition="coactivation", calibration_data="/no/such.txt"), "is not a file"),
        (dict(method="split", noise=0.1), "only apply to method='upcycle'"),
        (dict(partition="random"), "only apply to method='split'"),
        (dict(reinit_fraction=1.5), "reinit_fraction must be between 0 and 1"),
        (dict(num_shared_experts=-1), "num_shared_experts must be"),
        (dict(router_weights="uniform"), "router_weights must be"),
    ],
)
def test_bad_options_are_clear_errors(kwargs, message, tmp_path):
    dense = tiny_dense("llama")
    dense.save_pretrained(tmp_path / "d")
    tiny_tokenizer().save_pretrained(tmp_path / "d")
    num_experts = kwargs.pop("num_experts", 4)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        convert_to_moe(tmp_path / "d", num_experts, 2, **kwargs)


def _intermediate(dense) -> int:
    from hf_moe.dense_mlp import find_decoder_layers

    layer = find_decoder_layers(dense)[1][0]
    return extract_mlp(layer, find_mlp(layer), dense.config).intermediate_size


def _mlp(intermediate: int, hidden: int = 16) -> DenseMLP:
    generator = torch.Generator().manual_seed(0)
    return DenseMLP(
        up=torch.randn(intermediate, hidden, generator=generator),
        down=torch.randn(hidden, intermediate, generator=generator),
        gate=torch.randn(intermediate, hidden, generator=generator),
        up_bias=None, gate_bias=None, down_bias=None, act="silu",
    )
