"""Calibration text: a local file read, tokenized and cut into rows of one length, checked to be long enough.

A .txt file is one text; a .jsonl file one JSON object per line, a .json file a list of objects (or one), each with
a `text` field. The file is read and tokenized piece by piece until `max_tokens` tokens are collected
(`hf_moe.inputs.token_ids`: the rest is never read, whatever the file's size); they are cut into rows of `seq_len`
(the last, partial row is dropped unless it is the only one).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..inputs import TEXT_KINDS, InputFileError, token_ids
from .layout import ShrinkError

MIN_TOKENS = 256  # below this a method's statistics are noise
TOKENS_PER_EXPERT = 16  # ... and each expert should expect this many (token, slot) pairs at least


def min_tokens(num_experts: int, top_k: int) -> int:
    """Tokens the calibration text must give: MIN_TOKENS, and enough for TOKENS_PER_EXPERT pairs per expert."""
    return max(MIN_TOKENS, -(-TOKENS_PER_EXPERT * num_experts // top_k))


def calibration_ids(path, tokenizer, max_tokens: int, seq_len: int, needed: int) -> torch.Tensor:
    """[B, T] token ids of the first `max_tokens` tokens of the file at `path`, in rows of `seq_len` (T = the text's
    length when shorter). A `ShrinkError` when the text gives fewer than `needed` tokens."""
    if max_tokens < needed:
        raise ShrinkError(f"calibration_tokens={max_tokens} is below the {needed} tokens shrinking needs here; "
                          f"raise it to {needed} or more.")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Calibration data {str(path)!r} is not a file.")
    if path.suffix.lower() not in TEXT_KINDS:
        raise ShrinkError(f"Calibration data must be a .txt, .json or .jsonl file (a `text` field), got {path.name!r}.")
    try:
        ids = token_ids(path, tokenizer, max_tokens, "The calibration data")
    except InputFileError as err:
        raise ShrinkError(str(err)) from None
    if len(ids) < needed:
        raise ShrinkError(
            f"The calibration text {Path(path).name} gives {len(ids)} tokens; shrinking needs at least {needed} "
            f"(at least {MIN_TOKENS}, and {TOKENS_PER_EXPERT} routed tokens per expert). Give it more text, ideally "
            "a few thousand tokens like the text the model will serve."
        )
    length = min(seq_len, len(ids))
    rows = len(ids) // length
    return torch.tensor(ids[: rows * length]).view(rows, length)
