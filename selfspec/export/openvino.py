"""EAGLE-3 heads for OpenVINO GenAI: the target and the head converted to OpenVINO IR by optimum-intel's own exporter.

``selfspec export HEADS --format openvino --out DIR --target T`` writes::

    DIR/target/   the target as OpenVINO IR (openvino_model.xml/.bin, tokenizer and detokenizer IRs, its config)
    DIR/draft/    the head as OpenVINO IR (optimum-intel's LlamaEagle3ForCausalLM, rt_info eagle3_mode)
    DIR/selfspec_openvino.json   the layer ids, the fp32 properties, the versions and how to run it

and OpenVINO GenAI runs it as
``LLMPipeline(DIR/target, "CPU", draft_model=draft_model(DIR/draft, "CPU", **P), **P)`` with ``P`` =
:data:`FP32_PROPERTIES` and a ``GenerationConfig`` with ``num_assistant_tokens`` (greedy, one sequence).

How (optimum-intel 2.2.0, openvino-genai 2026.4.1.0, in the ``openvino`` venv of :mod:`selfspec.engine_envs`):

* The head is written in the SGLang ``LlamaForCausalLMEagle3`` layout
  (:func:`selfspec.export.sglang.export_sglang_eagle3`), which optimum-intel's exporter maps to its own
  ``LlamaEagle3ForCausalLM`` (``_CUSTOM_DRAFT_MODEL_MAP`` in ``optimum/exporters/openvino/__main__.py``; the class in
  ``model_patcher.py``: ``fc`` over three target states,
  ``midlayer`` with ``input_layernorm`` on the embedding and ``hidden_norm`` on the state, ``norm``, ``lm_head`` over
  ``draft_vocab_size``, ``d2t``). It loads that class through ``auto_map``, hence ``--trust-remote-code``. The draft's
  ``embed_tokens`` is not in the file (the exporter reports it missing and initialises it): OpenVINO GenAI replaces
  it with the target's embedding when it builds the pipeline ("Copying embedding weights from main to draft model").
* **Target layers.** OpenVINO GenAI reads the draft's target layers as ``hidden_layers_list`` (exactly three ids)
  from the ``draft_model`` properties as a ``std::vector<int32_t>``, which its Python binding cannot pass (a list of
  ints arrives as ``int64`` and is refused: "hidden_layers_list must be a vector of int32_t values"), else from the
  draft IR's ``rt_info``, else it picks ``[2, L // 2, L - 3]`` from the target's layer count. It takes the *output*
  of each layer id; selfspec's ``target_layers`` name layer *inputs* (``hidden_states[i]``). So the export writes
  ``rt_info hidden_layers_list = i - 1`` for each (:func:`openvino_layer_ids`; SmolLM2's ``[2, 15, 27]`` ->
  ``"1 14 26"``); without it OpenVINO would fuse the states one layer later than training did. Proven in
  ``tests/export/test_openvino.py``: OpenVINO's accepted-token pattern at one draft token equals the one selfspec's
  head gives fed the inputs of its own layers, and differs from the one it gives fed the layers OpenVINO would read
  otherwise.
* **fp32.** The exporter writes ``runtime_options KV_CACHE_PRECISION f16`` and the CPU plugin infers in bf16 where
  the CPU has it; either changes plain greedy decoding by the second token. Both IRs get
  ``runtime_options`` :data:`FP32_PROPERTIES`, which OpenVINO applies as defaults; pass them explicitly too.
* Conversions are cached under ``<build cache>/openvino-ir/`` by content: the target by its files' bytes, the head
  by its SGLang export's bytes and the layer ids, both with the converter's version. An export directory's files
  are hard links to the cache where the file system allows (else copies).

Refused at export time (:func:`check_openvino_head`): heads of other families (OpenVINO GenAI's EAGLE-3 pipeline
drafts with EAGLE-3 heads only), EAGLE-3.1 heads (optimum-intel's ``LlamaEagle3Model`` applies ``fc`` to the raw fused
states and feeds the pre-norm state back), a decoder layer other than Llama's, target layers that are not three
distinct layer inputs ``>= 1`` (input 0 is the embedding output, which no layer id names), and a target that is not
a local Hugging Face directory of as many layers as the head's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from selfspec.base.files import build_cache_root, replace_dir, staging_dir, write_json
from selfspec.engine_envs import env_python, env_works
from selfspec.export.common import ExportError, Head, family_name, refuse_eagle31, require_llama
from selfspec.export.sglang import export_sglang_eagle3
from selfspec.heads.eagle3 import Eagle3Head

__all__ = [
    "FP32_PROPERTIES",
    "RECORD_NAME",
    "OpenVINOModels",
    "check_openvino_head",
    "converter_args",
    "export_openvino",
    "openvino_layer_ids",
    "openvino_python",
    "prepare_openvino",
    "rt_info_entries",
]

ENV = "openvino"
CONVERT_VERSION = 1
"""Bumped when the conversion changes, so cached conversions are made again."""
FP32_PROPERTIES = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
"""OpenVINO compile properties under which its greedy output equals plain fp32 decoding."""
RECORD_NAME = "selfspec_openvino.json"
IR_SCRIPT = Path(__file__).with_name("openvino_ir.py")
"""Run as ``python -P`` (its folder kept off ``sys.path``: ``import openvino`` must not find this module)."""
EXPORT_ENTRIES = frozenset({"target", "draft", RECORD_NAME})


@dataclasses.dataclass(frozen=True)
class OpenVINOModels:
    """A converted target and head, ready for ``openvino_genai.LLMPipeline``.

    Attributes:
        target: the target's IR directory (tokenizer and detokenizer IRs included).
        draft: the head's IR directory.
        layer_ids: OpenVINO's ``hidden_layers_list`` written into the draft IR (layer outputs).
        target_layers: the head's ``target_layers`` (layer inputs), from which they come.
        properties: the compile properties both models are loaded with (:data:`FP32_PROPERTIES`).
    """

    target: Path
    draft: Path
    layer_ids: list[int]
    target_layers: list[int]
    properties: dict[str, str]


def openvino_layer_ids(target_layers: tuple[int, ...] | list[int], num_layers: int) -> list[int]:
    """OpenVINO GenAI's ``hidden_layers_list`` for selfspec ``target_layers`` (layer inputs): ``i - 1`` each, the
    layer whose output is that input (module docstring).

    Raises:
        ExportError: not exactly three distinct layers, a layer input 0 (the embedding output, which no layer id
            names) or one past ``num_layers - 1``.
    """
    layers = list(target_layers)
    if len(layers) != 3 or len(set(layers)) != 3:
        raise ExportError(
            f"OpenVINO GenAI's EAGLE-3 pipeline fuses exactly three distinct target layers (hidden_layers_list); "
            f"this head has target_layers {layers}: train it with three distinct layers"
        )
    if min(layers) < 1 or max(layers) > num_layers - 1:
        raise ExportError(
            f"target_layers {layers} name layer inputs outside 1..{num_layers - 1}; OpenVINO GenAI reads layer "
            "outputs (hidden_layers_list), and input 0 (the embeddings) is no layer's output: train the head with "
            "target_layers >= 1"
        )
    return [i - 1 for i in layers]


def rt_info_entries(layer_ids: list[int] | None) -> dict[str, Any]:
    """The ``rt_info`` entries an IR gets (:mod:`selfspec.export.openvino_ir`): the fp32 ``runtime_options`` and,
    for a draft, ``hidden_layers_list`` as OpenVINO reads it (ids separated by spaces)."""
    entries: dict[str, Any] = {"runtime_options": dict(FP32_PROPERTIES)}
    if layer_ids is not None:
        entries["hidden_layers_list"] = " ".join(str(i) for i in layer_ids)
    return entries


def check_openvino_head(head: Head) -> None:
    """Refuse a head OpenVINO GenAI would not run, or would run as another function (module docstring).

    Raises:
        ExportError: naming what OpenVINO does and what to do.
    """
    if not isinstance(head, Eagle3Head):
        raise ExportError(
            f"the openvino format holds EAGLE-3 heads (OpenVINO GenAI's EAGLE-3 pipeline), not {family_name(head)}"
        )
    refuse_eagle31(
        head,
        "OpenVINO",
        "optimum-intel's LlamaEagle3Model (optimum/exporters/openvino/model_patcher.py) applies fc to the raw fused "
        "states and feeds the pre-norm state to the next draft step",
    )
    require_llama(head, "openvino")
    openvino_layer_ids(head.config.target_layers, head.config.num_target_layers)


def openvino_python() -> Path:
    """The ``openvino`` venv's interpreter.

    Raises:
        RuntimeError: the venv is not built or fails its probe (the message names the command that builds it).
    """
    if not env_works(ENV):
        raise RuntimeError(
            "OpenVINO GenAI and optimum-intel run in their own environment, which is not built here: run "
            f"`python -m selfspec.engine_envs {ENV}` once (about a minute)"
        )
    return env_python(ENV)


def converter_args(python: Path, model_dir: Path, out_dir: Path, *, draft: bool) -> list[str]:
    """optimum-intel's export command for ``model_dir`` (fp32 weights, ``text-generation-with-past``); a draft also
    needs ``--trust-remote-code`` (the exporter loads its EAGLE-3 class through ``auto_map``)."""
    args = [str(python), "-m", "optimum.commands.optimum_cli", "export", "openvino", "--model", str(model_dir)]
    args += ["--task", "text-generation-with-past", "--weight-format", "fp32"]
    return args + (["--trust-remote-code"] if draft else []) + [str(out_dir)]


def _run(cmd: list[str], what: str, work: Path) -> str:
    """Run a command of the venv offline (its modules cache under ``work``); its stdout.

    Raises:
        RuntimeError: it failed (with the end of its output).
    """
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", str(work))}
    env.update({"HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(work / "modules"), "TOKENIZERS_PARALLELISM": "false"})
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed (`{' '.join(cmd)}`):\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout


def _digest(paths: list[Path], extra: Any) -> str:
    digest = hashlib.sha256(json.dumps([CONVERT_VERSION, extra], sort_keys=True).encode())
    for path in sorted(paths):
        digest.update(path.name.encode())
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()[:20]


def _convert(python: Path, model_dir: Path, kind: str, key: str, layer_ids: list[int] | None) -> Path:
    """``model_dir`` converted by optimum-intel with the rt_info entries written and read back, cached at
    ``<build cache>/openvino-ir/<kind>-<key>``.

    Raises:
        RuntimeError: the converter failed. ExportError: the IR read back does not hold what OpenVINO must read.
    """
    out = build_cache_root() / "openvino-ir" / f"{kind}-{key}"
    if (out / "openvino_model.xml").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"selfspec-openvino-{kind}-") as tmp:
        work = Path(tmp)
        _run(
            converter_args(python, model_dir, work / "raw", draft=kind == "draft"),
            f"optimum-intel's {kind} export",
            work,
        )
        staged = staging_dir(out)
        entries = rt_info_entries(layer_ids)
        read = json.loads(
            _run(
                [str(python), "-P", str(IR_SCRIPT), str(work / "raw"), str(staged), json.dumps(entries)],
                "rt_info",
                work,
            )
        )
        if read["rt_info"] != entries or (kind == "draft" and read["eagle3_mode"] != "True"):
            shutil.rmtree(staged, ignore_errors=True)
            raise ExportError(f"the {kind} IR does not read back as written ({read}, wrote {entries}); not cached")
        replace_dir(staged, out)
    return out


def prepare_openvino(head: Head, target_dir: str | Path) -> OpenVINOModels:
    """Convert the target and ``head`` (or take them from the cache): what the bench loads.

    Args:
        head: an EAGLE-3 head attached to the target (:func:`selfspec.heads.load_heads` with the target).
        target_dir: the target's local Hugging Face directory (an alias resolved).

    Raises:
        ExportError: a head OpenVINO would not run or would misread (:func:`check_openvino_head`), a target that is
            not a local directory or has another layer count.
        RuntimeError: the ``openvino`` venv is missing (:func:`openvino_python`), or a conversion failed.
    """
    check_openvino_head(head)
    target = Path(target_dir)
    if not (target / "config.json").is_file():
        raise ExportError(f"the openvino export converts the target from a local directory; {target} is none")
    layers = json.loads((target / "config.json").read_text()).get("num_hidden_layers")
    if layers != head.config.num_target_layers:
        raise ExportError(f"{target} has {layers} layers, the head was trained on {head.config.num_target_layers}")
    layer_ids = openvino_layer_ids(head.config.target_layers, layers)
    python = openvino_python()
    files = [p for p in target.iterdir() if p.is_file()]
    target_ir = _convert(python, target, "target", _digest(files, "target"), None)
    with tempfile.TemporaryDirectory(prefix="selfspec-openvino-head-") as tmp:
        sglang = export_sglang_eagle3(head, Path(tmp) / "sglang", target_name_or_path=str(target))
        key = _digest([sglang / "config.json", sglang / "model.safetensors"], layer_ids)
        draft_ir = _convert(python, sglang, "draft", key, layer_ids)
    return OpenVINOModels(target_ir, draft_ir, layer_ids, list(head.config.target_layers), dict(FP32_PROPERTIES))


def _link_tree(src: Path, dst: Path) -> None:
    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, dst, copy_function=link)


def export_openvino(head: Head, out_dir: str | Path, *, target_name_or_path: str) -> Path:
    """Write ``head`` and its target for OpenVINO GenAI into ``out_dir`` (the layout of the module docstring), as a
    whole (staged beside it, then renamed).

    Args:
        head: an EAGLE-3 head.
        out_dir: the directory to write (a previous export there is replaced whole).
        target_name_or_path: the target's local Hugging Face directory (``selfspec export`` resolves an alias).

    Returns:
        ``out_dir`` as a resolved Path.

    Raises:
        ExportError: what :func:`prepare_openvino` refuses; ``out_dir`` holds other files.
        RuntimeError: the ``openvino`` venv is missing or a conversion failed.
    """
    out = Path(out_dir).resolve()
    if out.exists() and (not out.is_dir() or any(p.name not in EXPORT_ENTRIES for p in out.iterdir())):
        raise ExportError(f"{out} holds files an openvino export does not write; pass a new or empty directory")
    models = prepare_openvino(head, target_name_or_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = staging_dir(out)
    try:
        _link_tree(models.target, staged / "target")
        _link_tree(models.draft, staged / "draft")
        record = {
            "format": "openvino",
            "target_model": str(target_name_or_path),
            "selfspec_target_fingerprint": head.config.target_fingerprint,
            "target_layers": models.target_layers,
            "hidden_layers_list": models.layer_ids,
            "properties": models.properties,
            "converter": "optimum-intel 2.2.0 (optimum-cli export openvino --weight-format fp32)",
            "run": "LLMPipeline(OUT/target, 'CPU', draft_model=draft_model(OUT/draft, 'CPU', **properties), "
            "**properties); GenerationConfig(num_assistant_tokens=K, do_sample=False)",
        }
        write_json(staged / RECORD_NAME, record)
        return replace_dir(staged, out)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
