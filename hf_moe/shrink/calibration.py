"""Calibration text: a local file read, tokenized and cut into rows of one length, checked to be long enough.

A .txt file is read whole; a .jsonl file one JSON object per line, a .json file a list of objects (or one), each with
a `text` field. The texts are joined with blank lines and tokenized once; the first `max_tokens` tokens are cut
into rows of `seq_len` (the last, partial row is dropped unless it is the only one).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .layout import ShrinkError

MIN_TOKENS = 256  # below this a method's statistics are noise
TOKENS_PER_EXPERT = 16  # ... and each expert should expect this many (token, slot) pairs at least


def read_texts(path: str | os.PathLike) -> list[str]:
    """The texts of a local .txt, .json or .jsonl file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Calibration data {str(path)!r} is not a file.")
    kind = path.suffix.lower()
    if kind not in (".txt", ".json", ".jsonl"):
        raise ShrinkError(f"Calibration data must be a .txt, .json or .jsonl file (a `text` field), got {path.name!r}.")
    raw = path.read_text(errors="replace")
    if kind == ".txt":
        return [raw]
    try:
        if kind == ".jsonl":
            records = [json.loads(line) for line in raw.splitlines() if line.strip()]
        else:
            records = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ShrinkError(f"{path} is not valid {kind[1:].upper()}: {err}.") from None
    records = records if isinstance(records, list) else [records]
    texts = [r["text"] for r in records if isinstance(r, dict) and isinstance(r.get("text"), str)]
    if not texts:
        raise ShrinkError(f"{path} holds no record with a `text` field (a string).")
    return texts


def min_tokens(num_experts: int, top_k: int) -> int:
    """Tokens the calibration text must give: MIN_TOKENS, and enough for TOKENS_PER_EXPERT pairs per expert."""
    return max(MIN_TOKENS, -(-TOKENS_PER_EXPERT * num_experts // top_k))


def calibration_ids(path, tokenizer, max_tokens: int, seq_len: int, needed: int) -> torch.Tensor:
    """[B, T] token ids of the first `max_tokens` tokens of the file at `path`, in rows of `seq_len` (T = the text's
    length when shorter). A `ShrinkError` when the text gives fewer than `needed` tokens."""
    if max_tokens < needed:
        raise ShrinkError(f"calibration_tokens={max_tokens} is below the {needed} tokens shrinking needs here; "
                          f"raise it to {needed} or more.")
    ids: list[int] = []
    for text in read_texts(path):
        ids.extend(tokenizer(text)["input_ids"])
        if len(ids) >= max_tokens:
            break
    if len(ids) < needed:
        raise ShrinkError(
            f"The calibration text {Path(path).name} gives {len(ids)} tokens; shrinking needs at least {needed} "
            f"(at least {MIN_TOKENS}, and {TOKENS_PER_EXPERT} routed tokens per expert). Give it more text, ideally "
            "a few thousand tokens like the text the model will serve."
        )
    ids = ids[:max_tokens]
    length = min(seq_len, len(ids))
    rows = len(ids) // length
    return torch.tensor(ids[: rows * length]).view(rows, length)
