"""selfspec/export/gguf.py: EAGLE-3 heads as llama.cpp ``eagle3`` GGUF drafts, proven by llama.cpp itself.

The fast tests check the refusals and the read-back check on files written here with the ``gguf`` package. The
slow ones take the llama.cpp build cached under the selfspec cache (built once per machine from the
``llama-cpp-python`` sdist by ``python -m selfspec.llamacpp``, about 12 minutes on 2 cores; ``.ci/run`` runs it;
the tests never build it), convert a SmolLM2 EAGLE-3 head with llama.cpp's own converter and run it with the
target's Q4_1 GGUF in ``llama-speculative-simple --spec-type draft-eagle3``: it loads, the greedy text equals
llama.cpp's own greedy text without the draft, and the acceptance llama.cpp reports is well above zero.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from selfspec.base.fingerprint import target_fingerprint
from selfspec.export.common import ExportError
from selfspec.export.gguf import GGUF_TENSORS, check_gguf, export_gguf
from selfspec.heads.eagle import EagleConfig, EagleHead
from selfspec.heads.eagle3 import Eagle3Config, Eagle3Head
from tests.helpers.archs import tiny_llama

D, V = 32, 96
IDS = torch.tensor([0, 1, 2, 5, 8, 13, 21, 34, 55, 89])


@pytest.fixture(scope="module")
def target():
    return tiny_llama(layers=3)


def eagle3_head(target) -> Eagle3Head:
    torch.manual_seed(0)
    cfg = Eagle3Config(
        hidden_size=D,
        vocab_size=V,
        draft_vocab_size=IDS.numel(),
        num_target_layers=3,
        target="tiny",
        target_fingerprint=target_fingerprint(target),
    )
    return Eagle3Head(cfg, target.config, draft_ids=IDS, target=target).eval()


def write_eagle3_gguf(path: Path, head: Eagle3Head, *, d2t=None, layers=None, drop: str | None = None) -> Path:
    """A file in the layout llama.cpp's converter writes (names, metadata keys, absolute int64 d2t)."""
    writer = GGUFWriter(str(path), "eagle3")
    writer.add_array("eagle3.target_layers", list(head.target_layers if layers is None else layers))
    writer.add_uint32("eagle3.target_hidden_size", head.config.hidden_size)
    for name in sorted(GGUF_TENSORS - {drop}):
        if name == "d2t":
            ids = head.draft_ids.numpy() if d2t is None else np.asarray(d2t)
            writer.add_tensor(name, ids.astype(np.int64))
        else:
            writer.add_tensor(name, np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_refuses_heads_that_are_not_eagle3(target, tmp_path):
    """llama.cpp loads EAGLE-3 and DFlash / DSpark drafts only: an EAGLE-1 head is refused before anything is
    built or written, and the message names what to do instead."""
    cfg = EagleConfig(hidden_size=D, vocab_size=V, target="tiny", target_fingerprint=target_fingerprint(target))
    head = EagleHead(cfg, target.config, target=target)
    with pytest.raises(ExportError, match="EAGLE-3, DFlash and DSpark heads.*--format sglang"):
        export_gguf(head, tmp_path / "out", target_dir=tmp_path)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags", [dict(fc_norm=True), dict(norm_output=True)], ids=lambda f: next(iter(f)))
def test_gguf_refuses_eagle31_heads(target, tmp_path, flags):
    """llama.cpp's eagle3 draft (``src/models/eagle3.cpp``; its converter ``conversion/llama.py``) reads neither
    EAGLE-3.1 option: such a head is refused, naming the flag and llama.cpp's reason, before anything is built or
    written (the target directory is not even read)."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(eagle3_head(target).config, **flags)
    head = Eagle3Head(cfg, target.config, draft_ids=IDS, target=target)
    name = next(iter(flags))
    with pytest.raises(ExportError, match=f"EAGLE-3.1 head \\({name}=true\\); llama.cpp's eagle3 draft"):
        export_gguf(head, tmp_path / "out", target_dir=tmp_path / "nowhere")
    assert not (tmp_path / "out").exists()


def test_gguf_refuses_another_target(target, tmp_path):
    """A target directory whose sizes are not the head's is refused (the converter would take its tokenizer and
    layer count), naming the sizes on both sides; nothing is written."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"hidden_size": 64, "vocab_size": V, "num_hidden_layers": 3}))
    with pytest.raises(ExportError, match=r"\(64, 96, 3\).*\(32, 96, 3\)"):
        export_gguf(eagle3_head(target), tmp_path / "out", target_dir=other)
    assert not (tmp_path / "out").exists()


def test_check_gguf_accepts_the_layout_and_names_each_difference(target, tmp_path):
    """The read-back check passes the converter's layout and refuses a wrong d2t (a shifted map), other fused
    layers, and a missing tensor, each with its own message."""
    head = eagle3_head(target)
    check_gguf(write_eagle3_gguf(tmp_path / "ok.gguf", head), head)
    with pytest.raises(ExportError, match="d2t does not map"):
        check_gguf(write_eagle3_gguf(tmp_path / "d2t.gguf", head, d2t=head.draft_ids.numpy() + 1), head)
    with pytest.raises(ExportError, match=r"target_layers \[0, 1, 1\].*\[0, 1, 2\]"):
        check_gguf(write_eagle3_gguf(tmp_path / "layers.gguf", head, layers=[0, 1, 1]), head)
    with pytest.raises(ExportError, match=r"missing \['fc.weight'\]"):
        check_gguf(write_eagle3_gguf(tmp_path / "fc.gguf", head, drop="fc.weight"), head)


def test_llamacpp_build_is_found_only_when_finished(tmp_path, monkeypatch):
    """The cache entry counts once its stamp is written and lists every tool (a killed build never does);
    $SELFSPEC_LLAMA_CPP names a build of one's own and is refused, naming the layout, when it lacks the tools or
    the converter."""
    from selfspec import llamacpp

    monkeypatch.delenv("SELFSPEC_LLAMA_CPP", raising=False)
    monkeypatch.setenv("SELFSPEC_BUILD_CACHE", str(tmp_path / "cache"))
    entry = llamacpp.build_dir()
    assert entry.parent == tmp_path / "cache" / "llama.cpp" and entry.name.startswith(llamacpp.SDIST_VERSION)
    (entry / "bin").mkdir(parents=True)
    assert llamacpp.find_llamacpp() is None
    (entry / "selfspec-build.json").write_text('{"tools": ["llama-completion"]}')
    assert llamacpp.find_llamacpp() is None  # an older build without every tool is built again
    (entry / "selfspec-build.json").write_text(json.dumps({"tools": list(llamacpp.TOOLS)}))
    assert llamacpp.find_llamacpp() == llamacpp.LlamaCpp(entry)
    own = tmp_path / "own"
    (own / "bin").mkdir(parents=True)
    monkeypatch.setenv("SELFSPEC_LLAMA_CPP", str(own))
    with pytest.raises(FileNotFoundError, match="src/convert_hf_to_gguf.py"):
        llamacpp.find_llamacpp()
    (own / "src").mkdir()
    (own / "src" / "convert_hf_to_gguf.py").write_text("")
    assert llamacpp.find_llamacpp() == llamacpp.LlamaCpp(own)
    with pytest.raises(FileNotFoundError, match="CMake target llama-completion"):
        llamacpp.LlamaCpp(own).tool("llama-completion")
    flags = llamacpp.cmake_flags("x86-64-v3")
    assert "-DBUILD_SHARED_LIBS=OFF" in flags and "-DGGML_NATIVE=OFF" in flags and "-DGGML_AVX2=ON" in flags
    assert not any("AVX" in f for f in llamacpp.cmake_flags("aarch64-generic"))


# ---------------------------------------------------------------- llama.cpp itself (slow)

NEW_TOKENS = 64
PROMPTS = [
    "Write a short poem about the sea.",
    "Explain in three sentences why the sky is blue.",
]


@pytest.mark.slow
def test_llamacpp_runs_our_eagle3_head_exactly(smollm2, smollm2_gguf, llamacpp, tmp_path):
    """Export -> llama.cpp's converter -> ``llama-speculative-simple --spec-type draft-eagle3`` with the target's
    own Q4_1 GGUF: the greedy text equals ``llama-completion``'s (no draft), and llama.cpp accepts most of the
    head's drafts, several tokens per step (``--spec-draft-n-max 3``). The head is fitted
    for a few seconds to llama.cpp's greedy continuations of the prompts, so acceptance is high by design; a
    converted head whose tensors, layers or vocabulary map were wrong would get almost none."""
    from selfspec.llamacpp import completion, speculative_simple
    from selfspec.target import resolve_target
    from tests.helpers.smollm2 import memorising_eagle3_head

    model, tok = smollm2
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in PROMPTS
    ]
    # The head memorises llama.cpp's own greedy continuations (its Q4_1 arithmetic may part from the fp32
    # target's after a few dozen tokens), so that high acceptance is expected wherever the export is right.
    plains = [completion(llamacpp, smollm2_gguf, text, n_predict=NEW_TOKENS, threads=1) for text in texts]
    seqs = [
        tok(text + plain.text, return_tensors="pt", add_special_tokens=False).input_ids[0]
        for text, plain in zip(texts, plains, strict=True)
    ]
    head = memorising_eagle3_head(model, seqs)
    path = export_gguf(head, tmp_path / "gguf", target_dir=resolve_target("smollm2-135m-instruct"), name="draft")
    assert path == tmp_path / "gguf" / "draft.gguf" and sorted(p.name for p in path.parent.iterdir()) == ["draft.gguf"]
    check_gguf(path, head)
    for text, plain in zip(texts, plains, strict=True):
        ours = speculative_simple(
            llamacpp, smollm2_gguf, text, spec_type="draft-eagle3", draft=path, n_predict=NEW_TOKENS, threads=1
        )
        assert plain.prompt_tokens == ours.prompt_tokens == len(tok(text, add_special_tokens=False).input_ids)
        assert plain.new_tokens >= NEW_TOKENS - 1 and plain.text.strip()
        # llama-speculative-simple may decode one token past -n: the texts agree up to the shorter one.
        assert ours.text.startswith(plain.text), (ours.text, plain.text)
        assert ours.drafted > 0 and ours.acceptance > 0.5, ours
        assert ours.tokens_per_step > 2.0, ours


@pytest.mark.slow
def test_the_llamacpp_bench_engine_runs_plain_our_head_and_ngram_drafts(smollm2, smollm2_gguf, llamacpp, tmp_path):
    """``run_llamacpp_bench`` on the real build: plain llama.cpp, our EAGLE-3 head exported on the fly and
    llama.cpp's n-gram drafter, interleaved, with fixed settings (the sweep is tested on rigged timers); the
    report reads back strictly, the head's texts agree with plain llama.cpp's, and llama-bench's costs are sane."""
    from selfspec.bench import BenchSettings, read_report, run_llamacpp_bench, write_report
    from selfspec.engines.llamacpp.settings import head_setting, ngram_setting
    from selfspec.llamacpp import completion
    from selfspec.prompts import BenchPrompt
    from selfspec.target import resolve_target
    from tests.helpers.smollm2 import memorising_eagle3_head

    model, tok = smollm2
    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
    plains = [completion(llamacpp, smollm2_gguf, text, n_predict=NEW_TOKENS, threads=1) for text in texts]
    seqs = [
        tok(text + plain.text, return_tensors="pt", add_special_tokens=False).input_ids[0]
        for text, plain in zip(texts, plains, strict=True)
    ]
    heads = memorising_eagle3_head(model, seqs).save_pretrained(tmp_path / "heads")
    given = {"eagle3": head_setting(draft_max=3), "ngram_simple": ngram_setting("ngram-simple", 8, 3)}
    report = run_llamacpp_bench(
        model,
        tok,
        [BenchPrompt(str(i), "writing", [p]) for i, p in enumerate(PROMPTS)],
        BenchSettings(max_new_tokens=32, warmup=0, target_name="smollm2-135m-instruct"),
        build=llamacpp,
        target_gguf=smollm2_gguf,
        target_dir=Path(resolve_target("smollm2-135m-instruct")),
        heads={"eagle3": heads},
        ngram=["ngram_simple"],
        threads=1,
        given=given,
    )
    assert read_report(write_report(report, tmp_path / "out")["json"]) == report
    assert list(report.methods) == ["llamacpp", "llamacpp_loop", "eagle3", "ngram_simple"]
    assert report.llamacpp.chosen_by == "given"
    head = report.summary["eagle3"].overall
    assert head.mismatches == 0 and head.tau > 1.5 and head.median_tokens_per_s > 0
    assert all(s.results["eagle3"].draft_s is not None for s in report.samples)  # llama.cpp's draft timer, parsed
    costs = report.llamacpp.costs
    assert 0.3 < costs.verify_units[0] < 3.0 and costs.verify_units[-1] >= 0.5 * costs.verify_units[0]
    assert costs.draft_units["eagle3"] is not None and report.llamacpp.verdicts["eagle3"]
