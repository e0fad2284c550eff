"""Research harnesses: the measurements behind the docs' figures that no user of selfspec imports.

Run from the repository root as scripts (this folder is not installed: pyproject's package list names only
``selfspec`` and its subpackages):

* ``python -m benchmarks.trainers``: selfspec's EAGLE-3 trainer against SpecForge's and speculators' at equal trained
  tokens (``trainer_data.py``, ``trainer_runs.py``, ``trainer_patches.py``; docs/EXPORT.md);
* ``python -m benchmarks.gpu_curves`` and ``python -m benchmarks.gpu_cycle``: verification cost by tree size and the
  decode loop's own cost on a GPU (``random_targets.py``, ``rigged_drafter.py``, ``host_syncs.py``; docs/GPU.md);
* ``python -m benchmarks.history_compare``: selfspec's served history beside Arctic Inference's suffix decoding;
* ``python -m benchmarks.sets REPORT``: a bench report's speedup and tau per prompt set (docs/RESULTS.md).

They use only selfspec's public modules; their tests are ``tests/benchmarks/``.
"""
