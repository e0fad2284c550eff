"""Run by the ``openvino`` venv's own Python, never imported by selfspec: write runtime-info entries into an OpenVINO
IR and read them back.

``python openvino_ir.py SRC_DIR DST_DIR RT_INFO_JSON`` reads ``SRC_DIR/openvino_model.xml`` (as optimum-intel's
exporter wrote it), sets every entry of ``RT_INFO_JSON`` (``{"name": "value"}`` or ``{"section": {"name": "value"}}``,
values strings) in the model's ``rt_info``, saves the model to ``DST_DIR/openvino_model.xml`` (weights as they are:
no fp16 compression), copies every other file of ``SRC_DIR`` beside it, then reads ``DST_DIR`` back and prints one
JSON line: ``{"rt_info": {...the entries as read back...}, "eagle3_mode": str | null}``.

Why runtime info: OpenVINO GenAI's EAGLE-3 pipeline takes the draft's target layers from its ``draft_model``
properties as a ``std::vector<int32_t>`` named ``hidden_layers_list``, which its Python binding cannot make (a list
of ints becomes ``std::vector<int64_t>`` and is refused), else from a ``hidden_layers_list`` entry of the draft IR's
``rt_info``, else from the target's layer count. ``runtime_options`` entries are the compile properties OpenVINO
applies to a model by default (the exporter writes ``KV_CACHE_PRECISION f16`` there).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import openvino as ov

MODEL = "openvino_model.xml"


def main(src: Path, dst: Path, entries: dict) -> dict:
    """Write ``entries`` into the IR of ``src`` saved at ``dst`` and return them as read back from ``dst``."""
    core = ov.Core()
    model = core.read_model(str(src / MODEL))
    for name, value in entries.items():
        if isinstance(value, dict):
            for key, inner in value.items():
                model.set_rt_info(str(inner), [name, key])
        else:
            model.set_rt_info(str(value), [name])
    dst.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, str(dst / MODEL), compress_to_fp16=False)
    for path in src.iterdir():
        if path.is_file() and not path.name.startswith("openvino_model."):
            shutil.copy2(path, dst / path.name)
    back = core.read_model(str(dst / MODEL))
    read: dict = {}
    for name, value in entries.items():
        if isinstance(value, dict):
            read[name] = {key: back.get_rt_info([name, key]).astype(str) for key in value}
        else:
            read[name] = back.get_rt_info([name]).astype(str)
    mode = back.get_rt_info(["eagle3_mode"]).astype(str) if back.has_rt_info(["eagle3_mode"]) else None
    return {"rt_info": read, "eagle3_mode": mode}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3]))))
