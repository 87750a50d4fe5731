"""The transformers release installed runs hf_moe without deprecation warnings, and the version records agree.

CI runs the whole suite on the newest transformers the bounds admit and scripts/test_oldest.sh on the oldest, so a
release that deprecates something hf_moe uses fails here (transformers 5.24 renamed `past_key_values` to `cache`).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from hf_moe import compat

pytestmark = pytest.mark.oldest

ROOT = Path(__file__).resolve().parents[1]

# convert -> save -> load -> forward with a cache -> generate -> train a step -> export, in a fresh process
# (transformers logs most deprecations once per process), with every warning and transformers log line recorded.
FLOW = r"""
import io, logging, sys, tempfile, warnings
sys.path.insert(0, sys.argv[1])
warnings.simplefilter("always")
log = io.StringIO()
logging.getLogger("transformers").addHandler(logging.StreamHandler(log))
from conftest import random_ids, tiny_dense
import torch
import hf_moe
from hf_moe.compat import cache_kwargs, output_cache
from transformers import AutoModelForCausalLM

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = tempfile.mkdtemp()
    hf_moe.convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2).save_pretrained(out + "/moe")
    model = AutoModelForCausalLM.from_pretrained(out + "/moe")
    ids = random_ids()
    with torch.no_grad():
        first = model(ids, use_cache=True)
        model(ids[:, :1], use_cache=True, **cache_kwargs(output_cache(first)))
    model.generate(ids, max_new_tokens=3, do_sample=False)
    model.train()
    model(ids, labels=ids).loss.backward()
    hf_moe.export_native(out + "/moe", out + "/native")
deprecations = (DeprecationWarning, FutureWarning)
found = [f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, deprecations)]
found += [line for line in log.getvalue().splitlines() if "deprecat" in line.lower()]
print("\n".join(found))
"""


@pytest.mark.subprocess
def test_no_deprecation_warning_on_the_installed_transformers():
    result = subprocess.run([sys.executable, "-c", FLOW, str(ROOT / "tests")], capture_output=True, text=True,
                            cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    found = [line for line in result.stdout.splitlines() if line.strip()]
    assert not found, f"transformers {transformers.__version__}:\n" + "\n".join(found)


def test_cache_name_is_the_installed_releases():
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    assert compat.CACHE_NAME in MoeCausalLMOutputWithPast.__dataclass_fields__
    expected = "cache" if tuple(map(int, transformers.__version__.split(".")[:2])) >= (5, 24) else "past_key_values"
    assert compat.CACHE_NAME == expected


def test_tested_releases_are_the_bounds_and_the_compatibility_page_says_so():
    """compat.TESTED, pyproject's bound (checked in test_repo.py) and docs/compatibility.md name the same releases."""
    oldest, newest = compat.TESTED["transformers"]
    page = (ROOT / "docs" / "compatibility.md").read_text()
    minor = lambda v: ".".join(v.split(".")[:2])  # noqa: E731
    assert f"transformers {minor(oldest)}" in page and f"transformers {minor(newest)}" in page
    assert re.search(rf"<{minor(newest).split('.')[0]}\.{int(minor(newest).split('.')[1]) + 1}\b", page)
