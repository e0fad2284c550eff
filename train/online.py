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
* **non-finite steps**: a step whose loss or gradient norm is not finite (a bad batch, an overflow) is skipped and
  counted (``OnlineStats.skipped_steps``); :data:`NONFINITE_LIMIT` such steps in a row stop adaptation as a fault;
* **swap**: at the end of each window of ``window`` requests the shadow head replaces the live one (a weight copy
  between requests, so no step and no batch row sees a half-updated head) when every shadow weight is finite and its
  held-out chain tau estimate is finite and beats the live head's;
* **head versions**: each weight change of the live head (a swap, a rollback, a restore) is a new version, applied
  at a request boundary (:meth:`OnlineAdapter.before_request`, on the serving side; at once between requests, or in
  background mode the one after the trainer decided). Each request records the version that served it, and a window
  holds only requests served by the newest version (requests served by a version already replaced are in no window:
  ``OnlineStats.stale_requests``), so the trial window of a swapped-in head is served by that head by construction;
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
import math
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfspec.base.files import check_fields, in_range, write_json
from selfspec.heads.io import ADAPTATION_NAME
from selfspec.train.config import Eagle3Options
from selfspec.train.eagle3 import UnrolledEagle3, eagle3_step_loss, evaluate
from selfspec.train.eagle_data import PairStore, collate, epoch_rows
from selfspec.train.features import hidden_features

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

NONFINITE_LIMIT = 3  # optimiser steps in a row with a non-finite loss or gradient that stop adaptation


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
        ValueError: a field of another type or out of its range (the message names the field and the range).
    """

    buffer_tokens: int = in_range(16_384, ge=1)
    window: int = in_range(8, ge=1)
    steps_per_request: int = in_range(2, ge=0)
    batch_tokens: int = in_range(1024, ge=1)
    max_length: int = in_range(512, ge=1)
    lr: float = in_range(3e-4, gt=0)
    ttt_steps: int = in_range(2, ge=1)
    cpu_share: float = in_range(0.3, gt=0, lt=1)
    heldout_every: int = in_range(4, ge=2)
    tolerance: float = in_range(0.03, ge=0, lt=1)
    background: bool = False
    seed: int = in_range(0, ge=0)

    def __post_init__(self) -> None:
        check_fields(self, lambda name: f"OnlineOptions.{name}")


@dataclass
class OnlineStats:
    """What online adaptation did so far (counts and seconds; no text).

    Attributes:
        requests / served_tokens / served_s: the requests observed, their output tokens and serving seconds.
        train_s: seconds spent adapting.
        steps: optimiser steps taken; skipped_steps: steps skipped because their loss or gradient norm was not finite.
        swaps / rollbacks: shadow heads swapped in, and swapped-in heads rolled back after their trial window.
        stale_requests: requests served by a head version a decided swap had already replaced (in no window).
        windows: one record per window: ``requests`` (count at its end), ``version`` (the head version that served
            every request of it), ``served`` (their request numbers), ``tau``, ``action`` and the held-out figures.
        failed: why adaptation stopped (None while it runs).
    """

    requests: int = 0
    served_tokens: int = 0
    served_s: float = 0.0
    train_s: float = 0.0
    steps: int = 0
    skipped_steps: int = 0
    stale_requests: int = 0
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
        self._window_served: list[int] = []
        self._previous_tau: float | None = None
        self._trial = False
        self._nonfinite = 0  # non-finite steps in a row
        self._current = self._good  # the weights of the newest version (live, or pending in background mode)
        self._version = 0  # the newest version decided by the trainer
        self.live_version = 0  # the version the live head holds now (set on the serving side)
        self._serving: int | None = None  # the version before_request handed to the request in flight
        self._pending: tuple[dict[str, torch.Tensor], int] | None = None
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self.stats = OnlineStats()

    # ------------------------------------------------------------------------------------------------ serving side
    @property
    def enabled(self) -> bool:
        """False once a fault stopped adaptation (the last good head serves on)."""
        return self.stats.failed is None

    def before_request(self) -> int:
        """The request boundary: apply a head version the background trainer left pending, and hand the request the
        version that serves it (called before each request, never mid-request; :meth:`observe` records it).

        Returns:
            The head version serving the next request (0: the head it was loaded with; +1 per swap, rollback or
            restore).
        """
        with self._lock:
            if self._pending is not None:
                state, version = self._pending
                self.live.load_state_dict(state)
                self.live_version, self._pending = version, None
            self._serving = self.live_version
            return self.live_version

    def observe(self, sequence: torch.Tensor, prompt_tokens: int, tau: float, served_s: float) -> None:
        """Learn from one served request (of the request or batch :meth:`before_request` was last called for, whose
        version served it; without that call, the version live now).

        Args:
            sequence: Long ``[T]``, the prompt and the output.
            prompt_tokens: how many of ``sequence`` are the prompt.
            tau: the request's mean accepted tokens per step (its ``stats.mean_accepted_tokens``).
            served_s: the seconds it took to serve.
        """
        version = self.live_version if self._serving is None else self._serving  # every row of a batch: its version
        if not self.enabled:
            return
        self.join()  # the trainer's work on the previous request is done before the counts move on
        if not self.enabled:
            return
        self.stats.requests += 1
        self.stats.served_tokens += int(sequence.numel()) - prompt_tokens
        self.stats.served_s += served_s
        args = (sequence, prompt_tokens, tau, version, self.stats.requests)
        if self.options.background:
            self._worker = threading.Thread(target=self._guarded, args=args, daemon=True)
            self._worker.start()
        else:
            self._guarded(*args)

    def join(self) -> None:
        """Wait for the background trainer's work on the last request (no-op between requests)."""
        if self._worker is not None:
            self._worker.join()
            self._worker = None

    def _guarded(self, sequence: torch.Tensor, prompt_tokens: int, tau: float, version: int, request: int) -> None:
        t0 = time.perf_counter()
        try:
            self._learn(sequence, prompt_tokens, tau, version, request)
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
    def _learn(self, sequence: torch.Tensor, prompt_tokens: int, tau: float, version: int, request: int) -> None:
        self._add(sequence.detach().cpu()[: self.options.max_length], prompt_tokens, request)
        for _ in range(self.options.steps_per_request):
            spent = self.stats.train_s
            if spent > self.options.cpu_share * (self.stats.served_s + spent) or not self._train:
                break
            self._step()
        if version != self._version:  # served by a version a decided swap replaced: it judges no head
            self.stats.stale_requests += 1
            return
        self._window.append(float(tau))
        self._window_served.append(request)
        if len(self._window) >= self.options.window:
            self._end_window()

    def _add(self, ids: torch.Tensor, prompt_tokens: int, request: int) -> None:
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        mask[prompt_tokens:] = True
        example = {"input_ids": ids, "loss_mask": mask}
        with torch.no_grad():
            features = hidden_features(self.target, [example], True, layers=self.live.target_layers)[0].float()
        held = request % self.options.heldout_every == 0
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
        rows = epoch_rows(self._store, o.max_length, o.seed * 1000 + self.stats.steps + self.stats.skipped_steps)
        batch = collate(self._store, rows[: max(1, o.batch_tokens // o.max_length)])
        if self._lm_rows is None:
            lm = self.target.get_output_embeddings().weight.detach()
            self._lm_rows = lm[self.shadow.draft_ids.to(lm.device)].float().cpu()
        recipe = Eagle3Options(ttt_steps=o.ttt_steps)
        D = self.live.config.hidden_size
        loss, _, scored = eagle3_step_loss(
            UnrolledEagle3(self.shadow), batch, self._lm_rows, recipe, D, self.shadow.logit_softcap
        )
        bad = None if bool(torch.isfinite(loss.detach()).all()) else "loss"
        if scored and bad is None:
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(self.shadow.parameters(), 0.5)
            if bool(torch.isfinite(norm)):
                self._optim.step()
            else:
                bad = "gradient norm"
        self._optim.zero_grad(set_to_none=True)
        if bad is not None:
            self._skip(bad)
            return
        self._nonfinite = 0
        self.stats.steps += 1

    def _skip(self, what: str) -> None:
        """Count a step skipped for a non-finite ``what``; :data:`NONFINITE_LIMIT` in a row are a fault."""
        self.stats.skipped_steps += 1
        self._nonfinite += 1
        logger.info("online adaptation: the step's %s is not finite: skipped", what)
        if self._nonfinite >= NONFINITE_LIMIT:
            raise FloatingPointError(
                f"{NONFINITE_LIMIT} optimiser steps in a row had a non-finite {what} (a bad batch, or an overflow "
                "in the head's training)"
            )

    def heldout_tau(self, head: torch.nn.Module) -> float | None:
        """The held-out chain tau estimate of ``head`` on the held-out buffer (None while it is empty)."""
        store = self._pairs(self._held)
        if store.scored_positions() == 0:
            return None
        lm = self.target.get_output_embeddings().weight.detach()
        metrics = evaluate(head, store, lm, min(3, self.options.ttt_steps + 1), self.options.max_length)
        return float(metrics["chain_tau"])

    def _end_window(self) -> None:
        """Judge the window just filled: every request of it was served by version ``self._version`` (``_learn``),
        whose weights are live now (a pending version serves no request), so reading the live head here races with
        no swap."""
        tau = sum(self._window) / len(self._window)
        record: dict[str, Any] = {
            "requests": self.stats.requests,
            "version": self._version,
            "served": self._window_served,
            "tau": round(tau, 4),
            "action": "kept",
        }
        self._window, self._window_served = [], []
        if self._trial:
            if self._previous_tau is not None and tau < self._previous_tau * (1 - self.options.tolerance):
                self._restore(self._good)
                self.stats.rollbacks += 1
                record["action"] = "rolled back"
                logger.info("online adaptation: window tau %.3f < %.3f: rolled back", tau, self._previous_tau)
            else:
                self._good = self._current
            self._trial = False
        self._previous_tau = tau
        if record["action"] == "kept" and self.stats.steps:
            if not self._finite(self.shadow):
                self.shadow.load_state_dict(self._current)  # a broken shadow starts again from the live head
                self._optim = self._new_optimiser()
                record["action"] = "refused: non-finite weights"
                logger.warning("online adaptation: the shadow head has non-finite weights: not swapped in, reset")
                self.stats.windows.append(record)
                return
            live, shadow = self.heldout_tau(self.live), self.heldout_tau(self.shadow)
            record.update(heldout_live=live, heldout_shadow=shadow)
            if live is not None and shadow is not None and math.isfinite(shadow) and shadow > live:
                self._swap(self._state(self.shadow))
                self._trial = True
                self.stats.swaps += 1
                record["action"] = "swapped"
        self.stats.windows.append(record)

    # ------------------------------------------------------------------------------------------------ weights
    @staticmethod
    def _state(head: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in head.state_dict().items()}

    @staticmethod
    def _finite(head: torch.nn.Module) -> bool:
        return all(bool(torch.isfinite(v).all()) for v in head.state_dict().values() if v.is_floating_point())

    def _swap(self, state: dict[str, torch.Tensor]) -> None:
        """Make ``state`` the newest head version: live at once between requests, or (background mode) pending
        until the serving side's next request boundary; the window restarts with it."""
        self._version += 1
        self._current = state
        self._window, self._window_served = [], []
        if self.options.background:
            with self._lock:
                self._pending = (state, self._version)  # applied by before_request, between requests
        else:
            self.live.load_state_dict(state)
            self.live_version = self._version

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
