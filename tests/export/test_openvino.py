"""The openvino export (selfspec/export/openvino.py): the layer-id mapping, the refusals and the converter's
arguments (fast); and OpenVINO GenAI itself, in its own venv, running a converted head for the real SmolLM2 target
(slow): output equal to plain OpenVINO, and the accepted-token pattern at one draft token equal to the one selfspec's
head gives on the target states of its own layers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from selfspec.export.cli import export_heads
from selfspec.export.common import ExportError
from selfspec.export.openvino import (
    FP32_PROPERTIES,
    check_openvino_head,
    converter_args,
    openvino_layer_ids,
    openvino_python,
    rt_info_entries,
)
from tests.helpers.engines import engine_missing
from tests.helpers.heads import make_eagle, make_eagle3


def test_layer_ids_name_the_layer_whose_output_is_our_input():
    assert openvino_layer_ids((2, 15, 27), 30) == [1, 14, 26]
    assert openvino_layer_ids([1, 2, 29], 30) == [0, 1, 28]


@pytest.mark.parametrize(
    ("layers", "why"),
    [((0, 15, 27), "input 0"), ((2, 2, 27), "three distinct"), ((2, 15), "three distinct"), ((2, 15, 30), "1..29")],
)
def test_layers_openvino_cannot_name_are_refused(layers, why):
    with pytest.raises(ExportError, match=why):
        openvino_layer_ids(layers, 30)


def test_rt_info_holds_the_fp32_options_and_the_draft_layers():
    assert rt_info_entries(None) == {"runtime_options": FP32_PROPERTIES}
    assert rt_info_entries([1, 14, 26]) == {"runtime_options": FP32_PROPERTIES, "hidden_layers_list": "1 14 26"}
    assert FP32_PROPERTIES == {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}


def test_converter_args_fp32_and_remote_code_for_the_draft_only():
    draft = converter_args(Path("py"), Path("in"), Path("out"), draft=True)
    target = converter_args(Path("py"), Path("in"), Path("out"), draft=False)
    assert draft[:5] == ["py", "-m", "optimum.commands.optimum_cli", "export", "openvino"]
    for args in (draft, target):
        assert args[args.index("--weight-format") + 1] == "fp32"
        assert args[args.index("--task") + 1] == "text-generation-with-past"
        assert args[-1] == "out"
    assert "--trust-remote-code" in draft and "--trust-remote-code" not in target


def test_heads_openvino_does_not_run_are_refused(target):
    with pytest.raises(ExportError, match="EAGLE-3 heads"):
        export_heads(make_eagle(target), "openvino", "unused", target_name_or_path="unused")
    with pytest.raises(ExportError, match="EAGLE-3.1"):
        check_openvino_head(make_eagle3(target, fc_norm=True))
    with pytest.raises(ExportError, match="input 0"):  # the tiny 3-layer target's default layers fuse input 0
        check_openvino_head(make_eagle3(target))


def test_a_missing_venv_names_the_command(monkeypatch):
    monkeypatch.setattr("selfspec.export.openvino.env_works", lambda name: False)
    with pytest.raises(RuntimeError, match="python -m selfspec.engine_envs openvino"):
        openvino_python()


@pytest.fixture(scope="module")
def ov_python() -> Path:
    try:
        return openvino_python()
    except RuntimeError as err:
        engine_missing(str(err))


def teacher_forced_pattern(model, head, prompt: list[int], tokens: list[int], layers) -> list[int]:
    """The tokens per step a one-token chain drafter yields with ``head`` fed the target's ``layers`` inputs, up to
    ``len(tokens)`` new tokens: every draft is scored on the target's own states (a one-token draft never sees its own
    outputs)."""
    seq = torch.tensor(prompt + tokens).unsqueeze(0)
    with torch.inference_mode():
        states = model(input_ids=seq, output_hidden_states=True).hidden_states
        features = torch.cat([states[i] for i in layers], dim=-1)[:, :-1]
        out = head(features, seq[:, 1:], torch.arange(seq.shape[1] - 1).unsqueeze(0))
        pred = head.draft_ids[head.draft_logits(out).argmax(-1)][0].tolist()
    steps, j, full = [], len(prompt), seq[0].tolist()
    while j + 1 < len(full):
        hit = j + 2 < len(full) and pred[j - 1] == full[j + 1]  # with one token left nothing is drafted
        steps.append(2 if hit else 1)
        j += 2 if hit else 1
    return steps


@pytest.mark.slow
def test_openvino_genai_runs_our_eagle3_head_exactly(ov_python, smollm2, tmp_path):
    from selfspec.base.target import resolve_target
    from selfspec.engines.openvino.bench import Worker
    from selfspec.export.openvino import prepare_openvino
    from selfspec.prompts import encode_messages
    from tests.helpers.smollm2 import memorising_eagle3_head

    model, tokenizer = smollm2
    questions = ["Why is the sky blue?", "Write a haiku about autumn.", "What is 12 times 7?"]
    prompts = [encode_messages(tokenizer, [{"role": "user", "content": q}]).tolist() for q in questions]
    with torch.inference_mode():
        answers = [model.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False)[0] for p in prompts]
    head = memorising_eagle3_head(model, answers, steps=60)
    models = prepare_openvino(head, resolve_target("smollm2-135m-instruct"))
    assert models.layer_ids == [i - 1 for i in head.target_layers]
    eos = [tokenizer.eos_token_id]
    plain = Worker(ov_python, models.target, None, FP32_PROPERTIES, tmp_path / "plain.log")
    spec = Worker(ov_python, models.target, models.draft, models.properties, tmp_path / "spec.log")
    try:
        accepted = 0
        for ids in prompts:
            reference = plain.generate(ids, 32, None, eos)["tokens"]
            for k in (1, 3):
                reply = spec.generate(ids, 32, k, eos)
                assert reply["tokens"] == reference, f"num_assistant_tokens {k}"
                accepted += reply["accepted"]
            ours = teacher_forced_pattern(model, head, ids, reference, head.target_layers)
            assert spec.generate(ids, 32, 1, eos)["batch_sizes"][1:] == ours
        assert accepted > 0, "the memorising head accepted nothing: the proof above proves nothing"
    finally:
        plain.close()
        spec.close()
        shutil.rmtree(models.draft, ignore_errors=True)  # the head is the test's own: keep the build cache small
