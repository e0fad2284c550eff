"""The engines that decode selfspec's heads in the bench: the registry (:mod:`selfspec.engines.registry`), one folder
per engine (``selfspec/``, ``llamacpp/``, ``vllm/``, ``openvino/``, each with its record in ``engine.py``), and the
pieces two engines share: the worker process of an engine's venv (:mod:`selfspec.engines.worker`) and the calibration
prompts of the settings sweeps (:mod:`selfspec.engines.sweep`)."""
