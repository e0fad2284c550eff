"""Online adaptation: a head that learns from the requests it serves, while the target keeps every output exact.

Online speculative decoding (Liu et al., ICML 2024, arXiv:2310.07177) distils the drafter on the query stream it
serves. Here, for an EAGLE-3 head (:class:`OnlineAdapter`; the recipe is :mod:`selfspec.train.eagle3`'s):

* **data**: after each request the served sequence (prompt and output) goes through the target once more to get the
  head's training features (its three fused layers and the last state, whose logits are p), the same features
  offline training uses, so the loss is offline training's KL to the target distribution. (Verification computes the
  same states while decoding; one extra forward over the finished sequence costs about a prefill and keeps the
  decode loop untouched.) Sequences go to a bounded replay buffer (``buffer_tokens``, the oldest dropped), every
  ``heldout_every``-th to a held-out buffer that gates updates;
* **when**: between requests (:meth:`OnlineAdapter.observe` after ``generate`` returns), or in a background thread
  (``background=True``); in both, training stops while its seconds exceed ``cpu_share`` of the serving seconds plus
  its own, and the head the drafter uses is never the one being trained (a shadow copy is);
* **swap**: at the end of each window of ``window`` requests the shadow head replaces the live one (a weight copy
  between requests, so no step and no batch row sees a half-updated head) when its held-out chain tau estimate beats
  the live head's;
* **rollback**: the window served by a swapped-in head is compared with the window before it; when its mean tau
  (accepted tokens per step, measured on served traffic) fell by more than ``tolerance``, the previous weights come
  back and the optimiser restarts from them;
* **faults**: any exception in adaptation stops it with a warning that says why, restores the last good weights, and
  decoding goes on with them.

Served text never leaves the process: the buffers hold token ids and features in memory; :meth:`OnlineAdapter.save`
writes the head and a record of counts only.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfspec.base.files import write_json
from selfspec.heads.io import ADAPTATION_NAME
from selfspec.train.config import Eagle3Options
from selfspec.train.eagle3 import UnrolledEagle3, eagle3_step_loss, evaluate
from selfspec.train.eagle_data import PairStore, collate, epoch_rows
from selfspec.train.features import hidden_features

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OnlineOptions:
    """How a served head adapts (``selfspec.load(target, heads, adapt=OnlineOptions(...))``; ``adapt=True`` takes
    these defaults).

    Attributes:
        buffer_tokens: replay buffer bound, in tokens (each holds ``4 D`` float32 features: ~9 KiB at D = 576, so
            ~150 MiB at the default 16,384; the held-out buffer holds a quarter of this more).
        window: requests per acceptance window (swap and rollback decisions are taken at its end).
        steps_per_request: optimiser steps after each request (fewer when the CPU share is spent).
        batch_tokens: pairs per optimiser step (packed rows of ``max_length``).
        max_length: tokens of a served sequence kept for training (its first ones).
        lr: AdamW learning rate (betas 0.9 / 0.95, gradient clip 0.5).
        ttt_steps: the training-time test depth (EAGLE-3's recipe).
        cpu_share: training seconds may be at most this share of serving plus training seconds.
        heldout_every: every n-th request goes to the held-out buffer instead of the replay buffer.
        tolerance: a swapped-in head whose window tau falls below the previous window's by more than this fraction
            is rolled back.
        background: train in a background thread instead of between requests (swaps still happen between requests).
        seed: the order of the replay rows.

    Raises:
        ValueError: a size, share or tolerance out of range.
    """

    buffer_tokens: int = 16_384
    window: int = 8
    steps_per_request: int = 2
    batch_tokens: int = 1024
    max_length: int = 512
    lr: float = 3e-4
    ttt_steps: int = 2
    cpu_share: float = 0.3
    heldout_every: int = 4
    tolerance: float = 0.03
    background: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.buffer_tokens, self.window, self.batch_tokens, self.max_length, self.ttt_steps) < 1:
            raise ValueError("buffer_tokens, window, batch_tokens, max_length and ttt_steps must be >= 1")
        if self.steps_per_request < 0 or self.heldout_every < 2:
            raise ValueError("steps_per_request must be >= 0 and heldout_every >= 2")
        if not 0.0 < self.cpu_share < 1.0 or not 0.0 <= self.tolerance < 1.0:
            raise ValueError(
                f"cpu_share must be in (0, 1) and tolerance in [0, 1), got {self.cpu_share}, {self.tolerance}"
            )


@dataclass
class OnlineStats:
    """What online adaptation did so far (counts and seconds; no text)."""

    requests: int = 0
    served_tokens: int = 0
    served_s: float = 0.0
    train_s: float = 0.0
    steps: int = 0
    swaps: int = 0
    rollbacks: int = 0
    windows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    failed: str | None = None


class OnlineAdapter:
    """Online adaptation of a live EAGLE-3 head (see the module docstring for the method).

    Args:
        head: the head the drafter uses (adapted in place, by weight copies between requests).
        target: the frozen target (its forward gives the training features).
        options: :class:`OnlineOptions`.

    Raises:
        ValueError: a head of a family online adaptation does not train (use ``selfspec adapt`` offline).
    """

    def __init__(self, head: torch.nn.Module, target: PreTrainedModel, options: OnlineOptions | None = None) -> None:
        if str(head.config.head_type) != "eagle3":
            raise ValueError(
                f"this adapter trains EAGLE-3 heads; these are {head.config.head_type} heads: adapt them offline with "
                "selfspec adapt, or load without adapt="
            )
        self.options = options or OnlineOptions()
        self.live, self.target = head, target
        shared = {id(m): m for m in target.modules()}  # the target's embedding stays shared, never copied
        self.shadow = copy.deepcopy(head, memo=shared).float().train()
        self._good = self._state(head)
        self._optim = self._new_optimiser()
        self._lm_rows: torch.Tensor | None = None
        self._train: list[tuple[dict, torch.Tensor]] = []
        self._held: list[tuple[dict, torch.Tensor]] = []
        self._store: PairStore | None = None
        self._window: list[float] = []
        self._previous_tau: float | None = None
        self._trial = False
        self._pending: dict[str, torch.Tensor] | None = None
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self.stats = OnlineStats()

    # ------------------------------------------------------------------------------------------------ serving side
    @property
    def enabled(self) -> bool:
        """False once a fault stopped adaptation (the last good head serves on)."""
        return self.stats.failed is None

    def before_request(self) -> None:
        """Apply a swap the background trainer left pending (called before each request: never mid-request)."""
        with self._lock:
            if self._pending is not None:
                self.live.load_state_dict(self._pending)
                self._pending = None

    def observe(self, sequence: torch.Tensor, prompt_tokens: int, tau: float, served_s: float) -> None:
        """Learn from one served request.

        Args:
            sequence: Long ``[T]``, the prompt and the output.
            prompt_tokens: how many of ``sequence`` are the prompt.
            tau: the request's mean accepted tokens per step (its ``stats.mean_accepted_tokens``).
            served_s: the seconds it took to serve.
        """
        if not self.enabled:
            return
        self.stats.requests += 1
        self.stats.served_tokens += int(sequence.numel()) - prompt_tokens
        self.stats.served_s += served_s
        if self.options.background:
            self.join()
            self._worker = threading.Thread(target=self._guarded, args=(sequence, prompt_tokens, tau), daemon=True)
            self._worker.start()
        else:
            self._guarded(sequence, prompt_tokens, tau)

    def join(self) -> None:
        """Wait for the background trainer's work on the last request (no-op between requests)."""
        if self._worker is not None:
            self._worker.join()
            self._worker = None

    def _guarded(self, sequence: torch.Tensor, prompt_tokens: int, tau: float) -> None:
        t0 = time.perf_counter()
        try:
            self._learn(sequence, prompt_tokens, tau)
        except Exception as err:  # a fault in adaptation must never stop serving
            self.stats.failed = f"{type(err).__name__}: {err}"
            self._restore(self._good)
            warnings.warn(
                f"online adaptation stopped ({self.stats.failed}); the last good head serves on unchanged",
                RuntimeWarning,
                stacklevel=2,
            )
        finally:
            self.stats.train_s += time.perf_counter() - t0

    # ------------------------------------------------------------------------------------------------ learning
    def _learn(self, sequence: torch.Tensor, prompt_tokens: int, tau: float) -> None:
        self._add(sequence.detach().cpu()[: self.options.max_length], prompt_tokens)
        for _ in range(self.options.steps_per_request):
            spent = self.stats.train_s
            if spent > self.options.cpu_share * (self.stats.served_s + spent) or not self._train:
                break
            self._step()
        self._window.append(float(tau))
        if len(self._window) >= self.options.window:
            self._end_window()

    def _add(self, ids: torch.Tensor, prompt_tokens: int) -> None:
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        mask[prompt_tokens:] = True
        example = {"input_ids": ids, "loss_mask": mask}
        with torch.no_grad():
            features = hidden_features(self.target, [example], True, layers=self.live.target_layers)[0].float()
        held = self.stats.requests % self.options.heldout_every == 0
        bound = self.options.buffer_tokens // 4 if held else self.options.buffer_tokens
        buffer = self._held if held else self._train
        buffer.append((example, features))
        while len(buffer) > 1 and sum(int(e["input_ids"].numel()) for e, _ in buffer) > bound:
            buffer.pop(0)  # the oldest goes
        if not held:
            self._store = None

    def _pairs(self, items: list[tuple[dict, torch.Tensor]]) -> PairStore:
        D = self.live.config.hidden_size
        return PairStore.from_examples([e for e, _ in items], [f for _, f in items], 4 * D)

    def _step(self) -> None:
        if self._store is None:
            self._store = self._pairs(self._train)
        if self._store.scored_positions() == 0:
            return
        o = self.options
        rows = epoch_rows(self._store, o.max_length, o.seed * 1000 + self.stats.steps)
        batch = collate(self._store, rows[: max(1, o.batch_tokens // o.max_length)])
        if self._lm_rows is None:
            lm = self.target.get_output_embeddings().weight.detach()
            self._lm_rows = lm[self.shadow.draft_ids.to(lm.device)].float().cpu()
        recipe = Eagle3Options(ttt_steps=o.ttt_steps)
        D = self.live.config.hidden_size
        loss, _, scored = eagle3_step_loss(
            UnrolledEagle3(self.shadow), batch, self._lm_rows, recipe, D, self.shadow.logit_softcap
        )
        if scored:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.shadow.parameters(), 0.5)
            self._optim.step()
        self._optim.zero_grad(set_to_none=True)
        self.stats.steps += 1

    def heldout_tau(self, head: torch.nn.Module) -> float | None:
        """The held-out chain tau estimate of ``head`` on the held-out buffer (None while it is empty)."""
        store = self._pairs(self._held)
        if store.scored_positions() == 0:
            return None
        lm = self.target.get_output_embeddings().weight.detach()
        metrics = evaluate(head, store, lm, min(3, self.options.ttt_steps + 1), self.options.max_length)
        return float(metrics["chain_tau"])

    def _end_window(self) -> None:
        tau = sum(self._window) / len(self._window)
        record: dict[str, Any] = {"requests": self.stats.requests, "tau": round(tau, 4), "action": "kept"}
        self._window = []
        if self._trial:
            if self._previous_tau is not None and tau < self._previous_tau * (1 - self.options.tolerance):
                self._restore(self._good)
                self.stats.rollbacks += 1
                record["action"] = "rolled back"
                logger.info("online adaptation: window tau %.3f < %.3f: rolled back", tau, self._previous_tau)
            else:
                self._good = self._state(self.live)
            self._trial = False
        self._previous_tau = tau
        if record["action"] == "kept" and self.stats.steps:
            live, shadow = self.heldout_tau(self.live), self.heldout_tau(self.shadow)
            record.update(heldout_live=live, heldout_shadow=shadow)
            if live is not None and shadow is not None and shadow > live:
                self._swap(self._state(self.shadow))
                self._trial = True
                self.stats.swaps += 1
                record["action"] = "swapped"
        self.stats.windows.append(record)

    # ------------------------------------------------------------------------------------------------ weights
    @staticmethod
    def _state(head: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in head.state_dict().items()}

    def _swap(self, state: dict[str, torch.Tensor]) -> None:
        if self.options.background:
            with self._lock:
                self._pending = state  # applied by before_request, between requests
        else:
            self.live.load_state_dict(state)

    def _restore(self, state: dict[str, torch.Tensor]) -> None:
        self._swap(state)
        self.shadow.load_state_dict(state)
        self._optim = self._new_optimiser()

    def _new_optimiser(self) -> torch.optim.Optimizer:
        params = [p for p in self.shadow.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.options.lr, betas=(0.9, 0.95))

    def memory_bytes(self) -> int:
        """Bytes the buffers hold now (features and token ids)."""
        return sum(f.nbytes + e["input_ids"].nbytes for e, f in self._train + self._held)

    def save(self, directory: str | Path) -> Path:
        """Write the live head (strict head I/O) and ``adaptation.json`` (counts, no text, no paths).

        Returns:
            ``directory``.
        """
        self.join()
        self.before_request()
        out = self.live.save_pretrained(directory)
        s = self.stats
        record = {
            "format": "selfspec-adaptation",
            "version": 1,
            "mode": "online",
            "family": str(self.live.config.head_type),
            "requests": s.requests,
            "served_tokens": s.served_tokens,
            "optimiser_steps": s.steps,
            "swaps": s.swaps,
            "rollbacks": s.rollbacks,
            "train_s": round(s.train_s, 1),
            "served_s": round(s.served_s, 1),
            "options": dataclasses.asdict(self.options),
        }
        write_json(Path(out) / ADAPTATION_NAME, record)
        return Path(out)
