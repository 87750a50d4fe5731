"""torch.compile and torch.export through the hf_moe experts path, from the first call of a fresh model.

For tiny Mixtral and Qwen3-MoE (transformers' own models, `experts_implementation="hf_moe"`) and a converted hf_moe
Llama, under the compiled (C++) and the pure-torch backends:
  * `torch.compile(fullgraph=True)` as the model's first call, forward and a training step, against eager;
  * `torch.export` of the forward as the model's first call, the exported program run without and with
    gradients, against eager.
The compile tests use the "aot_eager" backend: it runs everything a compile traces (Dynamo, fake kernels, the ops'
autograd formulas, AOTAutograd's joint graph) without inductor's C++ codegen, which takes minutes here and does
not touch hf_moe's ops (they stay opaque nodes). HF_MOE_TEST_COMPILER=inductor runs them with inductor.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import tiny_dense
from transformers import AutoConfig, AutoModelForCausalLM

import hf_moe
from hf_moe.ops import experts_forward, experts_interface, reference, use_backend

pytestmark = pytest.mark.compile

BACKENDS = ["compiled", "torch"]
MODELS = ["mixtral", "qwen3_moe", "hf_moe_llama"]
NATIVE = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                      head_dim=16),
}
CLOSE = dict(rtol=1e-5, atol=1e-6)
COMPILER = os.environ.get("HF_MOE_TEST_COMPILER", "aot_eager")


def _fresh(name: str) -> torch.nn.Module:
    """A new model with 1 layer, 4 experts, top-2, that has never been called."""
    if name == "hf_moe_llama":
        return hf_moe.convert_to_moe(tiny_dense("llama", num_hidden_layers=1), 4, 2)
    config = AutoConfig.for_model(name, vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=2, **NATIVE[name])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, experts_implementation="hf_moe")


def _ids():
    return torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))


def _assert_same_grads(model, reference_model):
    want = dict(reference_model.named_parameters())
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    assert names and sorted(names) == sorted(n for n, p in want.items() if p.requires_grad)
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, want[name].grad, **CLOSE, msg=name)


@pytest.fixture(autouse=True)
def _no_compiled_code():
    """Each test traces from scratch: nothing compiled by an earlier test is reused."""
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def _compile_params():
    return [
        pytest.param(m, b, marks=pytest.mark.slow)
        for m in MODELS for b in BACKENDS
    ]


@pytest.fixture
def ran_hf_moe(monkeypatch):
    """The calls of hf_moe's expert computation (a traced call counts once per layer traced)."""
    import hf_moe.ops.backend

    calls, real = [], hf_moe.ops.backend.run_experts

    def counted(ops, *args):
        calls.append(ops.name)
        return real(ops, *args)

    monkeypatch.setattr(hf_moe.ops.backend, "run_experts", counted)
    return calls


@pytest.mark.parametrize("name,backend", _compile_params())
def test_compile_fullgraph_first_call_forward_and_training_step(name, backend, ran_hf_moe):
    ids = _ids()
    with use_backend(backend):
        model, eager = _fresh(name).train(), _fresh(name).train()
        ran_hf_moe.clear()  # (converting a model runs it once, to measure the conversion)
        compiled = torch.compile(model, fullgraph=True, backend=COMPILER)
        out = compiled(ids, labels=ids, use_cache=False)  # the model's first call
        out.loss.backward()
        traced = list(ran_hf_moe)
        want = eager(ids, labels=ids, use_cache=False)
        want.loss.backward()
    assert traced == [backend], traced  # the one MoE layer ran on hf_moe's ops of that backend
    torch.testing.assert_close(out.logits, want.logits, **CLOSE)
    torch.testing.assert_close(out.loss, want.loss, **CLOSE)
    _assert_same_grads(model, eager)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", MODELS)
def test_export_first_call_runs_with_and_without_gradients(name, backend):
    ids = _ids()
    kwargs = dict(labels=ids, use_cache=False)
    with use_backend(backend):
        model, eager = _fresh(name).train(), _fresh(name).train()
        exported = torch.export.export(model, (ids,), kwargs)  # the model's first call
        program = exported.module()
        with torch.no_grad():
            inference = program(ids, **kwargs)
        out = program(ids, **kwargs)
        out.loss.backward()
        want = eager(ids, **kwargs)
        want.loss.backward()
    targets = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    expected = "hf_moe.moe_experts_forward.default" if backend == "compiled" else "hf_moe_torch.grouped_mm.default"
    assert expected in targets, sorted(t for t in targets if "hf_moe" in t)
    torch.testing.assert_close(inference.logits, want.logits, **CLOSE)
    torch.testing.assert_close(out.logits, want.logits, **CLOSE)
    torch.testing.assert_close(out.loss, want.loss, **CLOSE)
    _assert_same_grads(program, eager)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_fullgraph_first_call_moe_block(backend):
    """The converted Llama's MoE block alone (its router is not recorded): compiles from the first call, forward
    and backward, on both backends."""
    ids = _ids()
    with use_backend(backend):
        model, eager = _fresh("hf_moe_llama"), _fresh("hf_moe_llama")
        block, eager_block = model.model.layers[0].mlp, eager.model.layers[0].mlp
        x = model.model.embed_tokens(ids).detach().requires_grad_(True)
        x_eager = x.detach().clone().requires_grad_(True)
        out = torch.compile(block, fullgraph=True, backend=COMPILER)(x)
        out.square().sum().backward()
        want = eager_block(x_eager)
        want.square().sum().backward()
    torch.testing.assert_close(out, want, **CLOSE)
    torch.testing.assert_close(x.grad, x_eager.grad, **CLOSE)
    _assert_same_grads(block, eager_block)


@pytest.mark.subprocess
@pytest.mark.slow
def test_fresh_process_first_call_compiles():
    """A new process with HF_MOE_BACKEND=compiled whose first call is compiled: loading the extension (first, by the
    converted Llama's MoE block) and naming a native model's activation (Mixtral) happen outside the traced region.
    Fullgraph, forward and backward, against eager."""
    script = textwrap.dedent(
        """
        import copy, os
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.llama import LlamaConfig
        import hf_moe
        from hf_moe.ops import dispatch_ops

        def check(model, eager, *args, **kwargs):
            out = torch.compile(model, fullgraph=True, backend=os.environ["HF_MOE_TEST_COMPILER"])(*args, **kwargs)
            want = eager(*args, **kwargs)
            out, want = (getattr(o, "loss", o) for o in (out, want))
            out.sum().backward()
            want.sum().backward()
            torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
            grads = dict(eager.named_parameters())
            for name, p in model.named_parameters():
                torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-5, msg=name)

        base = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2)
        block = hf_moe.SparseMoeBlock(hf_moe.MoEConfig.from_base(base, num_experts=4, num_experts_per_tok=2))
        check(block, copy.deepcopy(block), torch.randn(2, 5, 32))
        assert dispatch_ops(torch.device("cpu"), "silu").name == "compiled"

        config = AutoConfig.for_model("mixtral", vocab_size=128, hidden_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                      num_experts_per_tok=2, intermediate_size=16)
        model = AutoModelForCausalLM.from_config(config, experts_implementation="hf_moe")
        ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(0))
        check(model, copy.deepcopy(model), ids, labels=ids, use_cache=False)
        print("first calls compiled: ok")
        """
    )
    env = dict(os.environ, HF_MOE_BACKEND="compiled", HF_MOE_TEST_COMPILER=COMPILER)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "first calls compiled: ok" in done.stdout


# ----------------------------------------------------------------------------------------------------------------
# The pieces, one by one
# ----------------------------------------------------------------------------------------------------------------
class _Layer(torch.nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, x, top_k_index, top_k_weights):
        return experts_forward(self.experts, x, top_k_index, top_k_weights)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_activation_without_kernel_compiles_and_exports(backend):
    """quick_gelu has no compiled kernel: its backward is differentiated in torch (torch.func.vjp), inside the
    traced backward of a compile, and op by op in an exported program."""
    from test_ops import _Experts, _routing

    x = torch.randn(16, 12, dtype=torch.float64, requires_grad=True)
    index, weights = _routing(16, 2, 4, "dropped")
    weights.requires_grad_(True)
    with use_backend(backend):
        layer = _Layer(_Experts(4, 12, 10, glu=True, bias=True, activation="quick_gelu"))
        params = list(layer.parameters())
        want = layer(x, index, weights)
        want_grads = torch.autograd.grad(want.square().sum(), [x, weights, *params])
        compiled = torch.compile(layer, fullgraph=True, backend=COMPILER)
        program = torch.export.export(layer, (x, index, weights)).module()
        for run, run_params in ((compiled, params), (program, list(program.parameters()))):
            out = run(x, index, weights)
            grads = torch.autograd.grad(out.square().sum(), [x, weights, *run_params])
            torch.testing.assert_close(out, want, **CLOSE)
            for got, expected in zip(grads, want_grads):
                torch.testing.assert_close(got, expected, **CLOSE)


def _groups():
    g = torch.Generator().manual_seed(0)
    tokens_per_expert = torch.tensor([3, 0, 4, 2])  # an expert without rows, and 2 dropped rows past the groups
    x = torch.randn(11, 6, generator=g, dtype=torch.float64)
    weight = torch.randn(4, 5, 6, generator=g, dtype=torch.float64)
    bias = torch.randn(4, 5, generator=g, dtype=torch.float64)
    scale = torch.rand(11, generator=g, dtype=torch.float64)
    return x, weight, tokens_per_expert, bias, scale


@pytest.mark.slow
def test_reference_grouped_mm_traces_without_data_dependent_branches():
    x, weight, tokens_per_expert, bias, scale = _groups()
    traced = torch.compile(reference.grouped_mm, fullgraph=True, backend=COMPILER)

    class GroupedMM(torch.nn.Module):
        def forward(self, x, weight, tokens_per_expert, bias, scale):
            return reference.grouped_mm(x, weight, tokens_per_expert, bias, scale, True)

    for w, transpose in ((weight, True), (weight.transpose(1, 2).contiguous(), False)):
        for b, s in ((None, None), (bias, None), (bias, scale)):
            want = reference.grouped_mm(x, w, tokens_per_expert, b, s, transpose)
            torch.testing.assert_close(traced(x, w, tokens_per_expert, b, s, transpose), want)
    program = torch.export.export(GroupedMM(), (x, weight, tokens_per_expert, bias, scale)).module()
    torch.testing.assert_close(program(x, weight, tokens_per_expert, bias, scale),
                               reference.grouped_mm(x, weight, tokens_per_expert, bias, scale, True))


def test_reference_grouped_mm_gradients_match_finite_differences():
    x, weight, tokens_per_expert, bias, scale = _groups()
    inputs = [t.requires_grad_(True) for t in (x, weight, bias, scale)]
    for transpose in (True, False):
        w = inputs[1] if transpose else inputs[1].detach().transpose(1, 2).contiguous().requires_grad_(True)
        assert torch.autograd.gradcheck(
            lambda x, w, b, s: reference.grouped_mm(x, w, tokens_per_expert, b, s, transpose),
            (inputs[0], w, inputs[2], inputs[3]),
        )


@pytest.fixture(scope="module")
def compiled_ops():
    with use_backend("compiled"):
        yield torch.ops.hf_moe


def test_compiled_ops_gradients_match_finite_differences(compiled_ops):
    """The backward formulas registered for the compiled ops (autograd.py), in fp64, against finite differences."""
    ops = compiled_ops
    x, weight, tokens_per_expert, bias, scale = _groups()
    x, weight, bias, scale = (t.requires_grad_(True) for t in (x, weight, bias, scale))
    assert torch.autograd.gradcheck(lambda *a: ops.grouped_mm(*a[:2], tokens_per_expert, *a[2:], True),
                                    (x, weight, bias, scale))
    g = torch.Generator().manual_seed(1)
    index = torch.randint(0, 4, (5, 2), generator=g)
    index[0, 1] = -1  # a dropped pair
    sorted_slots, slot_to_row, counts = ops.sort_by_expert(index, 4)
    hidden = torch.randn(5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda h: ops.permute(h, sorted_slots, 2), (hidden,))
    rows = torch.randn(10, 6, generator=g, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(5, 2, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda r, w: ops.unpermute(r, slot_to_row, w, 2), (rows, weights))
    h = torch.randn(10, 8, generator=g, dtype=torch.float64, requires_grad=True)
    row_scale = torch.rand(10, generator=g, dtype=torch.float64, requires_grad=True)
    for glu in (True, False):
        assert torch.autograd.gradcheck(lambda h, s: ops.expert_act(h, s, "silu", glu), (h, row_scale))
    w1 = torch.randn(4, 8, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(4, 6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    b2 = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda *a: ops.moe_experts_forward(a[0], index, a[1], a[2], None, a[3], a[4], "silu", True, True)[0],
        (hidden, weights, w1, w2, b2),
    )


def test_fused_op_without_saved_activations_refuses_backward(compiled_ops):
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2]])
    weights = torch.rand(4, 2, dtype=torch.float64)
    w1 = torch.randn(3, 8, 6, dtype=torch.float64)
    w2 = torch.randn(3, 6, 4, dtype=torch.float64)
    out = compiled_ops.moe_experts_forward(x, index, weights, w1, None, w2, None, "silu", True, False)[0]
    with pytest.raises(RuntimeError, match="save_h=False"):
        out.sum().backward()


@pytest.mark.parametrize("key", ["silu", "swish", "gelu", "gelu_python", "gelu_pytorch_tanh", "gelu_new", "gelu_10",
                                 "relu", "relu2", "quick_gelu", "leaky_relu", "mish"])
def test_activation_is_recognised_without_computing_it(key):
    from transformers.activations import ACT2FN

    from hf_moe.ops.activations import activation_key

    assert activation_key(ACT2FN[key]) == key


def test_activations_that_are_no_act2fn_one_are_not_guessed():
    from hf_moe.ops.activations import activation_key

    assert activation_key(torch.nn.LeakyReLU(0.2)) is None  # ACT2FN's leaky_relu has slope 0.01
    assert activation_key(torch.nn.PReLU()) is None  # learnable
    assert activation_key(torch.nn.functional.silu) == "silu"
    assert activation_key(lambda t: t) is None


def test_experts_forward_names_an_unknown_activation():
    experts = _fresh("mixtral").model.layers[0].mlp.experts
    experts.act_fn = torch.nn.LeakyReLU(0.2)
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="LeakyReLU.*`activation` attribute"):
        experts_forward(experts, x, torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))


def test_native_experts_with_unknown_activation_go_to_grouped_mm(monkeypatch):
    """transformers' grouped_mm applies any act_fn; hf_moe's ops need an ACT2FN name, so such a layer is handed on,
    the same way eagerly and traced."""
    model = _fresh("mixtral").eval()
    for layer in model.model.layers:
        layer.mlp.experts.act_fn = torch.nn.LeakyReLU(0.2)
    from hf_moe.ops import experts_interface

    monkeypatch.setattr(experts_interface, "experts_forward", lambda *a: pytest.fail("hf_moe ops were called"))
    ids = _ids()
    want = model(ids).logits
    model.config._experts_implementation = "grouped_mm"
    torch.testing.assert_close(want, model(ids).logits)


# ----------------------------------------------------------------------------------------------------------------
# Models that cannot switch their experts implementation
# ----------------------------------------------------------------------------------------------------------------
UNSWITCHABLE = {
    "jetmoe": dict(num_local_experts=4, num_experts_per_tok=2, kv_channels=16),
    "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size=48, intermediate_size_mlp=96,
                        head_dim=16),
}


@pytest.mark.parametrize("model_type", sorted(UNSWITCHABLE))
def test_models_whose_experts_ignore_the_interface_refuse_hf_moe(model_type):
    """transformers accepts experts_implementation="hf_moe" for JetMoe and Llama-4 text and never calls it; the
    check names the class (hf_moe installs no process-wide hook to run it by itself)."""
    config = AutoConfig.for_model(model_type, vocab_size=96, hidden_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, **UNSWITCHABLE[model_type])
    model = AutoModelForCausalLM.from_config(config, experts_implementation="hf_moe")
    with pytest.raises(ValueError, match=r"\w+ForCausalLM does not support experts_implementation=\"hf_moe\""):
        experts_interface.check_experts_implementation(model)


def test_models_that_switch_and_hf_moe_models_accept_hf_moe():
    experts_interface.check_experts_implementation(_fresh("mixtral"))
    assert _fresh("mixtral").config._experts_implementation == "hf_moe"
    converted = _fresh("hf_moe_llama")
    config = converted.config
    config._experts_implementation = "hf_moe"
    model = AutoModelForCausalLM.from_config(config)  # hf_moe's own model always runs hf_moe's experts
    assert isinstance(model, hf_moe.MoEForCausalLM)
    experts_interface.check_experts_implementation(model)


def test_import_hf_moe_installs_no_module_hook():
    """A process-wide module hook would run hf_moe's code for every model built anywhere in the process."""
    from torch.nn.modules import module

    assert not module._global_module_registration_hooks and not module._global_forward_hooks
    assert not module._global_forward_pre_hooks and not module._global_backward_hooks
