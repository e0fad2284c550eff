"""After training: measure how many draft tokens a head gets accepted per tree budget on held-out prompts
(the acceptance profile that sizes its decoding tree to the machine)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfspec.decode.drafters.eagle import EagleDrafter
from selfspec.decode.tuning.calibration import (
    CALIBRATION_DEPTH_MAX,
    CALIBRATION_TOTAL_TOKENS_MAX,
    calibrate_acceptance,
    save_acceptance_profile,
)
from selfspec.train.config import TrainConfig
from selfspec.train.data import prompt_messages

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


CALIBRATION_TOP_K = 4


def calibrate_head(
    cfg: TrainConfig, head, target: PreTrainedModel, tokenizer, eval_convs: list[dict], head_dir: Path
) -> dict[str, Any]:
    """Greedy acceptance profile of the saved head on the last ``cfg.calibrate_prompts`` held-out prompts
    that fit (:func:`selfspec.decode.tuning.calibration.calibrate_acceptance`, one drafter of the largest budget
    ``CALIBRATION_DEPTH_MAX`` x ``CALIBRATION_TOTAL_TOKENS_MAX``), written to
    ``<head_dir>/acceptance_profile.json``.

    A prompt fits when it has at most ``cfg.max_length`` tokens (the longest row the head was trained on)
    and its decode (prompt, ``cfg.calibrate_max_new_tokens`` answer tokens and the deepest draft) stays
    within the target's ``max_position_embeddings``; the others are skipped, counted in a log line.

    Returns:
        A summary: ``prompts``, ``skipped`` (prompts that did not fit), ``seconds``, ``tau`` at a few budgets
        and ``ids`` (the conversation ids decoded, in order); ``{"prompts": 0, "skipped": n, "ids": []}``
        when no held-out prompt fits.
    """
    t0 = time.perf_counter()
    limit = prompt_limit(cfg, target)
    ids, conv_ids, skipped = [], [], 0
    for conv in eval_convs:
        messages = prompt_messages(conv)
        if not messages:
            continue
        enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
        prompt = torch.tensor(list(enc["input_ids"]), dtype=torch.long)
        if prompt.numel() > limit:
            skipped += 1
            continue
        ids.append(prompt)
        conv_ids.append(conv["id"])
    ids, conv_ids = ids[-cfg.calibrate_prompts :], conv_ids[-cfg.calibrate_prompts :]
    if skipped:
        logger.info(
            "calibration: %d held-out prompts skipped (over %d tokens: max_length %d, target context %s)",
            skipped,
            limit,
            cfg.max_length,
            getattr(target.config, "max_position_embeddings", None),
        )
    if not ids:
        logger.warning("no held-out prompt to calibrate the tree budget on; decoding will use default budgets")
        return {"prompts": 0, "skipped": skipped, "ids": []}
    was_training = head.training
    head.eval()
    drafter = EagleDrafter(
        head, target, depth=CALIBRATION_DEPTH_MAX, top_k=CALIBRATION_TOP_K, total_tokens=CALIBRATION_TOTAL_TOKENS_MAX
    )
    eos = target.generation_config.eos_token_id
    profile = calibrate_acceptance(
        target,
        drafter,
        ids,
        max_new_tokens=cfg.calibrate_max_new_tokens,
        total_tokens_max=CALIBRATION_TOTAL_TOKENS_MAX,
        depth_max=CALIBRATION_DEPTH_MAX,
        eos_token_id=eos,
    )
    save_acceptance_profile(profile, head_dir)
    head.train(was_training)
    out = {
        "prompts": len(ids),
        "skipped": skipped,
        "seconds": round(time.perf_counter() - t0, 1),
        "tau": {f"d{d}_n{n}": round(profile.tau_at(d, n), 3) for d, n in ((1, 1), (3, 4), (4, 8), (6, 16), (6, 32))},
        "ids": conv_ids,
    }
    logger.info("acceptance profile on %d held-out prompts in %.0fs: %s", len(ids), out["seconds"], out["tau"])
    return out


def prompt_limit(cfg: TrainConfig, target: PreTrainedModel) -> int:
    """The longest prompt (tokens) the calibration decodes: ``cfg.max_length``, and no more than leaves room in
    the target's ``max_position_embeddings`` (when it has one) for ``cfg.calibrate_max_new_tokens`` answer
    tokens plus the deepest draft (``CALIBRATION_DEPTH_MAX + 1`` positions)."""
    limit = cfg.max_length
    context = getattr(target.config, "max_position_embeddings", None)
    if context:
        limit = min(limit, int(context) - cfg.calibrate_max_new_tokens - CALIBRATION_DEPTH_MAX - 1)
    return limit
