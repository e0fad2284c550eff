"""selfspec's own engine record: every method in this process, on the target ``transformers`` loaded, timed as a
whole call (:func:`selfspec.bench.run.run_bench`), against plain ``generate`` and selfspec's decoding without drafts.
"""

from __future__ import annotations

from collections.abc import Mapping

from selfspec.bench.methods import DEFAULT_METHODS, build_methods
from selfspec.bench.report import BenchReport
from selfspec.bench.run import run_bench
from selfspec.engines.registry import DEFAULT_ENGINE, Engine, EngineOutput, EngineRun, register_engine

__all__ = ["ENGINE", "bench", "chains"]


def bench(run: EngineRun) -> EngineOutput:
    """``selfspec bench`` (the default engine): the built-in methods of ``--methods`` (default
    :data:`~selfspec.bench.methods.DEFAULT_METHODS`, plus ``draft_model`` with ``--draft-model``) and one method per
    head, in this process.

    Raises:
        ValueError: a method that cannot be built (the message says why), or no prompt turn fits.
    """
    from selfspec.target import load_target

    o = run.options
    draft_name = o.get("draft_model")
    methods = o.get("methods") or list(DEFAULT_METHODS) + (["draft_model"] if draft_name else [])
    draft = None
    if draft_name:
        draft = load_target(draft_name, dtype=o.get("dtype", "float32"), device=o.get("device", "cpu"))[0]
    eagle = {"depth": o.get("eagle_depth"), "top_k": o.get("eagle_top_k"), "total_tokens": o.get("eagle_total_tokens")}
    built = build_methods(
        run.target,
        run.tokenizer,
        run.settings,
        methods=methods,
        heads=run.heads,
        draft_model=draft,
        tree_nodes=o.get("tree_nodes"),
        eagle_options=eagle,
        suffix_index=o.get("suffix_index"),
    )
    return EngineOutput(run_bench(run.target, run.tokenizer, built, run.prompts, run.settings))


def chains(run: EngineRun, lengths: Mapping[str, int]) -> BenchReport:
    """Each head method a chain of its k drafts: the EAGLE drafter with ``top_k=1``, ``depth=k``,
    ``total_tokens=k`` (given, so nothing tunes it), beside plain ``generate`` and no drafts.

    Raises:
        ValueError: selfspec sized the drafter other than a chain of k (its tree-budget record says how).
    """
    methods: dict = {}
    for name, k in lengths.items():
        chain = {"depth": k, "top_k": 1, "total_tokens": k}
        built = build_methods(
            run.target, run.tokenizer, run.settings, methods=(), heads={name: run.heads[name]}, eagle_options=chain
        )
        budget = built[name].tree_budget
        if budget is None or (budget.depth, budget.top_k, budget.total_tokens) != (k, 1, k):
            raise ValueError(f"selfspec did not draft a chain of {k} with this head (its tree budget: {budget})")
        methods.update({m: b for m, b in built.items() if m not in methods})  # the plain methods once
    return run_bench(run.target, run.tokenizer, methods, run.prompts, run.settings)


ENGINE = register_engine(
    Engine(
        DEFAULT_ENGINE, "selfspec", bench, chains, takes_methods=True,
        help="selfspec (default): its own decoder against transformers generate and its no-draft decoding",
    )
)  # fmt: skip
