"""Integration the transformers way: no global patches, router outputs on the backbone, config kwargs as
in transformers, a compiled training step without graph breaks. (Loading by path in a process without `import
hf_moe`: test_tokenizer_without_hf_moe.py.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import random_ids, tiny_dense
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_outputs import MoeModelOutputWithPast

import hf_moe
from hf_moe import MoEConfig, MoEForCausalLM, convert_to_moe
from hf_moe.routing import moe_blocks

pytestmark = pytest.mark.oldest


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def saved(tiny_moe):
    return tiny_moe.path


# --------------------------------------------------------------------------------------------------------------
# Nothing outside hf_moe is patched
# --------------------------------------------------------------------------------------------------------------
_FINGERPRINT = textwrap.dedent("""
    import sys
    def fingerprint():
        import accelerate, transformers.trainer, transformers.trainer_utils
        out = {}
        for name, f in [
            ("Trainer.train", transformers.trainer.Trainer.train),
            ("Trainer._load_from_checkpoint", transformers.trainer.Trainer._load_from_checkpoint),
            ("trainer.load_sharded_checkpoint", transformers.trainer.load_sharded_checkpoint),
            ("Accelerator.clip_grad_norm_", accelerate.Accelerator.clip_grad_norm_),
            ("Accelerator.prepare", accelerate.Accelerator.prepare),
        ]:
            out[name] = (f.__module__, f.__qualname__, f.__code__.co_filename, f.__code__.co_firstlineno)
        return out
""")


@pytest.mark.subprocess
def test_import_hf_moe_patches_nothing():
    """`import hf_moe` used to put a finder on sys.meta_path that replaced Trainer.train, load_sharded_checkpoint
    and Accelerator.clip_grad_norm_ for every model in the process."""
    # The training libraries first, then hf_moe (the finder's case): the same functions, and the same objects; hf_moe
    # first: the same functions as the libraries alone. (Other libraries add finders of their own when imported: look
    # for ours.) Two processes: each import of the training libraries costs seconds.
    no_finder = (
        "modules = lambda f: (getattr(f, '__module__', ''), type(f).__module__)\n"
        "ours = [f for f in sys.meta_path if any(m.split('.')[0] == 'hf_moe' for m in modules(f))]\n"
        "assert not ours, ours\n"
    )
    reference = _run(
        _FINGERPRINT
        + "import accelerate, transformers.trainer\n"
        + "print(sorted(fingerprint().items()))\n"
        + "objects = (transformers.trainer.Trainer.train, transformers.trainer.load_sharded_checkpoint, "
        + "accelerate.Accelerator.clip_grad_norm_)\n"
        + "before = fingerprint()\n"
        + "import hf_moe, hf_moe.training.trainer\n"
        + no_finder
        + "assert fingerprint() == before\n"
        + "assert objects == (transformers.trainer.Trainer.train, transformers.trainer.load_sharded_checkpoint, "
        + "accelerate.Accelerator.clip_grad_norm_)\n"
    )
    first = _run(_FINGERPRINT + "import hf_moe\n" + no_finder + "print(sorted(fingerprint().items()))\n" + no_finder)
    assert first == reference


@pytest.mark.subprocess
def test_import_hf_moe_does_not_import_the_trainer():
    _run("import sys, hf_moe\nassert 'transformers.trainer' not in sys.modules\n")


# --------------------------------------------------------------------------------------------------------------
# Router outputs the transformers way
# --------------------------------------------------------------------------------------------------------------
def test_router_output_is_a_tuple_that_hooks_can_walk():
    """ZeRO-3 and FSDP apply their hooks to the tensors of a module's output when it is a tuple, list or dict; the
    router returned a dataclass, so ZeRO-3 missed the router's tensors and failed on the first backward."""
    moe = convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2)
    router = moe_blocks(moe)[0].gate
    routing = router(torch.randn(5, 64))
    assert isinstance(routing, tuple) and routing[0] is routing.router_logits  # logits first, as transformers'
    assert routing.top_k_index.shape == (5, 2) and routing.router_logits.shape == (5, 4)


def test_backbone_returns_router_logits():
    """TRL calls the backbone (`model.base_model`) and reads `router_logits` from its output, as for Mixtral."""
    moe = convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2).eval()
    ids = random_ids()
    with torch.no_grad():
        backbone = moe.base_model(input_ids=ids, output_router_logits=True)
        head = moe(ids, output_router_logits=True)
        plain = moe.base_model(ids)
    assert isinstance(backbone, MoeModelOutputWithPast)
    assert len(backbone.router_logits) == 3 and backbone.router_logits[0].shape == (ids.numel(), 4)
    for a, b in zip(backbone.router_logits, head.router_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert plain.router_logits is None
    torch.testing.assert_close(plain.last_hidden_state, backbone.last_hidden_state, rtol=0, atol=0)
    # The config default works as in Mixtral, and return_dict=False gives a tuple.
    moe.config.output_router_logits = True
    with torch.no_grad():
        assert len(moe.base_model(ids).router_logits) == 3
        assert isinstance(moe.base_model(ids, return_dict=False), tuple)


def test_backbone_alone_keeps_routing_statistics_in_training():
    """A tool that runs the backbone alone (TRL's fused head) still feeds the monitor and the aux_free biases."""
    moe = convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, router_type="aux_free").train()
    moe.base_model(random_ids(), output_router_logits=True)
    assert moe.routing_stats.forwards == 1 and moe.routing_stats.load.sum() > 0
    assert all(b.gate.load_since_update.sum() > 0 for b in moe_blocks(moe))
    moe(random_ids(), labels=random_ids())  # through the head: counted once, not twice
    assert moe.routing_stats.forwards == 2


def test_output_hidden_states_still_recorded_by_transformers():
    """The backbone becomes an MoE subclass after it is built; transformers' output capture must still find it."""
    moe = convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2).eval()
    with torch.no_grad():
        out = moe(random_ids(), output_hidden_states=True, output_attentions=True)
    assert len(out.hidden_states) == 4


@pytest.mark.compile
def test_compiled_training_step_has_no_graph_break():
    """The router recording (forward hooks added and removed on every call) and the aux-loss code broke a compiled
    training step's graph 6 times."""
    moe = convert_to_moe(tiny_dense("llama", num_hidden_layers=2), num_experts=4, top_k=2).train()
    ids = random_ids()

    def step(ids):
        return moe(ids, labels=ids).loss

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(step)(ids)
    reasons = [str(b.reason)[:200] for b in explanation.break_reasons]
    assert explanation.graph_break_count == 0, reasons
    compiled = torch.compile(step, fullgraph=True)
    loss = compiled(ids)
    loss.backward()
    torch.testing.assert_close(loss, step(ids), rtol=1e-5, atol=1e-6)
    assert moe.routing_stats.forwards == 3  # explain, compiled and eager: the compiled step kept the statistics


# --------------------------------------------------------------------------------------------------------------
# Config kwargs as in transformers
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loader", [MoEForCausalLM, AutoModelForCausalLM])
@pytest.mark.parametrize("explicit_config", [False, True])
def test_from_pretrained_takes_config_fields(saved, loader, explicit_config):
    """MoEForCausalLM.from_pretrained(path, output_router_logits=True) raised TypeError from the base __init__."""
    kwargs = dict(output_router_logits=True, router_aux_loss_coef=0.5, num_experts_per_tok=1, rms_norm_eps=1e-3)
    if explicit_config:
        kwargs["config"] = MoEConfig.from_pretrained(saved)
    model = loader.from_pretrained(saved, **kwargs)
    c = model.config
    assert isinstance(model, MoEForCausalLM)
    assert (c.output_router_logits, c.router_aux_loss_coef, c.num_experts_per_tok, c.rms_norm_eps) == (
        True, 0.5, 1, 1e-3
    )
    assert moe_blocks(model)[0].gate.top_k == 1
    out = model(random_ids())
    assert len(out.router_logits) == 3
    if explicit_config:
        assert kwargs["config"].router_aux_loss_coef == 0.01  # the caller's config object is left alone


def test_from_pretrained_rejects_bad_config_fields(saved):
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoEForCausalLM.from_pretrained(saved, config=MoEConfig.from_pretrained(saved), num_experts_per_tok=9)
    with pytest.raises(TypeError, match="MoEConfig"):
        MoEForCausalLM.from_pretrained(saved, config=AutoConfig.for_model("llama"))


# --------------------------------------------------------------------------------------------------------------
# The first hour
# --------------------------------------------------------------------------------------------------------------
def test_convert_to_moe_leaves_its_input_alone_unless_inplace():
    dense = tiny_dense("llama")
    ids = random_ids()
    with torch.no_grad():
        before = dense(ids).logits
    moe = convert_to_moe(dense, num_experts=4, top_k=2)
    assert moe is not dense and type(dense).__name__ == "LlamaForCausalLM"
    assert not moe_blocks(dense) and type(dense.model).__name__ == "LlamaModel"
    with torch.no_grad():
        torch.testing.assert_close(dense(ids).logits, before, rtol=0, atol=0)
    same = convert_to_moe(dense, num_experts=4, top_k=2, inplace=True)
    assert same is dense and isinstance(dense, MoEForCausalLM)


def test_public_api_is_importable():
    for name in hf_moe.__all__:
        assert getattr(hf_moe, name) is not None


def test_first_use_compile_says_what_it_does_and_how_long_it_took(capsys):
    """The first-use compile ran inside the streaming converter's progress bar, whose ETA it skewed (1:22:48 for a
    one-minute build). It now runs before the bars, says what it compiles, and reports elapsed time, not an ETA."""
    from hf_moe.ops.extension import _elapsed

    with _elapsed("hf_moe: compiling the C++ extension (4 files)"):
        pass
    err = capsys.readouterr().err
    assert "compiling the C++ extension (4 files)" in err and "done in 0 s" in err
    assert "ETA" not in err and "it/s" not in err
    with _elapsed("nothing to build", enabled=False):
        pass
    assert capsys.readouterr().err == ""


def test_a_model_from_scratch_with_from_base():
    """`MoEForCausalLM(MoEConfig.from_base(...))` failed: the config had no decoder_layers_path (only conversion set
    it). The model finds its decoder layers, records the path, and saves and loads."""
    from transformers import LlamaConfig

    base = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    model = MoEForCausalLM(MoEConfig.from_base(base, num_experts=4, num_experts_per_tok=2))
    assert model.config.decoder_layers_path == "model.layers" and len(moe_blocks(model)) == 2
    out = model(random_ids(), labels=random_ids())
    assert torch.isfinite(out.loss) and out.aux_loss is not None
