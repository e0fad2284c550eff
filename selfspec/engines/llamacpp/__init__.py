"""llama.cpp as an engine of the bench: its record (:mod:`selfspec.engines.llamacpp.engine`), its bench
(:mod:`selfspec.engines.llamacpp.bench`) and its settings sweep (:mod:`selfspec.engines.llamacpp.settings`). The build
and its tools are :mod:`selfspec.llamacpp`; the GGUF export :mod:`selfspec.export.gguf`."""
