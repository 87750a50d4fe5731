"""`hf-moe convert`, `hf-moe inspect` and `hf-moe export`."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import random_ids, tiny_dense, tiny_tokenizer
from transformers import AutoModelForCausalLM

from hf_moe import MoEForCausalLM
from hf_moe.cli import main


@pytest.fixture
def dense_dir(tmp_path):
    dense = tiny_dense("qwen2")
    dense.save_pretrained(tmp_path / "dense")
    tiny_tokenizer().save_pretrained(tmp_path / "dense")
    return tmp_path / "dense"


def test_convert_then_inspect(dense_dir, tmp_path, capsys):
    out = tmp_path / "moe"
    assert main(["convert", str(dense_dir), str(out), "--num-experts", "4", "--top-k", "2", "--layers", "0,2",
                 "--noise", "0.0"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("Streamed") and "2 MoE layers x 4 experts (top-2)" in printed
    assert "Max |MoE block - dense MLP|" in printed
    moe = MoEForCausalLM.from_pretrained(out)
    assert moe.dtype == torch.float32 and moe.config.moe_layers == [0, 2]
    assert (out / "tokenizer.json").is_file()  # OUT is self-contained

    assert main(["inspect", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "MoE layers       2 of 3: 0, 2" in summary
    assert "4 per MoE layer, top-2 (renormalised weights)" in summary
    assert "active per token" in summary and "model-expert-00003.safetensors" in summary


def test_dtype_option(dense_dir, tmp_path):
    assert main(["convert", str(dense_dir), str(tmp_path / "m"), "--num-experts", "4", "--top-k", "2",
                 "--dtype", "bfloat16"]) == 0
    assert MoEForCausalLM.from_pretrained(tmp_path / "m").dtype == torch.bfloat16


def test_every_option(dense_dir, tmp_path):
    assert main(["convert", str(dense_dir), str(tmp_path / "m"), "--num-experts", "2", "--top-k", "1",
                 "--every", "2"]) == 0
    moe = MoEForCausalLM.from_pretrained(tmp_path / "m")
    assert moe.config.moe_layers == [1]
    dense = tiny_dense("qwen2")
    ids = random_ids()
    with torch.no_grad():
        torch.testing.assert_close(moe(ids).logits, dense(ids).logits, rtol=0, atol=2e-5)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["convert", "/no/such/model", "OUT", "--num-experts", "4", "--top-k", "2"], "does not exist"),
        (["convert", "DENSE", "OUT", "--num-experts", "4", "--top-k", "8"], "top_k must be"),
        (["convert", "DENSE", "OUT", "--num-experts", "4", "--top-k", "2", "--layers", "9"], "out of range"),
        (["inspect", "/no/such/moe"], "no config.json"),
        (["convert", "DENSE", "OUT", "--num-experts", "4", "--top-k", "2", "--seed", str(2**70)],
         "seed must be an int from 0 to 2**64 - 1"),  # (was torch's "Overflow when unpacking long long")
        (["verify", "DENSE"], "holds a `qwen2` model, not an hf_moe checkpoint"),  # (exited 1, as if damaged)
    ],
)
def test_errors_exit_2_with_a_message(argv, message, dense_dir, tmp_path, capsys):
    argv = [str(dense_dir) if a == "DENSE" else str(tmp_path / "o") if a == "OUT" else a for a in argv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_generate_with_an_empty_prompt_is_an_error_not_a_traceback(dense_dir, tmp_path, capsys):
    """`hf-moe generate MODEL ""` ended in a RuntimeError traceback from generate (no input tokens)."""
    out = tmp_path / "moe"
    assert main(["convert", str(dense_dir), str(out), "--num-experts", "2", "--top-k", "1"]) == 0
    capsys.readouterr()
    assert main(["generate", str(out), ""]) == 2
    assert "The prompt is empty" in capsys.readouterr().err


@pytest.mark.subprocess
def test_console_script_is_installed():
    result = subprocess.run(["hf-moe", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and all(c in result.stdout for c in ("convert", "inspect", "export"))
    result = subprocess.run([sys.executable, "-m", "hf_moe.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "convert" in result.stdout


@pytest.mark.subprocess
def test_help_imports_neither_torch_nor_transformers():
    """`hf-moe --help` used to import everything first (slow for a help text); parsing is now standard library only."""
    code = (
        "import sys, hf_moe_cli\n"
        "try:\n    hf_moe_cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'hf_moe') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


@pytest.mark.subprocess
def test_env_report_names_every_op():
    result = subprocess.run([sys.executable, "-m", "hf_moe.env"], capture_output=True, text=True, check=True)
    for op in ("sort_by_expert", "permute", "grouped_mm", "expert_act", "unpermute", "experts (whole layer)"):
        assert op in result.stdout
    assert "torch" in result.stdout and "transformers" in result.stdout


def test_router_options(dense_dir, tmp_path):
    assert main(["convert", str(dense_dir), str(tmp_path / "m"), "--num-experts", "4", "--top-k", "1",
                 "--router", "switch", "--capacity-factor", "1.5"]) == 0
    config = MoEForCausalLM.from_pretrained(tmp_path / "m").config
    assert (config.router_type, config.capacity_factor, config.num_experts_per_tok) == ("switch", 1.5, 1)


def test_in_memory_conversion_checks_logits(dense_dir, tmp_path, capsys):
    assert main(["convert", str(dense_dir), str(tmp_path / "m"), "--num-experts", "4", "--top-k", "2",
                 "--in-memory"]) == 0
    printed = capsys.readouterr().out
    assert not printed.startswith("Streamed") and "greedy tokens equal" in printed


def test_split_with_shared_experts_and_coactivation(dense_dir, tmp_path, capsys):
    from conftest import CORPUS

    data = tmp_path / "calib.txt"
    data.write_text(CORPUS * 4)
    assert main(["convert", str(dense_dir), str(tmp_path / "m"), "--num-experts", "3", "--top-k", "3",
                 "--method", "split", "--partition", "coactivation", "--calibration-data", str(data),
                 "--num-shared-experts", "1"]) == 0
    captured = capsys.readouterr()
    assert "Converting in memory" in captured.err and "coactivation" in captured.err
    assert "greedy tokens equal" in captured.out and "1 shared" in captured.out
    config = MoEForCausalLM.from_pretrained(tmp_path / "m").config
    assert (config.num_shared_experts, config.router_weights, config.moe_intermediate_size) == (1, "unit", 24)
    assert config.moe_conversion["options"]["partition"] == "coactivation"
    assert main(["inspect", str(tmp_path / "m")]) == 0
    assert "top-3 (unit weights), + 1 shared (intermediate 24 each)" in capsys.readouterr().out


def test_options_of_the_other_method_are_refused(dense_dir, tmp_path, capsys):
    assert main(["convert", str(dense_dir), str(tmp_path / "m"), "--num-experts", "4", "--top-k", "2",
                 "--method", "split", "--noise", "0.1"]) == 2
    assert "only apply to method='upcycle'" in capsys.readouterr().err


@pytest.fixture
def mistral_moe_dir(tmp_path):
    """`hf-moe convert` of a tiny Mistral whose card declares a licence."""
    dense = tiny_dense("mistral")
    dense.save_pretrained(tmp_path / "dense")
    tiny_tokenizer().save_pretrained(tmp_path / "dense")
    (tmp_path / "dense" / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny\n")
    assert main(["convert", str(tmp_path / "dense"), str(tmp_path / "moe"), "--num-experts", "4", "--top-k", "2",
                 "--noise", "0.01"]) == 0
    return tmp_path / "moe"


def test_export_a_saved_checkpoint(mistral_moe_dir, tmp_path, capsys):
    out = tmp_path / "native"
    assert main(["export", str(mistral_moe_dir), str(out)]) == 0
    printed = capsys.readouterr().out
    assert "as MixtralForCausalLM" in printed and "greedy tokens equal" in printed
    assert (out / "tokenizer.json").read_bytes() == (mistral_moe_dir / "tokenizer.json").read_bytes()
    card = (out / "README.md").read_text()
    assert "\nlicense: apache-2.0\n" in card and "`apache-2.0`, the base model's" in card
    ids = random_ids(length=16)  # longer than the sliding window (6)
    with torch.no_grad():
        native = AutoModelForCausalLM.from_pretrained(out)(ids).logits
        moe = MoEForCausalLM.from_pretrained(mistral_moe_dir)(ids).logits
    torch.testing.assert_close(native, moe, rtol=0, atol=1e-5)


def test_export_errors_exit_2(mistral_moe_dir, dense_dir, tmp_path, capsys):
    assert main(["export", str(mistral_moe_dir), str(mistral_moe_dir)]) == 2
    assert "Export to a new directory" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["convert", str(dense_dir), str(tmp_path / "qwen2"), "--num-experts", "4", "--top-k", "2"]) == 0
    capsys.readouterr()
    assert main(["export", str(tmp_path / "qwen2"), str(tmp_path / "out")]) == 2
    assert "`qwen2` has no native transformers MoE architecture" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
