"""Benchmark heads against plain ``transformers`` ``generate``: ``python scripts/bench.py --prompts FILE --heads DIR``.

The launcher Medusa and EAGLE users look for. It runs the package's bench command (:func:`selfspec.bench.main`,
also ``selfspec bench``), so the flags, the report and the exit status are the same; its usage line names that
command. Every method runs in one process, interleaved per prompt, and gets two speedups: against ``generate`` and
against selfspec's own decoding with no drafts. Bad arguments exit with status 2.

Examples::

    python scripts/bench.py --prompts ../shared/data/eval/mt_bench/question.jsonl \
        --heads runs/eagle3-smollm2/heads --max-new-tokens 128 --threads 2 --out runs/bench
    python scripts/bench.py --prompts sharegpt-heldout --heads runs/eagle3-smollm2/heads --methods baseline hybrid
    python scripts/bench.py --engine llamacpp --prompts questions.jsonl --heads runs/eagle3-smollm2/heads

Outputs (``--out``): ``report.json``, ``report.md`` and PNG plots; ``README.md`` ("Bench") describes them.
"""

from __future__ import annotations

import sys

from selfspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
