"""Training run configuration: one frozen dataclass holds every default; YAML files hold values only.

``load_config(path, overrides)`` reads a YAML mapping, applies ``key=value`` overrides (values parsed
as YAML scalars), and refuses unknown keys with the list of valid ones.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml


@dataclass(frozen=True)
class TrainConfig:
    """Every knob of a head-training run.

    Attributes (units in names where they have one):
        head: head family, ``"medusa"`` (``"eagle"`` where available).
        target: target name (local dir, Hub id or alias, see :func:`selfspec.target.resolve_target`).
        data: ``"sharegpt"`` (packaged), a local .json/.jsonl path, or a Hub dataset id.
        max_conversations: conversations read from ``data`` (before the split).
        eval_fraction: held-out share, split by a hash of the conversation id.
        max_length: tokens per rendered conversation.
        self_distill: regenerate the assistant answers with the target (greedy) before training.
        distill_conversations: how many training conversations to regenerate.
        distill_max_new_tokens / distill_batch_size: generation budget for self-distillation.
        original_conversations: with ``self_distill``, also train on this many further training
            conversations as written (not regenerated; they come after the distilled ones). Target features
            of written text cost about a fifth of a regenerated token each, so they stretch a time budget.
        distill_dir: where regenerated answers are cached (JSONL per rank); default ``<output_dir>/distill``.
            Point several runs at one directory to train different heads on the same answers.
        dtype: target compute dtype for features and distillation (``"bfloat16"`` or ``"float32"``).
        num_heads / num_layers / own_lm_head / draft_vocab_size: Medusa head shape (see MedusaConfig).
        lr, weight_decay, betas, warmup_steps, grad_clip: AdamW + linear warmup + cosine decay.
        batch_positions: training positions per optimiser step (heads see one position at a time).
        epochs: passes over the cached features; ``max_steps`` caps the total if set.
        max_train_minutes: stop the optimisation loop after this wall time (features excluded).
        head_decay: CE weight of head k is ``head_decay ** k``.
        eval_every / save_every: in optimiser steps.
        eval_topk: top-k accuracies recorded per head (used to build the static tree).
        output_dir: checkpoints, features and the final ``heads/`` directory go here.
        seed: all randomness.
        threads: torch intra-op threads (None: torch's default).
        calibrate_prompts / calibrate_max_new_tokens: after training an EAGLE head, decode this many
            held-out prompts (the last ones of the held-out split) greedily with a large draft tree and save
            the acceptance profile next to the head, from which decoding sizes its tree to the machine
            (:mod:`selfspec.decode.budget`); 0 prompts skips it.
        eagle_*: EAGLE-1 recipe knobs: CE weight against the target distribution (0.1), SmoothL1 feature
            weight (1.0), half-width of the uniform noise on input features (0.1), head positions per
            optimiser step, fc bias, whether the decoder layer starts from the target's last layer, the
            training-time-test depth (unrolled steps on the head's own features, 1 = plain EAGLE-1) and
            its per-step loss decay, and whether pairs that draft prompt tokens are scored too.
    """

    head: str = "medusa"
    target: str = "smollm2-135m-instruct"
    data: str = "sharegpt"
    max_conversations: int = 3000
    eval_fraction: float = 0.05
    max_length: int = 512
    self_distill: bool = True
    distill_conversations: int = 320
    distill_max_new_tokens: int = 160
    distill_batch_size: int = 16
    distill_dir: str | None = None
    original_conversations: int = 0
    dtype: str = "float32"
    num_heads: int = 4
    num_layers: int = 1
    own_lm_head: bool = True
    draft_vocab_size: int | None = 8192
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 30
    grad_clip: float = 1.0
    batch_positions: int = 256
    epochs: int = 4
    max_steps: int | None = None
    max_train_minutes: float | None = None
    head_decay: float = 0.8
    eval_every: int = 100
    save_every: int = 100
    eval_topk: int = 8
    output_dir: str = "runs/medusa-smollm2"
    seed: int = 0
    threads: int | None = None
    eagle_ce_weight: float = 0.1
    eagle_feature_weight: float = 1.0
    eagle_noise: float = 0.1
    eagle_batch_tokens: int = 2048
    eagle_fc_bias: bool = True
    eagle_init_from_target_layer: bool = False
    eagle_ttt_steps: int = 1
    eagle_ttt_decay: float = 0.8
    eagle_score_prompt: bool = False
    calibrate_prompts: int = 8
    calibrate_max_new_tokens: int = 48

    def __post_init__(self) -> None:
        if self.head not in ("medusa", "eagle"):
            raise ValueError(f"head must be 'medusa' or 'eagle', got {self.head!r}")
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError("dtype must be 'bfloat16' or 'float32'")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError("eval_fraction must be in (0, 1)")
        if isinstance(self.betas, list):
            object.__setattr__(self, "betas", tuple(self.betas))


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ValueError(f"override {item!r} must look like key=value")
    key, value = item.split("=", 1)
    return key.strip(), yaml.safe_load(value) if value != "" else None


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a YAML config and apply ``key=value`` overrides; every value is checked against its field's type
    (numbers are coerced for float fields, see :func:`_coerce`).

    Raises:
        ValueError: unknown keys (message lists valid keys), malformed overrides, values of the wrong type,
            invalid values.
        FileNotFoundError: ``path`` does not exist.
    """
    data: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path} must hold a YAML mapping of TrainConfig fields")
        data.update(loaded)
    for item in overrides:
        k, v = _parse_override(item)
        data[k] = v
    valid = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(data) - valid)
    if unknown:
        raise ValueError(f"unknown config keys {unknown}; valid keys: {sorted(valid)}")
    return TrainConfig(**{k: _coerce(k, v) for k, v in data.items()})


def _coerce(key: str, value: Any) -> Any:
    """``value`` checked against the declared type of TrainConfig field ``key``.

    YAML reads ``3e-4`` (no dot) as a string and ``1`` as an int: numbers written either way are accepted
    for float fields and converted; anything else of the wrong kind raises.

    Raises:
        ValueError: the value cannot be the field's type (the message names the key and the type).
    """
    kind = str(_FIELD_TYPES[key])
    optional = "None" in kind
    if value is None:
        if optional:
            return None
        raise ValueError(f"{key} cannot be empty (expected {kind})")
    base = kind.replace(" | None", "")
    if base == "float":
        if isinstance(value, bool):
            raise ValueError(f"{key} must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key} must be a number, got {value!r}") from None
    if base == "int":
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            raise ValueError(f"{key} must be an integer, got {value!r}")
        return int(value)
    if base == "bool" and not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    if base == "str" and not isinstance(value, str):
        raise ValueError(f"{key} must be a string, got {value!r}")
    return value


_FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
