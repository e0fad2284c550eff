"""After training: measure how many draft tokens a head gets accepted per tree budget on held-out prompts
(the acceptance profile that sizes its decoding tree to the machine)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfspec.decode.calibration import calibrate_acceptance, save_acceptance_profile
from selfspec.decode.eagle import EagleDrafter
from selfspec.train.config import TrainConfig
from selfspec.train.data import prompt_messages

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


CALIBRATION_DEPTH_MAX = 6
CALIBRATION_TOTAL_TOKENS_MAX = 32
CALIBRATION_TOP_K = 4


def calibrate_head(
    cfg: TrainConfig, head, target: PreTrainedModel, tokenizer, eval_convs: list[dict], head_dir: Path
) -> dict[str, Any]:
    """Greedy acceptance profile of the saved head on the last ``cfg.calibrate_prompts`` held-out prompts
    (:func:`selfspec.decode.calibration.calibrate_acceptance`, one drafter of the largest budget
    ``CALIBRATION_DEPTH_MAX`` x ``CALIBRATION_TOTAL_TOKENS_MAX``), written to
    ``<head_dir>/acceptance_profile.json``. Returns a summary (prompts, seconds, tau at a few budgets);
    ``{"prompts": 0}`` when no held-out conversation has a prompt."""

    t0 = time.perf_counter()
    convs = [c for c in eval_convs if prompt_messages(c)][-cfg.calibrate_prompts :]
    if not convs:
        logger.warning("no held-out prompt to calibrate the tree budget on; decoding will use default budgets")
        return {"prompts": 0}
    ids = []
    for conv in convs:
        enc = tokenizer.apply_chat_template(prompt_messages(conv), add_generation_prompt=True, return_dict=True)
        ids.append(torch.tensor(list(enc["input_ids"]), dtype=torch.long))
    was_training = head.training
    head.eval()
    drafter = EagleDrafter(head, target, depth=CALIBRATION_DEPTH_MAX, top_k=CALIBRATION_TOP_K,
                           total_tokens=CALIBRATION_TOTAL_TOKENS_MAX)
    eos = target.generation_config.eos_token_id
    profile = calibrate_acceptance(
        target, drafter, ids, max_new_tokens=cfg.calibrate_max_new_tokens,
        total_tokens_max=CALIBRATION_TOTAL_TOKENS_MAX, depth_max=CALIBRATION_DEPTH_MAX, eos_token_id=eos,
    )
    save_acceptance_profile(profile, head_dir)
    head.train(was_training)
    out = {"prompts": len(ids), "seconds": round(time.perf_counter() - t0, 1),
           "tau": {f"d{d}_n{n}": round(profile.tau_at(d, n), 3) for d, n in ((1, 1), (3, 4), (4, 8), (6, 16), (6, 32))}}
    logger.info("acceptance profile on %d held-out prompts in %.0fs: %s", len(ids), out["seconds"], out["tau"])
    return out
