"""Train draft heads on a frozen target: ``accelerate launch scripts/train.py CONFIG.yaml [key=value ...]``.

The launcher Medusa and EAGLE users look for. It runs the package's training command
(``selfspec train``, with its vLLM regeneration stage when the config names it), so the
arguments, the config checks and the outputs are the same; its usage line names that command. ``CONFIG`` is a YAML
run config (``configs/``); ``key=value`` overrides its fields (``lr=3e-4``, ``eagle3.ttt_steps=2``); an unknown key
or a value of the wrong type exits with status 2 and a message that lists the valid keys.

Examples::

    python scripts/train.py configs/eagle3-smollm2.yaml output_dir=runs/eagle3
    accelerate launch scripts/train.py configs/medusa-smollm2.yaml
    accelerate launch --config_file configs/accelerate-2cpu.yaml --multi_gpu \
        scripts/train.py configs/medusa-smollm2.yaml

Outputs (``<output_dir>``): ``heads/`` (the head files), ``train_summary.json``, ``checkpoint/`` (a killed run
resumes from it when started again with the same command). ``README.md`` ("Train") describes the configs.
"""

from __future__ import annotations

import sys

from selfspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
