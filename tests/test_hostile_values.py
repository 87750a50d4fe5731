"""Every value read from a file or an argument is checked, with a short message: command-line options,
config.json fields and the index's values."""

from __future__ import annotations

import math

import pytest
from conftest import tiny_dense
from hostile_support import (
    copy_of,
    edit_json,
    hostile,
    refused,
    refused_under_verify,
    saved,  # noqa: F401 (fixture)
)

import hf_moe.checkpoint as checkpoint
from hf_moe import MoEForCausalLM, convert_to_moe
from hf_moe.cli import main as cli


# -- Every value read from a file or an argument is checked, with a short message ------------------------------------
def test_capacity_factor_inf_on_the_command_line(tmp_path, capsys):
    tiny_dense("llama").save_pretrained(tmp_path / "dense")
    for value in ("inf", "nan", "-1"):
        assert cli(["convert", str(tmp_path / "dense"), str(tmp_path / "moe"), "--num-experts", "4", "--top-k", "2",
                    "--capacity-factor", value]) == 2
        assert "capacity_factor must be positive and finite" in capsys.readouterr().err
    assert not (tmp_path / "moe").exists()


@pytest.mark.parametrize("option", [dict(noise=math.nan), dict(router_aux_loss_coef=math.nan),
                                    dict(num_prototypes=0, router_type="prototype"), dict(reinit_fraction=math.nan),
                                    dict(router_jitter_noise=math.inf), dict(router_z_loss_coef=-1.0)])
def test_nan_and_out_of_range_options_are_refused(option):
    name = next(iter(option))
    with pytest.raises(ValueError, match=name):
        convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, **option)


CONFIG_EDITS = {
    "num_experts as a string": ({"num_experts": "4"}, "num_experts must be an int"),
    "a million experts": ({"num_experts": 10**6}, "num_experts=1000000"),
    "capacity_factor inf": ({"capacity_factor": math.inf}, "capacity_factor must be positive and finite"),
    "aux loss NaN": ({"router_aux_loss_coef": math.nan}, "router_aux_loss_coef must be a finite number"),
    "zero prototypes": ({"num_prototypes": 0, "router_type": "prototype"}, "num_prototypes must be at least 1"),
    "a norm bypassed": ({"moe_bypassed_paths": ["post_attention_layernorm"]}, "post_attention_layernorm"),
    "string layers": ({"moe_layers": ["0", "1"]}, "moe_layers must be a list of ints"),
    "bool experts": ({"num_experts_per_tok": True}, "num_experts_per_tok must be an int"),
    "format as a string": ({"hf_moe_format": "1"}, "hf_moe_format='1'"),
    "unknown activation": ({"expert_hidden_act": "x" * 10**5}, "expert_hidden_act"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_EDITS))
def test_config_values_are_checked(saved, tmp_path, case):
    edit, text = CONFIG_EDITS[case]
    directory = copy_of(saved[0], tmp_path / "moe")
    edit_json(directory / "config.json", lambda config: config.update(edit))
    hostile()
    message = refused(lambda: MoEForCausalLM.from_pretrained(directory), "config.json", text)
    assert len(message) < 1000, len(message)
    refused_under_verify(directory, "config.json")


@pytest.mark.parametrize("case", ["list weight_map", "non-string file", "weight_map missing", "index not an object",
                                  "index not JSON", "bad checksums entry"])
def test_index_values_are_checked(saved, tmp_path, case):
    directory = copy_of(saved[0], tmp_path / "moe")
    index = directory / checkpoint.INDEX_NAME
    edits = {
        "list weight_map": lambda i: i.update(weight_map=list(i["weight_map"].items())),
        "non-string file": lambda i: i["weight_map"].update({next(iter(i["weight_map"])): ["a"]}),
        "weight_map missing": lambda i: i.pop("weight_map"),
        "bad checksums entry": lambda i: i["metadata"]["checksums"]["files"].update({"x": 3}),
    }
    if case == "index not an object":
        index.write_text("[1, 2]")
    elif case == "index not JSON":
        index.write_bytes(b"{\xff")
    else:
        edit_json(index, edits[case])
    hostile()
    refused(lambda: MoEForCausalLM.from_pretrained(directory), checkpoint.INDEX_NAME)
    refused_under_verify(directory, checkpoint.INDEX_NAME)
