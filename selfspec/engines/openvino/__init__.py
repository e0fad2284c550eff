"""OpenVINO GenAI as an engine of the bench: its record (:mod:`selfspec.engines.openvino.engine`), its bench
(:mod:`selfspec.engines.openvino.bench`), its draft-length sweep (:mod:`selfspec.engines.openvino.settings`) and the
worker that runs in its venv (``selfspec/engines/openvino/openvino_worker.py``). The IR export is
:mod:`selfspec.export.openvino`."""
