"""Shared fixtures: tiny models of every family the core conversion supports, built from configs (no hub)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 128
_DECODER = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4)
# model_type -> tiny config kwargs. Chosen to exercise: GQA, sliding windows, GeGLU, fused gate_up, Conv1D + biases,
# parallel-residual NeoX, and OPT's MLP written inline in the decoder layer.
FAMILIES = {
    "llama": dict(_DECODER, num_key_value_heads=2),
    "mistral": dict(_DECODER, num_key_value_heads=2, sliding_window=6),
    "qwen2": dict(_DECODER, num_key_value_heads=2),
    "qwen3": dict(_DECODER, num_key_value_heads=2, head_dim=16),
    "gemma": dict(_DECODER, num_key_value_heads=1, head_dim=16),
    "phi3": dict(_DECODER, num_key_value_heads=2, pad_token_id=0),
    "gpt2": dict(n_embd=64, n_layer=3, n_head=4, n_positions=64),
    "gpt_neox": dict(_DECODER),
    "opt": dict(hidden_size=64, ffn_dim=96, num_hidden_layers=3, num_attention_heads=4, word_embed_proj_dim=64,
                max_position_embeddings=64),
}
SPECIAL_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


def tiny_config(model_type: str, **overrides):
    kwargs = {"vocab_size": VOCAB, **SPECIAL_IDS, **FAMILIES[model_type], **overrides}
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_dense(model_type: str = "llama", seed: int = 0, **overrides):
    """A randomly initialised dense causal LM in eval mode, fp32."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides)).eval()


def random_ids(batch: int = 2, length: int = 12, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def tiny_tokenizer():
    """A character-level fast tokenizer with < VOCAB ids, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?'\"-\n"
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(chars)}}
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


CORPUS = (
    "the quick brown fox jumps over the lazy dog. " * 3
    + "a mixture of experts routes each token to a few experts. "
    + "sparse models grow parameters without growing compute. "
)


class _Logits(torch.nn.Module):
    """A causal LM as a function of its input ids alone, returning its logits: what an exporter traces."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def logits_of_a_tiny_moe(which: str) -> torch.nn.Module:
    """A tiny MoE model for the export tests, in eval mode, as `input_ids -> logits`: "converted" (a Llama upcycled
    to 4 experts, with noise so the experts differ), "quantized" (the same with int8 experts) or "native_mixtral"
    (transformers' Mixtral on hf_moe's experts)."""
    import hf_moe

    torch.manual_seed(0)
    if which in ("converted", "quantized"):
        model = hf_moe.convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, noise=0.05)
        if which == "quantized":
            hf_moe.quantize_experts(model, "int8")
    else:
        config = AutoConfig.for_model("mixtral", vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                      num_experts_per_tok=2, intermediate_size=16)
        model = AutoModelForCausalLM.from_config(config, experts_implementation="hf_moe")
    return _Logits(model.eval())


def hub_cache(source: Path, cache: Path, repo: str = "org/moe", revision: str = "main", subfolder: str = "") -> Path:
    """Lay `source` out as huggingface_hub caches a download of `repo` (offline, nothing fetched): each file's bytes in
    blobs/<sha256>, snapshots/<commit>/[subfolder/]<file> a relative link to its blob, refs/<revision> naming the
    commit. Returns the snapshot's directory (the subfolder's)."""
    import hashlib

    root = cache / f"models--{repo.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest()
    snapshot = root / "snapshots" / commit / subfolder
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for path in sorted(source.iterdir()):
        if path.is_file():
            data = path.read_bytes()
            blob = root / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / revision).write_text(commit)
    return snapshot
