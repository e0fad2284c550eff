"""The decode loop's own cost: one speculation cycle in plain decoding steps, its parts, and its host syncs.

Why: a speculation cycle (draft + verify forward + acceptance + cache compaction) pays only if it costs
little more than one plain decoding step. On a GPU the target's forward over a tree of N nodes costs about
what one token costs (``scripts/gpu_cost_curves.py``: 1.15-1.31x at 128 nodes on an H200), so what the loop
does around that forward (host synchronisations, small kernels, Python) decides the cycle. The goal is a
cycle of at most 1.3 plain steps at the tree budget the chooser picks.

How: targets are built in place with random weights from real configs (no download):

* ``135m``: SmolLM2-135M (hidden 576, 30 layers, 9/3 heads, MLP 1536, vocab 49,152, tied embeddings)
* ``1b``:   Llama-3.2-1B's shape (2048, 16 layers, 32/8 heads, MLP 8192, vocab 128,256, tied)
* ``8b``:   Llama-3.1-8B's shape (4096, 32 layers, 32/8 heads, MLP 14,336, vocab 128,256)
* ``tiny``: 2 layers, hidden 64, vocab 512 (the CPU dry run)

For each target the plain greedy continuation of a random prompt is computed first (one-token forwards).
A rigged drafter then proposes a fixed tree (the EAGLE-2-like shape of ``TREE_ACCURACY`` at N nodes)
whose main path holds that continuation up to a depth k set per step with P(k >= d) = a^d, and wrong
tokens everywhere else, so a is the acceptance rate per depth. Each configuration (N, a) runs the real
loop, ``selfspec.decode.generate.speculative_generate``, unchanged:

* cycle ms: ``(total_s - prefill_s) / steps`` of a run of about ``--cycles`` steps (the loop reads the new
  tokens on the host every step, so its clock is synchronised), median over ``--rounds`` rounds. One
  plain step: ms per token of a greedy loop of ``--cycles`` one-token forwards (``Verifier.forward_tree``
  + ``lm_logits`` + argmax, the token fed back on the device, no host read until the end), run right
  before each configuration's run in every round; a cycle in plain steps is the median over rounds of
  the cycle over the plain step just before it. Configurations alternate their order round by round.
* the split: one more run with the loop's parts wrapped (``drafter.propose``, ``read_tree`` /
  ``cut_tree``, ``Verifier.forward_tree``, ``lm_logits`` + ``_finite``, ``target_distributions``,
  ``_verify``, ``kv.compact_cache``), the device synchronised around each; ``other`` is the rest of the
  cycle (the accepted tokens, the stopping rule, the context, the drafter's ``accept``).
* host syncs per step: on CUDA, ``torch.cuda.set_sync_debug_mode("warn")`` with every warning counted
  and attributed to the Python line that caused it; on a CPU (or ``--sync-count patch``), counters
  patched into ``torch.Tensor.item / tolist / cpu / numpy / __bool__ / __int__ / __float__ / __index__ /
  nonzero`` (host reads of tensor values: syncs on a GPU when the tensor lives there) and, counted apart,
  ``Tensor.to(device)`` and ``torch.tensor(..., device=)`` (host-to-device copies when the data is on the
  host; a pageable copy waits for the stream).
* exactness: the loop's greedy output against the plain greedy continuation (and that against
  ``model.generate``), recorded per configuration; in bf16 a tree forward may round differently from a
  one-token forward, so it is reported there, not asserted.

Usage. On a GPU machine that has only the working tree and an older transformers (an image with 5.17: its
``get_layer_types_and_kwargs`` returns no per-layer kwargs, which ``decode/masks.py`` reads), carry the
transformers release the project tests against as a wheel; prepare it once in the checkout::

    echo /.whl/ >> .git/info/exclude
    pip download --no-deps --only-binary=:all: transformers==5.24.0 -d .whl

then run one command there (carrying ``.whl``; about 4 minutes on an H200 for the three sizes)::

    set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        .whl/transformers-5.24.0-py3-none-any.whl && export PYTHONPATH=/tmp/site && PYTHONUNBUFFERED=1 \
        timeout 540 python3 scripts/gpu_cycle_cost.py --device cuda --out $OUT/cycle.json 2>&1 | tee $OUT/cycle.log

Where transformers >= 5.24 is installed, the script alone::

    python scripts/gpu_cycle_cost.py --device cuda --out $OUT/cycle.json
    python scripts/gpu_cycle_cost.py --dry-run --out runs/cycle_dry.json   # CPU, tiny target, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.machinery
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

import torch

REPO = Path(__file__).resolve().parents[1]


def _bootstrap_selfspec() -> None:
    """Make ``selfspec.decode`` / ``selfspec.heads`` importable from this checkout when selfspec is not
    installed (a GPU machine gets the working tree only): a bare ``selfspec`` package whose search path is
    ``selfspec/`` and the repository root, as pyproject's package-dir maps it. ``selfspec/__init__.py``
    is not run: it imports the whole API (datasets, gguf, ...), which the decode loop does not need."""
    if importlib.util.find_spec("selfspec") is not None:
        return
    module = importlib.util.module_from_spec(importlib.machinery.ModuleSpec("selfspec", None, is_package=True))
    module.__path__ = [str(REPO / "selfspec"), str(REPO)]
    sys.modules["selfspec"] = module


# The bootstrap must run before the package imports below (hence E402).
_bootstrap_selfspec()

from selfspec.decode import kv  # noqa: E402
from selfspec.decode.drafters import DraftTree  # noqa: E402
from selfspec.decode.generate import speculative_generate  # noqa: E402
from selfspec.decode.tree import greedy_tree_from_accuracy, static_tree, tree_depths  # noqa: E402
from selfspec.decode.verifier import Verifier  # noqa: E402

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# generate.py's module (its ``generate`` name may be re-exported as something else by the package)
LOOP = importlib.import_module("selfspec.decode.generate")

SIZES: dict[str, dict[str, Any]] = {  # the shapes of scripts/gpu_cost_curves.py, plus the dry run's
    "135m": dict(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
    "1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "8b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
    # a wide init gives well-separated logits: fp32 greedy paths without near-ties
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
        tie_word_embeddings=False,
        initializer_range=0.2,
    ),
}
# Cumulative top-1..top-8 accuracies of a 6-deep EAGLE-like drafter: only the *shape* of the trees built
# from them matters (Medusa's greedy construction, as EAGLE-2's global reranking keeps the N best paths).
TREE_ACCURACY = [[0.5, 0.7, 0.8, 0.86, 0.9, 0.92, 0.94, 0.95]] * 6
GOAL_CYCLE_STEPS = 1.3
MIN_TRANSFORMERS = (5, 24)  # pyproject's bound: the release the decode loop is tested against
PARTS = ("draft", "tree_prep", "forward", "logits", "process", "accept", "compact", "other")
_MOVES = ("to(device)", "tensor(device=)")
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero")


# --------------------------------------------------------------------------------------------------
# Target, trees and the rigged drafter


def build_target(size: str, dtype: torch.dtype, device: str) -> PreTrainedModel:
    """A randomly initialised ``LlamaForCausalLM`` of ``SIZES[size]``, made on ``device`` in ``dtype``
    (eval, frozen, SDPA attention, no EOS: every decode runs to its length)."""
    from transformers import LlamaConfig, LlamaForCausalLM  # heavy import, only when a target is built

    cfg = LlamaConfig(**SIZES[size], max_position_embeddings=4096, bos_token_id=1, eos_token_id=None)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.eval().requires_grad_(False)


def tree_parents(num_nodes: int, shape: str) -> torch.Tensor:
    """Parents ``[N]`` (CPU LongTensor) of the measured tree: ``"tree"`` the EAGLE-like shape of
    :data:`TREE_ACCURACY` at N nodes (root included), ``"chain"`` N nodes in a line."""
    if num_nodes == 1:
        return torch.tensor([-1])
    if shape == "chain":
        return torch.arange(-1, num_nodes - 1)
    return static_tree(greedy_tree_from_accuracy(TREE_ACCURACY, num_nodes)).parents


class Probe:
    """Marks where a run's steps begin (the drafter's first ``propose``): counters and timers ignore the
    prefill before it."""

    def __init__(self) -> None:
        self.in_steps = False


class RiggedDrafter:
    """A drafter of known acceptance: a fixed tree whose main path (each node's first child, from the root)
    holds the target's greedy continuation up to a depth k chosen per step with ``P(k >= d) = a^d``
    (``d <= D``, the main path's depth) and a wrong token after it; every other node is wrong too. Under
    greedy verification the step then accepts exactly k drafts, so ``a`` is the acceptance rate per depth
    and tau = ``1 + sum_{d=1..D} a^d``. Everything per step runs on the device: no host synchronisation.

    Args:
        reference: LongTensor ``[L]`` on the target's device, the target's greedy continuation of the
            prompt (``reference[0]`` is the first new token); ``L`` at least the new tokens plus ``D``.
        parents: LongTensor ``[N]`` (CPU), the tree.
        acceptance: a in [0, 1].
        vocab_size: V, for the wrong tokens (``(right + 1 + sibling rank) % V``).
        probe: told when the steps begin.

    Raises:
        ValueError: ``acceptance`` outside [0, 1].
    """

    name = "rigged"

    def __init__(
        self,
        reference: torch.Tensor,
        parents: torch.Tensor,
        acceptance: float,
        vocab_size: int,
        probe: Probe | None = None,
    ) -> None:
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must lie in [0, 1], got {acceptance}")
        parent_list = parents.tolist()
        n = len(parent_list)
        rank, children = [0] * n, [0] * n
        for i in range(1, n):
            rank[i] = children[parent_list[i]]
            children[parent_list[i]] += 1
        main = [0]
        while True:
            first = next((i for i in range(1, n) if parent_list[i] == main[-1]), None)
            if first is None:
                break
            main.append(first)
        self.main_depth = len(main) - 1
        correct = torch.zeros(self.main_depth + 1, n, dtype=torch.bool)
        for k in range(1, self.main_depth + 1):
            correct[k, main[1 : k + 1]] = True
        device = reference.device
        self._reference = reference
        self._parents = parents.to(device)
        self._depth = tree_depths(parents).to(device)
        self._offset = (torch.tensor(rank) + 1).to(device)
        self._correct = correct.to(device)
        self._vocab = vocab_size
        self.probe = probe
        self._acceptance = acceptance
        self.expected_tau = 1.0 + sum(acceptance**d for d in range(1, self.main_depth + 1))
        self._prompt_len = 0
        self._step = 0

    def accepted_depth(self, step: int) -> int:
        """k of step ``step`` (0-based): ``#{d in 1..D: u < a^d}`` for u of a golden-ratio sequence in (0, 1),
        so ``P(k >= d) = a^d`` and even a short run's mean k is close to its expectation."""
        u = (0.5 + step * 0.6180339887498949) % 1.0
        return sum(u < self._acceptance**d for d in range(1, self.main_depth + 1))

    def begin(self, prompt_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        self._prompt_len = prompt_ids.numel()
        self._step = 0

    def propose(self, context: torch.Tensor, sampling, generator) -> DraftTree:
        if self.probe is not None:
            self.probe.in_steps = True
        k = self.accepted_depth(self._step)
        self._step += 1
        m = context.numel() - self._prompt_len  # tokens decided after the prompt, the root included
        right = self._reference[m - 1 + self._depth]  # [N]: the greedy token at each node's position
        tokens = torch.where(self._correct[k], right, (right + self._offset) % self._vocab)
        return DraftTree(tokens=torch.cat([context[-1:], tokens[1:]]), parents=self._parents)

    def accept(self, accepted_tokens: torch.Tensor, accepted_hidden: torch.Tensor) -> None:
        pass


# --------------------------------------------------------------------------------------------------
# Measurements


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def plain_decode(
    verifier: Verifier, prompt: torch.Tensor, steps: int, probe: Probe | None = None
) -> tuple[float, list[int]]:
    """Plain greedy decoding by one-token forwards: ``(ms per step, the steps + 1 new tokens)``.

    ``Verifier.forward_tree`` over the one new token (the model builds the causal mask), ``lm_logits``,
    argmax; the token stays on the device, the host reads the tokens once at the end. Timed from after
    the prefill's first token to the last step, device synchronised at both ends. ``probe`` is told when
    the steps begin.
    """
    device = prompt.device
    cache = verifier.new_cache()
    hidden = verifier.prefill(prompt, cache)
    token = verifier.lm_logits(hidden[-1:]).argmax(-1)  # [1]
    root = torch.tensor([-1], device=device)
    out, past = [token], prompt.numel()
    _sync(device)
    if probe is not None:
        probe.in_steps = True
    t0 = time.perf_counter()
    for _ in range(steps):
        token = verifier.lm_logits(verifier.forward_tree(token, root, cache, past)).argmax(-1)
        out.append(token)
        past += 1
    if probe is not None:
        probe.in_steps = False
    _sync(device)
    ms = (time.perf_counter() - t0) * 1e3 / steps
    return ms, torch.cat(out).tolist()


@torch.inference_mode()
def generate_ms_per_token(model: PreTrainedModel, prompt: torch.Tensor, steps: int) -> tuple[float, list[int]]:
    """``model.generate`` (greedy): ms per token past the first (``(t(steps + 1) - t(1)) / steps``), and its
    tokens."""
    device = prompt.device
    ids = prompt[None]
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0)
    times, tokens = [], []
    for n in (1, steps + 1):
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        _sync(device)
        times.append(time.perf_counter() - t0)
        tokens = out[0, ids.shape[1] :].tolist()
    return (times[1] - times[0]) * 1e3 / steps, tokens


def run_loop(verifier: Verifier, drafter: RiggedDrafter, prompt: torch.Tensor, new_tokens: int):
    """One greedy ``speculative_generate`` run (no EOS): ``(ms per cycle, output)``."""
    _sync(prompt.device)
    out = speculative_generate(verifier, drafter, prompt, max_new_tokens=new_tokens)
    stats = out.stats
    return (stats.total_s - stats.prefill_s) * 1e3 / max(1, stats.steps), out


_WRAPPERS = ("call", "to", "tensor")  # this file's counting and timing wrappers: transparent in a site


def _where(frame) -> str:
    """``path:line`` of the innermost frame outside this file's wrappers, shortened (repository-relative, or
    from site-packages), plus ``" <- path:line"`` of the innermost repository frame when that one is a
    library's."""

    def own(f) -> bool:
        return f.f_code.co_filename == __file__ and f.f_code.co_name in _WRAPPERS

    def short(f) -> str:
        path = f.f_code.co_filename
        if path.startswith(str(REPO)):
            return f"{os.path.relpath(path, REPO)}:{f.f_lineno}"
        cut = path.rfind("site-packages/")
        return f"{path[cut + 14 :] if cut >= 0 else os.path.basename(path)}:{f.f_lineno}"

    while frame.f_back is not None and own(frame):
        frame = frame.f_back
    inner, f = short(frame), frame
    while f is not None and (own(f) or not f.f_code.co_filename.startswith(str(REPO))):
        f = f.f_back
    if f is None or f is frame:
        return inner
    return f"{inner} <- {short(f)}"


@contextlib.contextmanager
def count_cuda_syncs(probe: Probe, sites: Counter) -> Iterator[None]:
    """Count every synchronising CUDA operation during the steps (``torch.cuda.set_sync_debug_mode("warn")``),
    by the Python line that caused it, into ``sites``."""

    def hook(message, category, filename, lineno, file=None, line=None) -> None:
        if not probe.in_steps or "synchroniz" not in str(message):
            return
        f = sys._getframe(1)
        while f is not None and f.f_code.co_filename.endswith("warnings.py"):
            f = f.f_back
        sites[_where(f) if f is not None else f"{filename}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")


@contextlib.contextmanager
def count_host_reads(probe: Probe, sites: Counter) -> Iterator[None]:
    """Count, during the steps, every host read of tensor values (:data:`HOST_READS`) and every explicit
    move to a device (``Tensor.to(device)``, ``torch.tensor(..., device=)``), by calling line, into
    ``sites`` (keys end with the call's name). Patched on ``torch.Tensor`` and ``torch.tensor`` for the
    duration only."""
    saved: dict[str, tuple[bool, Any]] = {}

    def counted(name: str, orig: Callable) -> Callable:
        def call(self, *args, **kwargs):
            if probe.in_steps:
                sites[f"{_where(sys._getframe(1))} {name}"] += 1
            return orig(self, *args, **kwargs)

        return call

    def to(self, *args, **kwargs):
        if probe.in_steps and ("device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args[:1])):
            sites[f"{_where(sys._getframe(1))} to(device)"] += 1
        return saved["to"][1](self, *args, **kwargs)

    orig_tensor = torch.tensor

    def tensor(*args, **kwargs):
        if probe.in_steps and kwargs.get("device") is not None:
            sites[f"{_where(sys._getframe(1))} tensor(device=)"] += 1
        return orig_tensor(*args, **kwargs)

    try:
        for name in (*HOST_READS, "to"):
            saved[name] = (name in torch.Tensor.__dict__, getattr(torch.Tensor, name))
            setattr(torch.Tensor, name, to if name == "to" else counted(name, saved[name][1]))
        torch.tensor = tensor
        yield
    finally:
        torch.tensor = orig_tensor
        for name, (own, orig) in saved.items():
            if own:
                setattr(torch.Tensor, name, orig)
            else:
                delattr(torch.Tensor, name)


@contextlib.contextmanager
def timed_parts(verifier: Verifier, drafter: RiggedDrafter, probe: Probe, parts: dict[str, float]) -> Iterator[None]:
    """Accumulate wall seconds of the loop's parts during the steps into ``parts`` (device synchronised
    around each call): each named call of ``_decode`` is wrapped where the loop looks it up."""
    device = next(verifier.target.parameters()).device

    def timed(name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            if not probe.in_steps and name != "draft":
                return fn(*args, **kwargs)
            _sync(device)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _sync(device)
                parts[name] += time.perf_counter() - t0

        return call

    wrap = [
        (drafter, "propose", "draft"),
        (LOOP, "read_tree", "tree_prep"),
        (LOOP, "cut_tree", "tree_prep"),
        (verifier, "forward_tree", "forward"),
        (verifier, "lm_logits", "logits"),
        (LOOP, "_finite", "logits"),
        (LOOP, "target_distributions", "process"),
        (LOOP, "_verify", "accept"),
        (kv, "compact_cache", "compact"),
    ]
    with contextlib.ExitStack() as stack:
        for owner, attr, part in wrap:
            stack.enter_context(mock.patch.object(owner, attr, timed(part, getattr(owner, attr))))
        yield


def count_syncs(run: Callable[[Probe], int], method: str, probe: Probe | None = None) -> dict[str, Any]:
    """Run ``run(probe)`` (it returns the number of steps it ran) once with the host-read counters on, and
    for ``method == "debug"`` CUDA's sync debug mode too. Returns per step: ``syncs_per_step`` (the debug
    mode's count where it ran, else the host reads), ``host_reads_per_step``, ``device_moves_per_step``,
    and the sites ``{site: count per step}`` of ``sync_sites`` and ``host_read_sites``."""
    probe = probe or Probe()
    probe.in_steps = False
    reads, syncs = Counter(), Counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(count_host_reads(probe, reads))
        if method == "debug":
            stack.enter_context(count_cuda_syncs(probe, syncs))
        steps = max(1, run(probe))
    probe.in_steps = False
    if method != "debug":
        syncs = Counter({k: v for k, v in reads.items() if not k.endswith(_MOVES)})
    moves = sum(v for k, v in reads.items() if k.endswith(_MOVES))
    return {
        "syncs_per_step": sum(syncs.values()) / steps,
        "host_reads_per_step": (sum(reads.values()) - moves) / steps,
        "device_moves_per_step": moves / steps,
        "sync_sites": {k: v / steps for k, v in syncs.most_common()},
        "host_read_sites": {k: v / steps for k, v in reads.most_common()},
    }


def _first_diff(a: list[int], b: list[int]) -> int | None:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), None if len(a) == len(b) else n)


def measure_size(size: str, args: argparse.Namespace, dtype: torch.dtype) -> dict[str, Any]:
    """Every configuration of one target size (see the module docstring); the size's JSON record."""
    device = torch.device(args.device)
    t_size = time.perf_counter()
    model = build_target(size, dtype, args.device)
    verifier = Verifier(model)
    vocab = model.config.vocab_size
    prompt = torch.randint(3, vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1)).to(device)

    configs: list[dict[str, Any]] = []
    for shape in args.shapes:
        for n in args.nodes:
            for a in [None] if n == 1 else args.acceptance:
                if n == 1 and any(c["nodes"] == 1 for c in configs):
                    continue
                parents = tree_parents(n, shape)
                configs.append({"shape": "root" if n == 1 else shape, "nodes": n, "acceptance": a, "parents": parents})
    max_depth = max(int(tree_depths(c["parents"]).max()) for c in configs)
    longest = max(
        round(args.cycles * RiggedDrafter(prompt, c["parents"], c["acceptance"] or 0.0, vocab).expected_tau)
        for c in configs
    )
    _, reference = plain_decode(verifier, prompt, longest + max_depth + 1)
    ref_dev = torch.tensor(reference, device=device)
    gen_ms, gen_tokens = generate_ms_per_token(model, prompt, args.cycles)

    def plain_run(probe: Probe) -> int:
        plain_decode(verifier, prompt, args.cycles, probe)
        return args.cycles

    plain_counts = count_syncs(plain_run, args.sync_count)
    record: dict[str, Any] = {
        "params_b": sum(p.numel() for p in model.parameters()) / 1e9,
        "config": SIZES[size],
        "reference_equals_generate": gen_tokens == reference[: len(gen_tokens)],
        "reference_generate_first_diff": _first_diff(gen_tokens, reference[: len(gen_tokens)]),
        "plain_step_syncs": plain_counts,
    }

    # Per configuration: a drafter, the run length, one counted run and one split run (both untimed).
    for c in configs:
        probe = Probe()
        drafter = RiggedDrafter(ref_dev, c["parents"], c["acceptance"] or 0.0, vocab, probe=probe)
        c["drafter"], c["probe"] = drafter, probe
        c["new_tokens"] = max(2, round(args.cycles * drafter.expected_tau))
        runs = []

        def counted_run(_probe: Probe, drafter=drafter, n: int = c["new_tokens"], runs: list = runs) -> int:
            runs.append(run_loop(verifier, drafter, prompt, n)[1])
            return runs[-1].stats.steps

        c.update(count_syncs(counted_run, args.sync_count, probe))
        out = runs[0]
        c["steps"] = out.stats.steps
        c["measured_tau"] = out.stats.mean_accepted_tokens
        c["first_diff"] = _first_diff(out.tokens, reference[: len(out.tokens)])
        c["exact"] = c["first_diff"] is None

        parts = dict.fromkeys(PARTS, 0.0)
        probe.in_steps = False
        with timed_parts(verifier, drafter, probe, parts):
            instrumented_ms, out = run_loop(verifier, drafter, prompt, c["new_tokens"])
        per_step = {k: v * 1e3 / out.stats.steps for k, v in parts.items()}
        per_step["other"] = max(0.0, instrumented_ms - sum(per_step.values()))
        c["parts_ms"] = per_step
        c["instrumented_cycle_ms"] = instrumented_ms

    # Timed rounds: each configuration right after a plain run (a load change on a busy machine shifts both
    # alike); the order of the configurations alternates round by round.
    plain_ms: list[float] = []
    for r in range(args.rounds):
        for c in configs if r % 2 == 0 else reversed(configs):
            plain_ms.append(plain_decode(verifier, prompt, args.cycles)[0])
            ms, _ = run_loop(verifier, c["drafter"], prompt, c["new_tokens"])
            c.setdefault("cycle_ms_rounds", []).append(ms)
            c.setdefault("cycle_rel_rounds", []).append(ms / plain_ms[-1])
    plain = statistics.median(plain_ms)
    rows = []
    for c in configs:
        cycle = statistics.median(c["cycle_ms_rounds"])
        rel = statistics.median(c["cycle_rel_rounds"])
        rows.append(
            {
                "shape": c["shape"],
                "nodes": c["nodes"],
                "depth": int(tree_depths(c["parents"]).max()),
                "acceptance": c["acceptance"],
                "expected_tau": c["drafter"].expected_tau,
                "measured_tau": c["measured_tau"],
                "steps": c["steps"],
                "exact": c["exact"],
                "first_diff": c["first_diff"],
                "cycle_ms": cycle,
                "cycle_ms_rounds": c["cycle_ms_rounds"],
                "cycle_rel": rel,
                "cycle_rel_rounds": c["cycle_rel_rounds"],
                "speedup": c["measured_tau"] / rel,
                "meets_goal": rel <= args.goal,
                "parts_ms": c["parts_ms"],
                "parts_rel": {k: v / plain for k, v in c["parts_ms"].items()},
                "instrumented_cycle_ms": c["instrumented_cycle_ms"],
                "syncs_per_step": c["syncs_per_step"],
                "sync_sites": c["sync_sites"],
                "host_reads_per_step": c["host_reads_per_step"],
                "device_moves_per_step": c["device_moves_per_step"],
                "host_read_sites": c["host_read_sites"],
            }
        )
    chosen = {}
    for a in args.acceptance:
        pool = [row for row in rows if row["acceptance"] in (a, None)]
        best = max(pool, key=lambda row: row["speedup"])
        chosen[str(a)] = {k: best[k] for k in ("nodes", "shape", "cycle_rel", "speedup", "meets_goal")}
    record.update(
        plain_step_ms=plain,
        plain_step_ms_rounds=plain_ms,
        generate_step_ms=gen_ms,
        configs=rows,
        chosen=chosen,
        measure_s=time.perf_counter() - t_size,
    )
    return record


# --------------------------------------------------------------------------------------------------
# Report


def print_size(size: str, rec: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\n== {size}: {rec['params_b']:.3f}B params, {args.dtype} on {args.device}; plain step "
        f"{rec['plain_step_ms']:.2f} ms (model.generate {rec['generate_step_ms']:.2f} ms/token); "
        f"syncs by {'sync debug mode' if args.sync_count == 'debug' else 'patched host-read counters'} =="
    )
    head = f"{'nodes':>5} {'depth':>5} {'acc':>4} {'tau exp/got':>11} {'cycle ms':>9} {'x plain':>7} {'speedup':>7}"
    head += f" {'<=' + str(args.goal):>6} {'syncs':>5} {'moves':>5} " + " ".join(f"{p[:7]:>7}" for p in PARTS)
    print(head + "  exact")
    for r in rec["configs"]:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.1f}"
        print(
            f"{r['nodes']:>5} {r['depth']:>5} {acc:>4} {r['expected_tau']:>5.2f}/{r['measured_tau']:<5.2f} "
            f"{r['cycle_ms']:>9.2f} {r['cycle_rel']:>7.2f} {r['speedup']:>7.2f} "
            f"{'yes' if r['meets_goal'] else 'NO':>6} "
            f"{r['syncs_per_step']:>5.1f} {r['device_moves_per_step']:>5.1f} "
            + " ".join(f"{r['parts_ms'][p]:>7.2f}" for p in PARTS)
            + f"  {'yes' if r['exact'] else 'first diff at ' + str(r['first_diff'])}"
        )
    for a, best in rec["chosen"].items():
        print(
            f"best tree at acceptance {a}: {best['nodes']} nodes, cycle {best['cycle_rel']:.2f} plain steps, "
            f"speedup {best['speedup']:.2f}, goal {'met' if best['meets_goal'] else 'NOT met'}"
        )
    widest = max(rec["configs"], key=lambda r: r["nodes"])
    print(f"sync sites per step ({widest['nodes']} nodes, acceptance {widest['acceptance']}):")
    for site, n in widest["sync_sites"].items():
        print(f"  {n:5.2f}  {site}")
    print("moves to the device per step (host-to-device copies where the data is on the host):")
    for site, n in widest["host_read_sites"].items():
        if site.endswith(_MOVES):
            print(f"  {n:5.2f}  {site}")
    plain = rec["plain_step_syncs"]
    print(
        f"plain step: {plain['syncs_per_step']:.1f} syncs, {plain['device_moves_per_step']:.1f} moves to the device; "
        f"plain greedy continuation equals model.generate: {rec['reference_equals_generate']}"
    )


def write_report(report: dict[str, Any], out: Path) -> None:
    """Write ``report`` as JSON atomically (a temporary file in the same folder, then a rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(report, f, indent=1, allow_nan=False)
    os.replace(tmp, out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None, help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--sizes", nargs="+", default=["135m", "1b", "8b"], choices=list(SIZES))
    p.add_argument("--nodes", nargs="+", type=int, default=[1, 4, 8, 16, 32, 64], help="tree sizes, root included")
    p.add_argument("--acceptance", nargs="+", type=float, default=[0.0, 0.5, 0.8], help="per-depth acceptance")
    p.add_argument("--shapes", nargs="+", choices=("tree", "chain"), default=["tree"])
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (medians over them)")
    p.add_argument("--cycles", type=int, default=24, help="speculation cycles per run (about)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--sync-count", choices=("auto", "debug", "patch"), default="auto", help="auto: debug on CUDA")
    p.add_argument("--goal", type=float, default=GOAL_CYCLE_STEPS, help="cycle cost goal in plain steps")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--max-minutes", type=float, default=6.0, help="skip the sizes not started by then")
    p.add_argument("--dry-run", action="store_true", help="CPU, fp32, the tiny target, few rounds: seconds")
    p.add_argument("--strict", action="store_true", help="raise instead of recording a size's error")
    p.add_argument("--out", default="runs/gpu_cycle_cost.json")
    args = p.parse_args(argv)
    if args.dry_run:
        args.device, args.dtype, args.sizes, args.strict = "cpu", args.dtype or "float32", ["tiny"], True
        args.nodes, args.rounds, args.cycles, args.prompt_tokens = [1, 4, 8], 3, 8, 16
        args.threads = args.threads or 1
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.sync_count == "auto":
        args.sync_count = "debug" if args.device.startswith("cuda") else "patch"
    import transformers  # heavy import; its version decides whether the decode loop runs at all
    from packaging.version import Version

    if Version(transformers.__version__).release < MIN_TRANSFORMERS:
        p.error(
            f"transformers {transformers.__version__} is older than {'.'.join(map(str, MIN_TRANSFORMERS))}, which "
            "selfspec.decode needs; install that release, or carry its wheel (see this script's docstring)"
        )
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("CUDA is not available: pass --device cpu, or --dry-run for the tiny CPU run")
    if args.sync_count == "debug" and not args.device.startswith("cuda"):
        p.error("--sync-count debug needs CUDA (torch.cuda.set_sync_debug_mode); use patch on a CPU")
    if min(args.nodes) < 1 or args.rounds < 1 or args.cycles < 2 or args.prompt_tokens < 1:
        p.error("--nodes must be >= 1, --rounds >= 1, --cycles >= 2 and --prompt-tokens >= 1")
    if any(not 0.0 <= a <= 1.0 for a in args.acceptance):
        p.error("--acceptance values must lie in [0, 1]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers  # heavy import; for the report's versions

    t_start = time.perf_counter()
    report: dict[str, Any] = {
        "device": args.device,
        "accelerator": torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else platform.processor() or "cpu",
        "dtype": args.dtype,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "sync_count": {
            "debug": "torch.cuda.set_sync_debug_mode('warn'), every warning counted",
            "patch": "patched torch.Tensor host reads (" + ", ".join(HOST_READS) + "); moves to a device apart",
        }[args.sync_count],
        "goal_cycle_rel": args.goal,
        "prompt_tokens": args.prompt_tokens,
        "cycles_per_run": args.cycles,
        "rounds": args.rounds,
        "tree_accuracy": TREE_ACCURACY,
        "sizes": {},
    }
    out = Path(args.out)
    for size in args.sizes:
        if (time.perf_counter() - t_start) / 60 > args.max_minutes:
            report["sizes"][size] = {"skipped": f"not started within --max-minutes {args.max_minutes}"}
            print(f"\n== {size}: skipped (past --max-minutes {args.max_minutes}) ==")
            continue
        try:
            report["sizes"][size] = measure_size(size, args, getattr(torch, args.dtype))
        except Exception as err:  # one size's failure must not cost the others' figures
            if args.strict:
                raise
            report["sizes"][size] = {"error": "".join(traceback.format_exception(err))}
            print(f"\n== {size}: failed ==\n{report['sizes'][size]['error']}")
        else:
            print_size(size, report["sizes"][size], args)
        gc.collect()  # the size's target is unreachable now
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        report["total_s"] = time.perf_counter() - t_start
        write_report(report, out)
    print(f"\nwrote {out} ({report['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
