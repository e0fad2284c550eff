"""EAGLE-3 heads as llama.cpp drafts: the ``eagle3`` GGUF, made by llama.cpp's own converter (DFlash and DSpark
heads: the ``dflash`` GGUF of :mod:`selfspec.export.gguf_block`; each family's record names its own exporter).

The head is first written in the SpecForge / SGLang ``LlamaForCausalLMEagle3`` layout
(:func:`selfspec.export.sglang.export_sglang_eagle3`: ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``)
into a temporary directory, then converted by the ``convert_hf_to_gguf.py`` of the cached llama.cpp build
(:mod:`selfspec.llamacpp`)::

    python convert_hf_to_gguf.py HF_DIR --target-model-dir TARGET_DIR --outtype f32 --outfile OUT.gguf

The converter (``conversion/llama.py`` of llama.cpp) detects the draft by ``draft_vocab_size`` with one hidden
layer, renames ``midlayer.*`` to ``blk.0.*`` (``hidden_norm`` -> ``attn_norm_2``), writes ``d2t`` as absolute
target ids (int64), drops ``t2d``, takes ``extract_layers`` from ``eagle_aux_hidden_state_layer_ids`` and the
tokenizer from the target.

One adaptation of the SGLang layout: the converter takes ``extract_layers`` from a top-level
``eagle_aux_hidden_state_layer_ids`` (else its default ``[2, L // 2, L - 3]``) and llama.cpp reads them as layer
*inputs* (``llama_set_embeddings_layer_inp`` in ``common/speculative.cpp``), selfspec's ``target_layers``
convention; the SGLang layout writes ``eagle_config.eagle_aux_hidden_state_layer_ids`` as layer *outputs*
(``i - 1``, left out for the default set). So the temporary directory's config gets the top-level key with the
head's own ``target_layers`` before conversion (:func:`_pin_layers`); without it a head with non-default layers
would convert silently with the wrong ones. The written file is read back with the ``gguf`` package
and checked (architecture, every tensor, layers, ``d2t``) before it is renamed into place.

EAGLE-3.1 heads (``fc_norm`` / ``norm_output``, arXiv:2605.09992) are refused before anything runs
(:func:`check_llamacpp_eagle31`): llama.cpp's ``eagle3`` draft computes neither.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGUFReader

from selfspec.export.common import ExportError, Head, family_name, gguf_field, refuse_eagle31, require_llama
from selfspec.export.sglang import export_sglang_eagle3
from selfspec.heads.eagle3 import Eagle3Head
from selfspec.llamacpp import LlamaCpp, ensure_llamacpp
from selfspec.target import resolve_target

__all__ = ["GGUF_TENSORS", "check_gguf", "check_llamacpp_eagle31", "export_gguf", "gguf_destination"]

GGUF_TENSORS = frozenset(
    {
        "fc.weight",
        "d2t",
        "output.weight",
        "output_norm.weight",
        *(
            f"blk.0.{name}.weight"
            for name in (
                "attn_norm",
                "attn_norm_2",
                "attn_q",
                "attn_k",
                "attn_v",
                "attn_output",
                "ffn_norm",
                "ffn_gate",
                "ffn_up",
                "ffn_down",
            )
        ),
    }
)
"""The tensors of an ``eagle3`` GGUF of a Llama head (``load_arch_tensors`` of llama.cpp's ``src/models/eagle3.cpp``;
no ``token_embd``: the draft uses the target's)."""


def check_llamacpp_eagle31(head: Eagle3Head) -> None:
    """Refuse an EAGLE-3.1 head: llama.cpp would convert and run it with another function, silently.

    Read in the llama.cpp of ``llama-cpp-python==0.3.36`` (``vendor/llama.cpp``): the converter
    (``conversion/llama.py``, ``LlamaModel.__init__``'s EAGLE-3 branch) writes ``norm_before_residual`` and
    ``norm_before_fc`` from the draft's config and neither ``fc_norm`` nor ``norm_output``; the graph
    (``src/models/eagle3.cpp``) applies ``fc`` to the raw fused features (the encoder; an optional single norm over
    the whole concatenation, ``norm_before_fc``, not one per layer) and hands the pre-norm state ``eagle3_prenorm``
    to the next draft step (the decoder's ``t_h_nextn``), where ``norm_output`` feeds ``norm(o)``.

    Raises:
        ExportError: naming the flags and the formats that take the head.
    """
    refuse_eagle31(
        head,
        "llama.cpp",
        "llama.cpp's eagle3 draft (src/models/eagle3.cpp, converter conversion/llama.py) applies fc to the raw fused "
        "features and feeds the pre-norm state to the next draft step, reading neither flag",
    )


def _target_config(target_dir: Path) -> dict:
    try:
        return json.loads((target_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ExportError(f"{target_dir / 'config.json'}: {err}; pass the target's Hugging Face directory") from err


def gguf_destination(
    head: Head, out_dir: str | Path, target_dir: str | Path, name: str | None = None, llamacpp: LlamaCpp | None = None
) -> tuple[Path, Path, LlamaCpp]:
    """What every GGUF export checks and makes before converting: ``(target directory, the file to write, the
    build)``. The target must be a local directory of the head's target (hidden size, vocabulary, layer count); the
    file is ``<out_dir>/<name>.gguf``, by default ``<head's target>-<head_type>``; ``out_dir`` is created; the build
    is ``llamacpp`` or :func:`selfspec.llamacpp.ensure_llamacpp`'s.

    Raises:
        ExportError: the target is not a local directory, or not the head's target.
        RuntimeError: llama.cpp cannot be built.
    """
    target_dir = Path(resolve_target(target_dir))
    if not target_dir.is_dir():
        raise ExportError(f"target {target_dir} is not a local directory: pass the target's Hugging Face directory")
    cfg, own = _target_config(target_dir), head.config
    got = (cfg.get("hidden_size"), cfg.get("vocab_size"), cfg.get("num_hidden_layers"))
    want = (own.hidden_size, own.vocab_size, own.num_target_layers)
    if got != want:
        raise ExportError(
            f"{target_dir} has hidden size / vocabulary / layers {got}, the head was trained for {want}: "
            f"pass the directory of the head's target ({own.target or 'see its config.json'})"
        )
    llamacpp = llamacpp or ensure_llamacpp()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = name or f"{Path(own.target).name or 'head'}-{family_name(head)}"
    return target_dir, out_dir / f"{stem}.gguf", llamacpp


def export_gguf(
    head: Head,
    out_dir: str | Path,
    *,
    target_dir: str | Path,
    name: str | None = None,
    outtype: str = "f32",
    llamacpp: LlamaCpp | None = None,
) -> Path:
    """Export an EAGLE-3 head as llama.cpp's ``eagle3`` GGUF, ``<out_dir>/<name>.gguf``.

    Run it with the target's own GGUF: ``llama-speculative-simple -m TARGET.gguf -md OUT.gguf
    --spec-type draft-eagle3`` (or ``llama-server`` with the same flags).

    Args:
        head: a :class:`selfspec.heads.eagle3.Eagle3Head` of a Llama-architecture target (fp32 or bf16), or a
            DFlash / DSpark :class:`selfspec.heads.dflash.BlockHead` (Qwen3-style layers, any target whose token
            embedding is a plain ``nn.Embedding``).
        out_dir: directory receiving the file (created if missing; other files in it are left alone).
        target_dir: the target's Hugging Face directory or a selfspec alias (``smollm2-135m-instruct``:
            the converted copy in the selfspec cache); the converter takes the tokenizer and the target's
            layer count and hidden size from it.
        name: file stem; default ``<head's target>-eagle3``.
        outtype: the converter's ``--outtype`` for the weights (``f32``, ``f16``, ``bf16``, ``q8_0``).
        llamacpp: the build whose converter runs; default :func:`selfspec.llamacpp.ensure_llamacpp` (builds
            llama.cpp once per machine if there is no cached build).

    Returns:
        Path of the written ``.gguf`` file.

    Raises:
        ExportError: the head is not EAGLE-3 (llama.cpp loads EAGLE-3 drafts only), an EAGLE-3.1 head
            (:func:`check_llamacpp_eagle31`), its layer is not a plain Llama layer, the target directory is not the
            head's target (hidden size, vocabulary, layer count), or the converted file fails :func:`check_gguf`.
            Nothing is written then.
        RuntimeError: the converter failed (its output is in the message), or llama.cpp cannot be built.
    """
    if not isinstance(head, Eagle3Head):  # the family records send DFlash / DSpark heads to export_gguf_block
        raise ExportError(
            f"the gguf format holds EAGLE-3, DFlash and DSpark heads (llama.cpp's eagle3 and dflash draft "
            f"architectures; export_gguf writes EAGLE-3); this is a {family_name(head)} head. Train one of those, or "
            "export this one with --format sglang."
        )
    require_llama(head, "gguf")
    check_llamacpp_eagle31(head)
    target_dir, final, llamacpp = gguf_destination(head, out_dir, target_dir, name, llamacpp)
    stem = final.stem
    with tempfile.TemporaryDirectory(prefix=f".{stem}.tmp", dir=final.parent) as tmp:
        hf_dir = export_sglang_eagle3(head, Path(tmp) / stem, target_name_or_path=str(target_dir))
        _pin_layers(Path(hf_dir), head.config.target_layers)
        written = Path(tmp) / final.name
        llamacpp.convert(hf_dir, written, "--target-model-dir", str(target_dir), "--outtype", outtype)
        check_gguf(written, head)
        os.replace(written, final)
    return final


def _pin_layers(hf_dir: Path, layers: tuple[int, ...]) -> None:
    """Make the converter's ``extract_layers`` the head's ``target_layers`` (layer inputs, llama.cpp's reading).

    The converter reads only the top-level ``eagle_aux_hidden_state_layer_ids``; SGLang's ``eagle_config`` copy
    (layer outputs, ``i - 1``) is not read by it and stays as written.
    """
    path = hf_dir / "config.json"
    config = json.loads(path.read_text())
    if config.get("eagle_aux_hidden_state_layer_ids") != list(layers):
        config["eagle_aux_hidden_state_layer_ids"] = list(layers)
        path.write_text(json.dumps(config, indent=1))


def check_gguf(path: str | Path, head: Head) -> None:
    """Read a converted file back with the ``gguf`` package and refuse anything but the head, exactly:
    architecture ``eagle3``, the tensors :data:`GGUF_TENSORS` and no other, ``eagle3.target_layers``
    (llama.cpp's ``extract_layers``) equal to ``head.target_layers``, ``eagle3.target_hidden_size`` D, and
    ``d2t`` (int64 ``[S]``, absolute target ids) equal to ``head.draft_ids``.

    Raises:
        ExportError: naming what differs.
    """
    reader = GGUFReader(str(path))

    def field(key: str) -> list:
        return gguf_field(reader, path, key, "an EAGLE-3 draft")

    arch = field("general.architecture")[0]
    if arch != "eagle3":
        raise ExportError(f"{path}: architecture {arch!r}, expected 'eagle3'")
    names = {t.name for t in reader.tensors}
    if names != GGUF_TENSORS:
        raise ExportError(
            f"{path}: tensors differ from the eagle3 layout: missing {sorted(GGUF_TENSORS - names)}, "
            f"unexpected {sorted(names - GGUF_TENSORS)}"
        )
    layers = [int(i) for i in field("eagle3.target_layers")]
    if layers != list(head.target_layers):
        raise ExportError(f"{path}: target_layers {layers}, the head fuses layers {list(head.target_layers)}")
    hidden = int(field("eagle3.target_hidden_size")[0])
    if hidden != head.config.hidden_size:
        raise ExportError(f"{path}: target_hidden_size {hidden}, the head's target has {head.config.hidden_size}")
    (d2t,) = [t for t in reader.tensors if t.name == "d2t"]
    ids = np.asarray(d2t.data).reshape(-1)
    if ids.dtype != np.int64 or not np.array_equal(ids, head.draft_ids.cpu().numpy()):
        raise ExportError(f"{path}: d2t does not map the draft vocabulary to the head's target ids")
