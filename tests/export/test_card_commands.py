"""Every ``selfspec export`` command a model card prints (``selfspec/card.py``) is one the exporter runs for that head:
each is run here, with the head's directory for the repo id and the tiny target's directory for the target, and must
succeed; a ``--speculative-token-map`` path the card names must be a file of that export. ``gguf`` needs the llama.cpp
build (tests/export/test_gguf.py runs it); here its dispatch is checked up to ``export_gguf``."""

from __future__ import annotations

import re

import pytest

import selfspec.family_records as family_records
from selfspec.base.fingerprint import target_fingerprint
from selfspec.card import head_card
from selfspec.cli import main
from selfspec.heads import Eagle3Head
from selfspec.heads.dflash import BlockHead
from selfspec.heads.eagle import EagleConfig, EagleHead
from selfspec.heads.eagle3 import Eagle3Config
from selfspec.heads.io import read_config
from tests.helpers.archs import tiny_target
from tests.helpers.heads import block_head, make_eagle, make_eagle3, make_medusa

EXPORT = re.compile(r"selfspec export (\S+) --format (\S+) --target (\S+) --out (\S+)")


def _no_bias(target) -> EagleHead:
    V = target.config.vocab_size
    return EagleHead(EagleConfig(32, V, fc_bias=False, target_fingerprint=target_fingerprint(target)), target.config)


HEADS = {
    "medusa": lambda t: make_medusa(t),
    "medusa-shared-reduced": lambda t: make_medusa(t, own_lm_head=False, draft=40),
    "eagle": lambda t: make_eagle(t),
    "eagle-reduced": lambda t: make_eagle(t, draft=40),
    "eagle-no-bias": _no_bias,
    "eagle3": lambda t: make_eagle3(t),
    "eagle3.1": lambda t: make_eagle3(t, fc_norm=True, norm_output=True),  # speculators only
    "dflash": lambda t: block_head(t, "dflash", 4, target_layer_ids=(0, 1)),
    "dspark": lambda t: block_head(t, "dspark", 4, target_layer_ids=(0, 1)),
    "dspark-reduced": lambda t: block_head(t, "dspark", 4, draft=40, target_layer_ids=(0, 1)),  # no sglang
}


@pytest.fixture(scope="module")
def target_dir(target, tmp_path_factory):
    d = tmp_path_factory.mktemp("target") / "tiny-llama"
    target.save_pretrained(d)
    return d


@pytest.mark.parametrize("case", sorted(HEADS))
def test_every_export_command_on_the_card_runs(case, target, target_dir, tmp_path, monkeypatch):
    gguf_calls = []
    for name in ("export_gguf", "export_gguf_block"):  # the gguf exporters of the EAGLE-3 and the block families
        monkeypatch.setattr(family_records, name, lambda head, out, *, target_dir: gguf_calls.append(head) or out)
    monkeypatch.chdir(tmp_path)
    head = HEADS[case](target)
    heads_dir = head.save_pretrained(tmp_path / "heads")
    text = head_card(read_config(heads_dir), repo_id="alice/tiny-heads", base_model="org/tiny").text
    commands = EXPORT.findall(text)
    assert bool(commands) == (case != "eagle-no-bias"), text  # a head without fc.bias: no engine computes it
    for repo, fmt, _, out in commands:
        assert repo == "alice/tiny-heads"
        argv = [str(heads_dir), "--format", fmt, "--target", str(target_dir), "--out", out]
        assert main(["export", *argv]) == 0, (fmt, text)
    gguf = isinstance(head, BlockHead) or (isinstance(head, Eagle3Head) and not head.config.eagle31_flags)
    assert bool(gguf_calls) == gguf
    if case == "eagle3.1":
        assert [fmt for _, fmt, _, _ in commands] == ["speculators"] and "EAGLE-3.1 head" in text
    for path in re.findall(r"--speculative-token-map (\S+)", text):
        assert (tmp_path / path).is_file()
    assert ("--speculative-token-map" in text) == (case == "eagle-reduced")
    if isinstance(head, BlockHead):
        assert ("sglang" in [fmt for _, fmt, _, _ in commands]) == (case != "dspark-reduced")
        assert ("--speculative-num-draft-tokens 5" in text) == (case == "dspark")  # SGLang's DSPARK: B + 1


def test_a_non_llama_eagle_head_gets_no_export_command(tmp_path):
    qwen = tiny_target("qwen3")
    head = Eagle3Head(
        Eagle3Config(32, 96, 40, 3, target_fingerprint=target_fingerprint(qwen)), qwen.config, target=qwen
    )
    text = head_card(read_config(head.save_pretrained(tmp_path / "h")), repo_id="a/b", base_model="org/q").text
    assert not EXPORT.search(text) and "this head's layer is `qwen3`" in text
