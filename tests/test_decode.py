"""The fast decode path (hf_moe/generation.py): a static KV cache and the decode step compiled once, on CPU.

- an hf_moe model switches to it with `cache_implementation="static"` alone (generate, pipeline), gives the eager
  path's greedy tokens, and never recompiles between decode steps or between calls (fail_on_recompile);
- transformers' own two compile tests of `generate` (tests/generation/test_utils.py, GenerationTesterMixin:
  `test_generate_compile_model_forward_fullgraph` and `test_generate_compilation_all_outputs`), ported here as
  they are written there, run on a tiny Mixtral with `experts_implementation="hf_moe"`: the transformers 5.23 sdist
  ships neither tests/generation/ nor tests/models/, and the ported code is theirs but for the model it builds.
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, CompileConfig, GenerationConfig, pipeline
from transformers.generation import GenerateDecoderOnlyOutput

import hf_moe
from hf_moe.decode import choose_decode
from hf_moe.decode_one_op import DecodePlan as one_op_plan
from hf_moe.generation import (
    MIN_CACHE_LEN, cache_length, decode_compile_config, fast_decode_kwargs, one_op_sample, prepare_generate_kwargs,
)

from conftest import VOCAB, random_ids, tiny_converted, tiny_dense, tiny_tokenizer


def converted(seed: int = 0):
    return tiny_converted(seed=seed)


# The attention-block step (hf_moe.decode), where the one-op step (hf_moe.decode_one_op, tests/test_decode_one_op.py)
# would otherwise run and compile nothing: the tests of compilation itself use it.
COMPILED = {"cache_implementation": "static", "compile_config": decode_compile_config(one_op=False)}
EAGER = {"cache_implementation": "dynamic"}  # the eager model: the plain call may run the one-op step


def greedy(model, ids, new_tokens, **kwargs):
    mask = torch.ones_like(ids)
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, pad_token_id=0, return_dict_in_generate=True, output_scores=True,
                          **kwargs)


# ----------------------------------------------------------------------------------------------------- the switch
def test_prepare_generate_kwargs_fills_in_the_compiled_decode_only_for_a_static_cache():
    moe = converted()
    ids = random_ids(1, 12)
    prepare = lambda **kw: prepare_generate_kwargs(moe, (), kw)  # noqa: E731
    plain = prepare(input_ids=ids, max_new_tokens=3)
    if choose_decode(moe, 1).engine == "one_op":  # the step's own loop and its static cache, nothing compiled
        assert plain["custom_generate"] is one_op_sample and plain["cache_implementation"] == "static"
        assert "compile_config" not in plain
    else:  # eager: unchanged
        assert plain == {"input_ids": ids, "max_new_tokens": 3}
    filled = prepare(input_ids=ids, max_new_tokens=3, cache_implementation="static")
    assert filled["max_cache_len"] == MIN_CACHE_LEN
    assert filled["compile_config"] == decode_compile_config() and filled["compile_config"]._compile_all_devices
    assert filled["compile_config"].fullgraph and filled["compile_config"].dynamic is False
    # The cache holds the call's need rounded up to a power of two; the prompt may be positional.
    assert prepare_generate_kwargs(moe, (random_ids(1, 300),), {"max_new_tokens": 20, "cache_implementation": "static"})[
        "max_cache_len"] == 512
    assert [cache_length(n) for n in (1, 256, 257, 1000, 1025)] == [256, 256, 512, 1024, 2048]
    # The caller's own choices win, wherever they are made.
    mine = CompileConfig(fullgraph=False)
    kept = prepare(cache_implementation="static", compile_config=mine, max_cache_len=64)
    assert kept["compile_config"] is mine and kept["max_cache_len"] == 64
    via_config = prepare(input_ids=ids, generation_config=GenerationConfig(cache_implementation="static", max_new_tokens=5))
    assert via_config["max_cache_len"] == MIN_CACHE_LEN
    moe.generation_config.cache_implementation = "static"  # saved with the model: generate and pipeline use it
    assert "compile_config" in prepare(input_ids=ids)
    assert prepare(cache_implementation="dynamic") == {"cache_implementation": "dynamic"}


def test_offloaded_experts_are_left_to_eager_decoding(tmp_path):
    """The expert cache decides on the host what to read: a static cache asked of an offloaded model decodes
    eagerly (nothing compiled), with the fully loaded model's greedy tokens."""
    moe = converted()
    moe.save_pretrained(tmp_path / "moe")
    model = hf_moe.MoEForCausalLM.from_pretrained(tmp_path / "moe", offload_experts="disk", max_expert_memory="1MiB")
    assert prepare_generate_kwargs(model, (), {"cache_implementation": "static"}) == {"cache_implementation": "static"}
    ids = random_ids(1, 10)
    out = greedy(model, ids, 5, cache_implementation="static")
    assert torch.equal(out.sequences, greedy(moe, ids, 5, **EAGER).sequences) and not hasattr(model, "_compiled_call")


# ---------------------------------------------------------------------------------- compiled once, hf_moe models
class RecompileLog(logging.Handler):
    """transformers' test catches recompilations in the `torch._dynamo.guards` log; so does this."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def __enter__(self):
        torch._logging.set_logs(recompiles_verbose=True)
        logging.getLogger("torch._dynamo.guards").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("torch._dynamo.guards").removeHandler(self)
        torch._logging.set_logs()

    @property
    def recompiled(self) -> bool:
        text = "\n".join(self.lines)
        return "Recompiling" in text or ("guard" in text and "failure" in text)


@pytest.mark.slow
def test_static_cache_compiles_the_decode_step_once_for_generate_and_pipeline():
    """A converted model's decode step is compiled on the first call, then reused: by every decode step, by calls
    with other prompts, prompt lengths and numbers of new tokens, and by `pipeline`; greedy tokens equal the eager
    path's. `fail_on_recompile` turns any recompilation into an error, the log check is transformers' own."""
    torch.compiler.reset()
    moe = converted()
    tokenizer = tiny_tokenizer()
    calls = [(random_ids(1, 12, seed=1), 6), (random_ids(1, 5, seed=2), 9), (random_ids(1, 30, seed=3), 4)]
    with torch.compiler.set_stance("force_eager"):
        eager = [greedy(moe, ids, n, **EAGER) for ids, n in calls]
    with RecompileLog() as log:
        fast = [greedy(moe, *calls[0], **COMPILED)]  # compiles, then reuses for every step
        assert moe._hf_moe_decode_steps[0][1] is not None  # the auto-compile ran on CPU: the attention-block step
        with torch.compiler.set_stance("fail_on_recompile"):  # from here on, any compilation raises
            fast += [greedy(moe, ids, n, **COMPILED) for ids, n in calls[1:]]
            generate = pipeline("text-generation", model=moe, tokenizer=tokenizer)
            piped = generate("the fox", max_new_tokens=5, do_sample=False, return_full_text=False,
                             **COMPILED)[0]["generated_text"]
    assert not log.recompiled, "\n".join(log.lines)
    for (ids, n), a, b in zip(calls, eager, fast):
        assert torch.equal(a.sequences, b.sequences)
        torch.testing.assert_close(torch.stack(a.scores), torch.stack(b.scores), atol=1e-4, rtol=1e-4)
        assert b.past_key_values.is_compileable and b.past_key_values.layers[0].keys.shape[2] == MIN_CACHE_LEN
    with torch.compiler.set_stance("force_eager"):
        assert piped == generate("the fox", max_new_tokens=5, do_sample=False, return_full_text=False, **EAGER)[0][
            "generated_text"]


@pytest.mark.slow
def test_a_longer_call_compiles_once_for_the_next_power_of_two():
    """A call past the cache's length compiles once more, for a cache of the next power of two (512); every call
    after it, shorter ones included, reuses that graph."""
    torch.compiler.reset()
    moe = converted()
    greedy(moe, random_ids(1, 10, seed=9), 3, **COMPILED)  # compiles for 256 positions
    with RecompileLog() as log:
        long = greedy(moe, random_ids(1, 250, seed=10), 10, **COMPILED)
    assert log.recompiled and long.past_key_values.layers[0].keys.shape[2] == 512
    with RecompileLog() as log, torch.compiler.set_stance("fail_on_recompile"):
        short = greedy(moe, random_ids(1, 10, seed=11), 3, **COMPILED)
    assert not log.recompiled and short.past_key_values.layers[0].keys.shape[2] == 512


@pytest.mark.slow
def test_bf16_model_decodes_compiled():
    torch.compiler.reset()
    moe = converted().to(torch.bfloat16)
    ids = random_ids(1, 10, seed=4)
    with torch.compiler.set_stance("force_eager"):
        eager = greedy(moe, ids, 5, **EAGER)
    with RecompileLog() as log:
        fast = greedy(moe, ids, 5, **COMPILED)
        again = greedy(moe, random_ids(1, 7, seed=5), 5, **COMPILED)
    assert not log.recompiled, "\n".join(log.lines)
    assert again.sequences.shape == (1, 12)
    torch.testing.assert_close(torch.stack(eager.scores), torch.stack(fast.scores), atol=0.1, rtol=0.05)


# ------------------------------------------------ transformers' two compile tests, on Mixtral with hf_moe experts
def tiny_mixtral():
    """A tiny Mixtral (as transformers' MixtralModelTester builds it: 2 layers, 4 experts, top-2) with
    experts_implementation="hf_moe"."""
    config = AutoConfig.for_model(
        "mixtral", vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=None, pad_token_id=0,
    )
    config._experts_implementation = "hf_moe"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    assert model.config._experts_implementation == "hf_moe"
    return model


def _assert_similar_generate_outputs(a, b, atol, rtol):
    """transformers' `assert_similar_generate_outputs`: same sequences, or the scores up to the first mismatch close."""
    if torch.equal(a.sequences, b.sequences):
        return
    start = a.sequences.shape[1] - len(a.scores)
    for row in range(a.sequences.shape[0]):
        same = a.sequences[row] == b.sequences[row]
        if same.all():
            continue
        first = int(same.int().argmin()) - start
        torch.testing.assert_close(a.scores[first][row], b.scores[first][row], atol=atol, rtol=rtol)


@pytest.mark.slow
def test_mixtral_with_hf_moe_experts_generate_compile_model_forward_fullgraph():
    """transformers' `test_generate_compile_model_forward_fullgraph`: two generations with different inputs of the same
    shape, eager + dynamic cache, then static cache compiled with fullgraph=True, dynamic=False; no recompilation, and
    similar outputs (atol = rtol = 1e-3 for MoE models, as there)."""
    model = tiny_mixtral()
    inputs = [{"input_ids": random_ids(2, 7, seed=s), "attention_mask": torch.ones(2, 7, dtype=torch.long)}
              for s in (6, 7)]
    torch.compiler.reset()
    compile_config = CompileConfig(fullgraph=True, dynamic=False)
    compile_config._compile_all_devices = True
    kwargs = dict(use_cache=True, do_sample=False, max_new_tokens=5, return_dict_in_generate=True, output_scores=True,
                  compile_config=compile_config)
    with torch.compiler.set_stance("force_eager"):
        dynamic = [model.generate(**x, **kwargs) for x in inputs]
    assert not hasattr(model, "_compiled_call")
    kwargs["cache_implementation"] = "static"
    with RecompileLog() as log:
        compiled = []
        for x in inputs:
            out = model.generate(**x, **kwargs)
            assert out.past_key_values.is_compileable and hasattr(model, "_compiled_call")
            compiled.append(out)
    assert not log.recompiled, "\n".join(log.lines)
    for a, b in zip(dynamic, compiled):
        _assert_similar_generate_outputs(a, b, atol=1e-3, rtol=1e-3)


@pytest.mark.slow
def test_mixtral_with_hf_moe_experts_generate_compilation_all_outputs():
    """transformers' `test_generate_compilation_all_outputs`: greedy generate with every optional output (eager
    attention, to output attentions) under automatic compilation; the outputs have the right types and lengths."""
    model = tiny_mixtral()
    model.config._attn_implementation = "eager"
    torch.compiler.reset()
    compile_config = CompileConfig()
    compile_config._compile_all_devices = True
    model.generation_config.compile_config = compile_config
    model.generation_config.cache_implementation = "static"
    ids = random_ids(2, 7, seed=8)
    new = 3
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
                         max_new_tokens=new, min_new_tokens=new, output_attentions=True, output_hidden_states=True,
                         output_scores=True, output_logits=True, return_dict_in_generate=True, use_cache=True,
                         bad_words_ids=[[1, 0]], repetition_penalty=1.2, remove_invalid_values=True)
    assert hasattr(model, "_compiled_call")
    assert isinstance(out, GenerateDecoderOnlyOutput) and out.sequences.shape == (2, 7 + new)
    assert len(out.scores) == len(out.logits) == len(out.attentions) == len(out.hidden_states) == new
    layers = model.config.num_hidden_layers
    assert all(len(step) == layers for step in out.attentions) and all(len(s) == layers + 1 for s in out.hidden_states)


def test_fast_decode_kwargs_are_transformers_generate_arguments():
    kwargs = fast_decode_kwargs(max_cache_len=512)
    config = GenerationConfig(**{k: v for k, v in kwargs.items()})
    assert config.cache_implementation == "static" and config.max_cache_len == 512
    config.validate()


# -------------------------------------------------------------------------------------------------- hf-moe generate
@pytest.mark.compile  # the static cache compiles the decode step
def test_cli_generate_with_a_static_cache_streams_the_default_paths_tokens(tmp_path, capsys):
    """`hf-moe generate --cache-implementation static` (the compiled decode step) and `--dtype fp32` stream what the
    default path streams."""
    from hf_moe.cli import main

    converted().save_pretrained(tmp_path / "moe")
    tiny_tokenizer().save_pretrained(tmp_path / "moe")
    texts = []
    for extra in ([], ["--cache-implementation", "static", "--dtype", "fp32"]):
        code = main(["generate", str(tmp_path / "moe"), "the quick", "--max-new-tokens", "6", *extra])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert "decode" in err and "tok/s" in err
        texts.append(out.strip())
    assert texts[0] and texts[0] == texts[1]


# --------------------------------------------------------------------------------------- the attention-block step
def converted_family(model_type: str, seed: int = 0, layers=None):
    torch.manual_seed(seed)
    dense = tiny_dense(model_type, seed=seed)
    return hf_moe.convert_to_moe(dense, num_experts=4, top_k=2, noise=0.1, verify=False, layers=layers).eval()


def test_the_attention_block_step_says_which_models_it_runs_and_why_not_the_others():
    config = decode_compile_config(one_op=False)
    for family in ("llama", "qwen2", "qwen3"):
        assert choose_decode(converted_family(family), 1, config).engine == "attention_block", family
    choice = choose_decode(converted_family("mistral"), 1, config)  # tiny mistral: sliding_window=6
    assert choice.engine == "compiled" and "sliding window" in choice.reason
    assert "GemmaModel" in choose_decode(converted_family("gemma"), 1, config).reason
    assert "float16" in choose_decode(converted_family("llama").half(), 1, config).reason
    assert choose_decode(converted_family("gemma")).engine == "eager"  # the plain call compiles nothing


@pytest.mark.slow
def test_attention_block_step_of_a_padded_batch_gives_the_eager_tokens_and_never_recompiles():
    """The attention-block step (hf_moe.decode) runs for every decoded token of a left-padded batch of Qwen3 (q/k
    norms; Llama: the tests above; the kernel's tests cover Qwen2's biases), a dense layer among the MoE ones, and
    gives the eager path's greedy tokens and scores; a second call reuses its graph."""
    torch.compiler.reset()
    moe = converted_family("qwen3", layers=[0, 2])  # layer 1 keeps its dense MLP
    ids = random_ids(2, 9, seed=5)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=5, min_new_tokens=5, pad_token_id=0,
                  return_dict_in_generate=True, output_scores=True)
    with torch.compiler.set_stance("force_eager"):
        eager = moe.generate(ids, **EAGER, **kwargs)
    with RecompileLog() as log:
        fast = moe.generate(ids, cache_implementation="static", **kwargs)
        steps = [step for _, step in moe._hf_moe_decode_steps]
        assert len(steps) == 1 and steps[0] is not None  # hf_moe's step, not transformers' compiled forward
        with torch.compiler.set_stance("fail_on_recompile"):
            again = moe.generate(random_ids(2, 9, seed=6), cache_implementation="static", **kwargs)
    assert not log.recompiled, "\n".join(log.lines)
    assert not hasattr(moe, "_compiled_call")  # transformers' compiled forward never ran
    assert torch.equal(eager.sequences, fast.sequences) and again.sequences.shape == fast.sequences.shape
    torch.testing.assert_close(torch.stack(eager.scores), torch.stack(fast.scores), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("one_op", [False, True], ids=["compiled", "one_op"])
def test_int8_linears_decode_in_hf_moe_step_with_the_eager_int8_tokens(one_op, monkeypatch):
    """quantize_experts(..., linears=True): the attention projections and the LM head are int8 too; hf_moe's step
    runs them (hf_moe::decode_attention_block and linear_infer on int8) with the eager int8 model's greedy tokens,
    compiled and as one op (hf_moe.decode_one_op)."""
    torch.compiler.reset()
    moe = converted().to(torch.bfloat16)
    hf_moe.quantize_experts(moe, "int8", linears=True)
    ids = random_ids(1, 10, seed=4)
    with torch.compiler.set_stance("force_eager"):
        eager = greedy(moe, ids, 6, **EAGER)
    from hf_moe import decode_one_op

    made = []
    monkeypatch.setattr(decode_one_op, "DecodePlan", lambda *a: made.append(a) or one_op_plan(*a))
    fast = greedy(moe, ids, 6, cache_implementation="static", compile_config=decode_compile_config(one_op=one_op))
    assert moe._hf_moe_decode_steps[0][1] is not None and len(made) == one_op
    assert torch.equal(eager.sequences, fast.sequences)
    torch.testing.assert_close(torch.stack(eager.scores), torch.stack(fast.scores), atol=0.1, rtol=0.05)


@pytest.mark.slow
def test_later_steps_skip_the_guards_and_each_call_checks_them_again(monkeypatch):
    """The attention-block step skips Dynamo's guards after the first step of a `generate` call (hf_moe.decode);
    each call's first step evaluates them all, so a model quantized between two calls that share one static cache
    (the caller's, reset) decodes as the quantized model."""
    from transformers import StaticCache

    import hf_moe.decode
    from hf_moe.compat import CACHE_NAME

    skipped = []

    def counting():
        skipped.append(1)
        return hf_moe.compat.skipping_guards()

    monkeypatch.setattr(hf_moe.decode, "skipping_guards", counting)
    torch.compiler.reset()
    moe = converted().to(torch.bfloat16)
    ids = random_ids(1, 10, seed=4)
    cache = StaticCache(config=moe.config, max_cache_len=64)
    reused = {CACHE_NAME: cache, "compile_config": decode_compile_config(one_op=False)}
    greedy(moe, ids, 5, **reused)
    assert len(skipped) == 3  # 5 tokens: the prefill's, then 4 decode steps, the first of them checked
    hf_moe.quantize_experts(moe, "int8", linears=True)  # new modules: the bf16 graph no longer fits
    with torch.compiler.set_stance("force_eager"):
        eager = greedy(moe, ids, 6, **EAGER)
    cache.reset()
    fast = greedy(moe, ids, 6, **reused)
    assert len(skipped) == 3 + 4
    assert torch.equal(eager.sequences, fast.sequences)
    torch.testing.assert_close(torch.stack(eager.scores), torch.stack(fast.scores), atol=0.1, rtol=0.05)
    checked = greedy(moe, ids, 6, compile_config=decode_compile_config(skip_guards=False, one_op=False),
                     cache_implementation="static")  # (servers that run compiled code from several threads)
    assert len(skipped) == 3 + 4 and torch.equal(checked.sequences, eager.sequences)


def test_unsupported_models_decode_with_transformers_compiled_step():
    """A model the attention-block step does not cover (gemma's layer) compiles transformers' own decode step, as
    before."""
    from hf_moe.generation import decode_compile_config

    moe = converted_family("gemma")
    call = moe.get_compiled_call(decode_compile_config())
    assert moe._hf_moe_decode_steps == [(decode_compile_config(), None)] and call is moe._compiled_call
