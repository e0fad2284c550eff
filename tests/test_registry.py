"""The family registry: every built-in family is whole in every layer, and a family defined only under tests/
(``tests/helpers/toy_family.py``) trains, decodes exactly, saves and loads strictly, benches, gets a model card and
is refused with a clear message by an exporter that has no layout for it, with no edit outside its own file."""

from __future__ import annotations

import json

import pytest
import torch

from selfspec.api import make_drafter
from selfspec.bench.methods import BenchSettings, build_methods
from selfspec.bench.run import run_bench
from selfspec.card import head_card
from selfspec.cli import main
from selfspec.decode.loop import speculative_generate
from selfspec.export.cli import export_heads
from selfspec.export.common import ExportError
from selfspec.families import family, registered_families
from selfspec.heads import load_heads
from selfspec.heads.families import head_families
from selfspec.heads.io import HeadFormatError
from selfspec.prompts import BenchPrompt
from selfspec.train.config import TrainConfig
from selfspec.train.inputs import RunInputs
from selfspec.train.recipes import RECIPES, recipe_for
from tests.helpers.archs import tiny_llama
from tests.helpers.conversations import conversations
from tests.helpers.decoding import reference
from tests.helpers.tokenizers import CharTokenizer, tiny_tokenizer
from tests.helpers.toy_family import TOY, ToyDrafter, ToyHead
from tests.helpers.training import fresh_accelerator

BUILT_IN = ("medusa", "eagle", "eagle3", "dflash", "dspark")


def test_every_built_in_family_is_registered_in_every_layer():
    for name in BUILT_IN:
        assert name in head_families() and name in RECIPES and name in registered_families()
        record = family(name)
        assert record.card is not None and record.title
    assert "block" not in head_families()  # "block" names the code DFlash and DSpark share, not a family


def test_an_unknown_family_is_refused_with_the_registered_ones():
    with pytest.raises(HeadFormatError, match="head_type 'hydra' names no selfspec head family.*register_head_family"):
        family("hydra")
    with pytest.raises(ValueError, match="head must be one of"):
        TrainConfig(head="hydra")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The toy family trained for two steps on a tiny random target through its registered recipe."""
    tmp = tmp_path_factory.mktemp("toy")
    target = tiny_llama(seed=3)
    cfg = TrainConfig(
        head=TOY,
        target="tiny",
        self_distill=False,
        max_length=32,
        draft_vocab_size=None,
        lr=1e-2,
        warmup_steps=1,
        max_steps=2,
        eval_every=1000,
        save_every=1000,
        calibrate_prompts=0,
        output_dir=str(tmp / "run"),
    )
    convs = conversations(12)
    run = RunInputs(cfg, fresh_accelerator(), target, tiny_tokenizer(), convs[:9], convs[9:])
    heads_dir = recipe_for(cfg).train(run)
    return target, heads_dir, json.loads((tmp / "run" / "train_summary.json").read_text())


def test_toy_family_trains_saves_and_loads_strictly(trained, tmp_path):
    target, heads_dir, summary = trained
    assert summary["step"] == 2
    head = load_heads(heads_dir, target=target)
    assert isinstance(head, ToyHead) and head.config.head_type == TOY
    config = json.loads((heads_dir / "config.json").read_text())
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({**config, "extra": 1}))
    (tmp_path / "bad" / "model.safetensors").write_bytes((heads_dir / "model.safetensors").read_bytes())
    with pytest.raises(HeadFormatError, match="extra"):
        load_heads(tmp_path / "bad")
    with pytest.raises(HeadFormatError, match="fingerprint"):
        load_heads(heads_dir, target=tiny_llama(seed=4))


def test_toy_family_decodes_exactly(trained):
    target, heads_dir, _ = trained
    drafter = make_drafter(target, heads_dir, tune="off")
    assert isinstance(drafter, ToyDrafter)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(3, 96, (7,), generator=g)
        out = speculative_generate(target, drafter, ids, max_new_tokens=12)
        assert out.tokens == reference(target, ids, 12)


def test_toy_family_benches(trained):
    target, heads_dir, _ = trained
    settings = BenchSettings(max_new_tokens=10, warmup=0, eos_token_ids=())
    methods = build_methods(target, CharTokenizer(), settings, methods=["baseline"], heads={TOY: heads_dir})
    prompts = [BenchPrompt("a", "x", ("hello there, hello",)), BenchPrompt("b", "y", ("a b c a b c",))]
    report = run_bench(target, CharTokenizer(), methods, prompts, settings).to_dict()
    assert report["mismatches"] == []
    for sample in report["samples"]:
        assert sample["results"][TOY]["tokens"] == sample["results"]["baseline"]["tokens"]


def test_toy_family_card_and_export_refusal(trained, tmp_path, capsys):
    target, heads_dir, _ = trained
    config = json.loads((heads_dir / "config.json").read_text())
    card = str(head_card(config, repo_id="me/toy", base_model="org/tiny"))
    assert "# Toy draft heads for org/tiny" in card and "serve them with selfspec" in card
    head = load_heads(heads_dir, target=target)
    for fmt in ("speculators", "sglang", "gguf"):
        with pytest.raises(ExportError, match=f"the {fmt} format holds .* heads, not toy; no export format holds"):
            export_heads(head, fmt, tmp_path / fmt, target_name_or_path="t")
        assert not (tmp_path / fmt).exists()
    target_dir = tmp_path / "target"
    target.save_pretrained(target_dir)
    argv = [str(heads_dir), "--format", "gguf", "--out", str(tmp_path / "out"), "--target", str(target_dir)]
    assert main(["export", *argv]) == 2
    assert "the gguf format holds EAGLE-3, DFlash and DSpark heads, not toy" in capsys.readouterr().err


def _imports(path) -> set[str]:
    """The modules a file imports (statements anywhere in it, deferred ones included)."""
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return found | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}


def test_export_dispatches_once_and_the_family_registry_imports_no_exporter():
    """The family record names each format's layout; ``selfspec export`` (export/cli.py) asks the record, and neither
    the registry nor any layout module asks the other side: the registry loads the built-in records by name."""
    from pathlib import Path

    from selfspec.families import BUILTIN_RECORDS

    root = Path(__file__).resolve().parents[1] / "selfspec"
    assert not [m for m in _imports(root / "families.py") if m.startswith("selfspec.export")]
    for path in sorted((root / "export").glob("*.py")):
        wanted = {"selfspec.families"} if path.name == "cli.py" else set()
        assert _imports(path) & {"selfspec.families", BUILTIN_RECORDS} == wanted, path.name
    assert set(BUILT_IN) <= set(registered_families())  # loaded on the first lookup
