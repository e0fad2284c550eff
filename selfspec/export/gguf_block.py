"""DFlash and DSpark heads as llama.cpp drafts: the ``dflash`` GGUF, made by llama.cpp's own converter.

The head's own directory (:meth:`selfspec.heads.dflash.BlockHead.save_pretrained`) is already the published DFlash
checkpoint layout the converter reads (``conversion/qwen.py``: ``fc``, ``hidden_norm``, ``layers.N.*`` with q/k norms,
``norm``, ``dflash_config`` with ``block_size``, ``mask_token_id`` and ``target_layer_ids``; the target's tokenizer,
embedding and lm_head are used). It is copied into a temporary directory and converted::

    python convert_hf_to_gguf.py HEAD_DIR --target-model-dir TARGET_DIR --outtype f16 --outfile OUT.gguf

One adaptation, read from the converter: its ``DFlashDraftModel`` class has no reduced draft vocabulary (it maps
no ``d2t``), while its ``DSparkDraftModel`` class writes ``d2t`` as absolute target ids, drops ``t2d`` and keeps the
head's own ``lm_head``; both write llama.cpp's one ``dflash`` architecture, and the runtime picks ``draft-dspark``
only when a Markov head is present. So a DFlash head with a reduced vocabulary is converted under the
``DSparkDraftModel`` name. The written file is read back with the ``gguf`` package and checked (architecture,
tensors, block size, layers, ``d2t``) before it is renamed into place.

Run it: ``llama-speculative-simple -m TARGET.gguf -md OUT.gguf --spec-type draft-dflash`` (``draft-dspark`` for a
DSpark head; ``--spec-draft-p-min`` then cuts the block at the confidence head).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader

from selfspec.export.common import ExportError, family_name, gguf_field
from selfspec.export.gguf import gguf_destination
from selfspec.heads.dflash import BlockHead
from selfspec.llamacpp import LlamaCpp

__all__ = ["block_gguf_tensors", "check_block_gguf", "convert_block_head", "export_gguf_block", "spec_type"]

_LAYER = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_norm",
          "ffn_gate", "ffn_up", "ffn_down")  # fmt: skip


def spec_type(head: BlockHead) -> str:
    """llama.cpp's ``--spec-type`` of the head: ``draft-dspark`` with a Markov head, else ``draft-dflash``."""
    return "draft-dspark" if head.config.markov_rank else "draft-dflash"


def block_gguf_tensors(head: BlockHead) -> frozenset[str]:
    """The tensors of the head's ``dflash`` GGUF (``load_arch_tensors`` of llama.cpp's ``src/models/dflash.cpp``; no
    ``token_embd``, and ``output`` only with a reduced vocabulary: the target's are used)."""
    cfg = head.config
    names = {"fc.weight", "enc.output_norm.weight", "output_norm.weight"}
    names |= {f"blk.{i}.{n}.weight" for i in range(cfg.num_layers) for n in _LAYER}
    if cfg.n_draft < cfg.vocab_size:
        names |= {"output.weight", "d2t"}
    if cfg.markov_rank:
        names |= {"markov_w1.weight", "markov_w2.weight"}
    if cfg.confidence:
        names |= {"conf_proj.weight", "conf_proj.bias"}
    return frozenset(names)


def export_gguf_block(
    head: BlockHead, out_dir: str | Path, *, target_dir: str | Path, outtype: str = "f32", **destination: Any
) -> Path:
    """Export a DFlash / DSpark head as llama.cpp's ``dflash`` GGUF, ``<out_dir>/<name>.gguf`` (the ``gguf`` exporter of
    both families; the arguments are :func:`selfspec.export.gguf.export_gguf`'s: ``destination`` its ``name`` and
    ``llamacpp``, as :func:`selfspec.export.gguf.gguf_destination` takes them).

    Returns:
        Path of the written ``.gguf`` file.

    Raises:
        ExportError: not a block head, the target directory is not the head's target
            (:func:`selfspec.export.gguf.gguf_destination`), or what :func:`convert_block_head` raises.
        RuntimeError: the converter failed, or llama.cpp cannot be built.
    """
    if not isinstance(head, BlockHead):
        raise ExportError(f"the dflash GGUF holds DFlash and DSpark heads, not {family_name(head)}")
    target_dir, final, llamacpp = gguf_destination(head, out_dir, target_dir, **destination)
    return convert_block_head(head, final, target_dir, outtype, llamacpp)


def convert_block_head(head: BlockHead, final: Path, target_dir: Path, outtype: str, llamacpp: LlamaCpp) -> Path:
    """Convert ``head`` with llama.cpp's converter into ``final`` (checked by :func:`check_block_gguf` first).

    Raises:
        ExportError: the target's embedding is scaled (llama.cpp's DFlash graph takes the raw rows unless told the
            scale; selfspec writes none), or the converted file fails :func:`check_block_gguf`.
        RuntimeError: the converter failed.
    """
    embed = head.target_modules()[0] if head.has_target else None
    if embed is not None and type(embed).__name__ != "Embedding":
        raise ExportError(
            f"the target's token embedding is a {type(embed).__name__} (scaled): llama.cpp's DFlash draft would read "
            "unscaled rows; the gguf export takes heads of targets with a plain nn.Embedding"
        )
    with tempfile.TemporaryDirectory(prefix=f".{final.stem}.tmp", dir=final.parent) as tmp:
        hf_dir = Path(tmp) / final.stem
        head.save_pretrained(hf_dir)
        path = hf_dir / "config.json"
        config = json.loads(path.read_text())
        if head.config.head_type == "dflash" and head.config.n_draft < head.config.vocab_size:
            config["architectures"] = ["DSparkDraftModel"]  # the converter class that maps d2t (module docstring)
        path.write_text(json.dumps(config, indent=1))
        written = Path(tmp) / final.name
        llamacpp.convert(hf_dir, written, "--target-model-dir", str(target_dir), "--outtype", outtype)
        check_block_gguf(written, head)
        os.replace(written, final)
        shutil.rmtree(hf_dir, ignore_errors=True)
    return final


def check_block_gguf(path: str | Path, head: BlockHead) -> None:
    """Read a converted file back with the ``gguf`` package and refuse anything but the head: architecture
    ``dflash``, exactly :func:`block_gguf_tensors`, ``dflash.block_size`` B, ``dflash.target_layers`` (llama.cpp's
    extract layers: the layer *inputs*, ``target_layer_ids + 1``) and ``d2t`` (absolute target ids) equal to the
    head's.

    Raises:
        ExportError: naming what differs.
    """
    reader = GGUFReader(str(path))

    def field(key: str) -> list:
        return gguf_field(reader, path, key, "a DFlash draft")

    if field("general.architecture")[0] != "dflash":
        raise ExportError(f"{path}: architecture {field('general.architecture')[0]!r}, expected 'dflash'")
    names, want = {t.name for t in reader.tensors}, block_gguf_tensors(head)
    if names != want:
        raise ExportError(
            f"{path}: tensors differ from the dflash layout: missing {sorted(want - names)}, "
            f"unexpected {sorted(names - want)}"
        )
    if int(field("dflash.block_size")[0]) != head.config.block_size:
        raise ExportError(f"{path}: block_size {field('dflash.block_size')[0]}, the head's is {head.config.block_size}")
    layers = [int(i) for i in field("dflash.target_layers")]
    if layers != list(head.target_layers):
        raise ExportError(f"{path}: target_layers {layers}, the head takes the inputs of {list(head.target_layers)}")
    if "d2t" in want:
        (d2t,) = [t for t in reader.tensors if t.name == "d2t"]
        ids = np.asarray(d2t.data).reshape(-1)
        if ids.dtype != np.int64 or not np.array_equal(ids, head.draft_ids.cpu().numpy()):
            raise ExportError(f"{path}: d2t does not map the draft vocabulary to the head's target ids")
