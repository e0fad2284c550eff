"""A frozen target whose decoder layers are sharded across the training processes (``target_parallel: fsdp``).

Each decoder layer of the target (the classes its ``transformers`` model names in ``_no_split_modules``, the unit
accelerate's FSDP wraps) becomes an FSDP2 unit (``torch.distributed.fsdp.fully_shard``) over all the processes: at
rest a process holds ``1/w`` of every layer's weights; a forward all-gathers one layer at a time and frees it again
after the layer ran (``reshard_after_forward``), so at most one whole layer is held beside the shards. The embeddings,
the final norm and the LM head stay whole on every process: the draft heads read them (the token embeddings, the
target's LM head rows) at every step, and they are a small part of a large target (about 2 GiB of a 70B model's 140 in
bf16). Nothing is trained: the target stays frozen, so no gradient is ever reduced.

A forward through sharded layers is a collective: every process must run the same number of forwards, where each
process works on its own share of the data (its prompts to regenerate, its conversations' features) and the shares
differ in size, in answer lengths and in what a resumed run finds done. :func:`shard_target` therefore puts the
target's forwards in lockstep: before each forward of the decoder stack the processes agree (one all-reduce of a
flag) that at least one of them has a forward to run, and a process with no more work of a stage calls
:func:`sync_forwards`, which runs one-token forwards, whose results are dropped, for as long as another process still
has forwards of that stage. Every stage that runs the target ends with :func:`sync_forwards` on every process, before
any other collective. ``generate`` runs with ``synced_gpus=False``: this lockstep replaces its own.

What it saves, measured with 2 CPU processes (``tests/train/test_target_parallel.py``; SmolLM2-135M-Instruct in
docs/SCALING.md): the bytes of the decoder layers per process are halved; the embeddings and LM head are not.
Loading still reads the whole checkpoint into each process's CPU memory once before sharding (then frees it), so a
node needs the memory of one whole target per process while it loads.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from selfspec.base.errors import UserError
from selfspec.base.fingerprint import register_fingerprint, target_fingerprint

logger = logging.getLogger(__name__)

#: The values of ``target_parallel``: ``"none"`` (the whole target on each process) or ``"fsdp"`` (this module).
TARGET_PARALLEL = ("none", "fsdp")


@dataclass
class _Lockstep:
    """The forwards of one sharded target: its decoder stack, where the one-token forwards run, and whether this
    process is running them (its flag is then not raised again)."""

    stack: torch.nn.Module
    device: torch.device
    draining: bool = False


_SHARDED: weakref.WeakKeyDictionary[torch.nn.Module, _Lockstep] = weakref.WeakKeyDictionary()


def check_target_parallel(mode: str, features: str, trains_target: bool) -> None:
    """Refuse a training run that a sharded target (``target_parallel: fsdp``) cannot serve: its features come from
    the store (``features: auto`` or ``store``: online, the main process's evaluation would run the sharded target
    alone), its head does not train the target (Medusa-2, ``medusa.joint``); the draft's cost profile is not
    calibrated at the end of the run (``selfspec tune-tree`` calibrates it where the head is served).

    Raises:
        ValueError: ``features`` is ``"online"`` or ``trains_target`` with a sharded target, saying what to set.
    """
    if mode != "none" and features == "online":
        raise ValueError(
            f"target_parallel: {mode} reads features from the store (online, the main process's evaluation would run "
            "the sharded target alone): set features: store or auto"
        )
    if mode != "none" and trains_target:
        raise ValueError(
            "medusa.joint (Medusa-2) trains the target, which target_parallel shards frozen: set target_parallel: none"
        )


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` whose class ``model._no_split_modules`` names (its decoder layers), in module order.

    Raises:
        UserError: the model names none, or none of its modules is of a named class.
    """
    names = set(model._no_split_modules or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise UserError(
            f"target_parallel: fsdp shards the target's decoder layers, and {type(model).__name__} names no layer "
            "class in its _no_split_modules: train with target_parallel: none"
        )
    return layers


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers this process holds: the local shard of a sharded parameter
    (``DTensor.to_local``), the whole of any other."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in (*model.parameters(), *model.buffers()):
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def shard_target(model: torch.nn.Module, device: torch.device | str) -> None:
    """Shard ``model``'s decoder layers across all processes of the initialised default process group (FSDP2,
    module docstring), move the rest of it to ``device`` and put its forwards in lockstep.

    Every process must call it, in the same order with respect to other collectives. Its fingerprint is taken
    first, from the whole weights, and kept (:func:`~selfspec.base.fingerprint.register_fingerprint`). One
    one-token forward of the decoder stack under ``torch.no_grad`` runs on every process, so the layers' gathered
    weights are allocated outside inference mode and both ``no_grad`` (``generate``) and ``inference_mode``
    (feature passes) forwards can use them.

    Args:
        model: a frozen ``*ForCausalLM`` on the CPU (or already on ``device``), the same weights on every process.
        device: where the shards and the rest live (the process's accelerator device).

    Raises:
        UserError: ``torch.distributed`` is not initialised (a single process: nothing to shard across), or the
            model names no decoder layer class (:func:`decoder_layers`).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not (dist.is_available() and dist.is_initialized()):
        raise UserError(
            "target_parallel: fsdp shards the target across processes: start the run with accelerate launch"
        )
    device = torch.device(device)
    register_fingerprint(model, target_fingerprint(model))
    layers = decoder_layers(model)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    before = held_bytes(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    model.to(device)
    stack = model.base_model
    state = _Lockstep(stack, device)
    _SHARDED[model] = state
    stack.register_forward_pre_hook(lambda module, args: _agree(state))
    with torch.no_grad():
        _one_token_forward(state)
    logger.info(
        "target sharded across %d processes (%d decoder layers, FSDP2): %.3f GiB of its %.3f GiB held here",
        dist.get_world_size(),
        len(layers),
        held_bytes(model) / 2**30,
        before / 2**30,
    )


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether :func:`shard_target` sharded ``model`` (in this process)."""
    return model in _SHARDED


def layer_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every sharded tensor gathered whole (``DTensor.full_tensor``): what a draft
    layer copies from a target layer. On a sharded layer it is a collective (every process must call it, for the
    same layer); on any other it is ``state_dict()``."""
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.state_dict().items()}


def module_class(module: torch.nn.Module) -> type[torch.nn.Module]:
    """The class ``module`` was built as: for a layer :func:`shard_target` sharded, the class FSDP2 derived its own
    from (``fully_shard`` swaps a module's class for a subclass of ``FSDPModule`` and it); else ``type(module)``."""
    cls = type(module)
    if not torch.distributed.is_available():  # a build without torch.distributed shards nothing
        return cls
    from torch.distributed.fsdp import FSDPModule

    if issubclass(cls, FSDPModule):
        return next(base for base in cls.__bases__ if not issubclass(base, FSDPModule))
    return cls


def sync_forwards(model: torch.nn.Module) -> None:
    """End a stage of forwards of a sharded target: run one-token forwards for as long as another process still
    has forwards of the stage; returns when none has. A no-op for a target that is not sharded."""
    state = _SHARDED.get(model)
    if state is None:
        return
    state.draining = True
    try:
        with torch.no_grad():
            while _any_forward(state, 0):
                _one_token_forward(state)
    finally:
        state.draining = False


def _agree(state: _Lockstep) -> None:
    """The decoder stack's forward pre-hook: this process has a forward to run (the others learn it)."""
    if not state.draining:
        _any_forward(state, 1)


def _any_forward(state: _Lockstep, mine: int) -> bool:
    import torch.distributed as dist

    flag = torch.tensor([mine], dtype=torch.int32, device=state.device)
    dist.all_reduce(flag)
    return bool(flag.item())


def _one_token_forward(state: _Lockstep) -> None:
    draining, state.draining = state.draining, True  # the hook does not raise this process's flag
    try:
        state.stack(input_ids=torch.zeros(1, 1, dtype=torch.long, device=state.device), use_cache=False)
    finally:
        state.draining = draining
