"""An engine defined entirely in the tests: the proof that an engine is its own files plus one registration.

``toy``: plain greedy decoding of the target (one forward per token, no cache) is its reference and its own
decoding without drafts; each head method drafts a chain of k tokens proposed by an oracle, the target's own greedy
continuation, so every draft is accepted and each verification step yields k + 1 tokens (fewer at the end). It runs on
the one bench driver, takes a flag of its own (``--toy-chain``), writes a record of its own beside the report
(``toy.json``) and takes part in the fidelity report.

Importing this module registers the engine (:func:`selfspec.engines.registry.register_engine`). Nothing outside this
file names it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from selfspec.bench.driver import BenchEngine, Outcome, Turn, run_engine, settings_record
from selfspec.bench.methods import BenchSettings
from selfspec.bench.report import BenchReport, MethodRecord, Result, SettingsRecord
from selfspec.engines.registry import Engine, EngineOption, EngineOutput, EngineRun, register_engine
from selfspec.prompts import Message, encode_messages

NAME = "toy"
PLAIN = "toy_plain"
RECORD_FILE = "toy.json"


def greedy(target: Any, prompt_ids: torch.Tensor, max_new_tokens: int, eos: set[int]) -> tuple[list[int], str]:
    """The target's greedy continuation of Long ``[T]`` ``prompt_ids``: ``(tokens, "stop" | "length")``."""
    ids, out = prompt_ids.unsqueeze(0), []
    with torch.inference_mode():
        while len(out) < max_new_tokens:
            token = int(target(input_ids=ids).logits[0, -1].argmax())
            out.append(token)
            if token in eos:
                return out, "stop"
            ids = torch.cat([ids, torch.tensor([[token]], device=ids.device)], dim=1)
    return out, "length"


def oracle_chain_stats(new_tokens: int, k: int) -> dict[str, Any]:
    """The statistics of ``new_tokens`` decoded by an oracle chain of ``k`` drafts: the first token from the prefill,
    then steps of k accepted drafts and the bonus token until the output is complete."""
    per_step, left = [], new_tokens - 1
    while left > 0:
        per_step.append(min(k + 1, left))
        left -= per_step[-1]
    accepted = [sum(1 for n in per_step if min(k, n) > d) for d in range(k)]
    return {
        "tau": sum(per_step) / len(per_step) if per_step else None,
        "steps": len(per_step),
        "accepted_per_step": per_step,
        "accepted_by_depth": accepted,
        "drafted_by_depth": [len(per_step)] * k,
    }


class ToyEngine(BenchEngine):
    """The toy engine's methods on the bench driver: :data:`PLAIN` and one oracle chain per head method."""

    def __init__(self, target: Any, tokenizer: Any, settings: BenchSettings, lengths: Mapping[str, int]):
        self.target, self.tokenizer, self.lengths = target, tokenizer, dict(lengths)
        self.names = [PLAIN, *self.lengths]
        self.reference = self.engine_reference = PLAIN
        self.device = next(target.parameters()).device
        self.eos = set(settings.stop_ids(target, tokenizer))

    def prompt(self, messages: Sequence[Message]) -> tuple[torch.Tensor, str | None]:
        return encode_messages(self.tokenizer, messages).to(self.device), None

    def run(self, name: str, turn: Turn, settings: BenchSettings) -> Outcome:
        start = time.perf_counter()
        tokens, finish = greedy(self.target, turn.ids, settings.max_new_tokens, self.eos)
        wall = time.perf_counter() - start
        k = self.lengths.get(name)
        measured = oracle_chain_stats(len(tokens), k) if k else {}
        return Outcome(Result.of_call(tokens, wall, finish, **measured))

    def method_records(self) -> dict[str, MethodRecord]:
        chains = {n: MethodRecord(NAME, f"an oracle chain of {k} drafts", None) for n, k in self.lengths.items()}
        return {PLAIN: MethodRecord(NAME, "plain greedy decoding, one forward per token", None), **chains}

    def settings_record(self, settings: BenchSettings) -> SettingsRecord:
        own = dataclasses.replace(settings, reference=PLAIN, engine_reference=PLAIN)
        return dataclasses.replace(
            settings_record(own, self.target, self.device, self.eos),
            engine=NAME,
            timing="wall time of the whole greedy loop",
        )


def chains(run: EngineRun, lengths: Mapping[str, int]) -> BenchReport:
    """Each head method an oracle chain of its k drafts."""
    engine = ToyEngine(run.target, run.tokenizer, run.settings, lengths)
    return run_engine(engine, run.target, run.tokenizer, run.prompts, run.settings)


def bench(run: EngineRun) -> EngineOutput:
    """Each ``--heads`` method an oracle chain of ``--toy-chain`` drafts; ``toy.json`` records the lengths."""
    if run.settings.do_sample:
        raise ValueError("the toy engine decodes greedily: pass --temperature 0")
    lengths = dict.fromkeys(run.heads, run.options.get("toy_chain", 2))
    return EngineOutput(chains(run, lengths), {RECORD_FILE: {"chain_lengths": lengths}})


ENGINE = register_engine(
    Engine(
        name=NAME,
        title="Toy engine",
        bench=bench,
        chains=chains,
        options=(EngineOption("--toy-chain", {"type": int, "default": 2, "help": "--engine toy: drafts per step"}),),
        help="toy: a test-only engine (plain greedy decoding and oracle chains)",
    )
)
