"""The few collectives lmfuse issues, each a single ``torch.distributed`` call. They sit below
every family (the losses' vocabulary-parallel forms, the sharded decode, the serving engine)
and import nothing of lmfuse's, so a family that communicates does not import
``lmfuse.distributed`` (nor, through it, the attention ops) to reach them.
``lmfuse.distributed.collectives`` re-exports the public names for outside code.

Every parallel op goes through these, so a test can count the collectives an op issues by
counting calls here (or to ``torch.distributed`` underneath).

Faults. On gloo a collective whose peer never arrives raises ``RuntimeError`` after the
group's timeout. On NCCL a synchronous collective only enqueues work: PyTorch returns no
handle for it, so neither its blocking wait nor its watchdog turns a peer that raised
mid-step into an exception here (on 2 H100s, torch 2.11 and NCCL 2.28, the healthy rank
blocked at its next host sync until killed; ``tests/gpu/faults_nccl.py``). So when
``TORCH_NCCL_BLOCKING_WAIT=1`` is set, every collective here is issued with
``async_op=True`` and waited on (outside CUDA-graph capture): a timed-out one then raises
``torch.distributed.DistBackendError`` on the waiting rank after the group's ``timeout``.
That costs a host wait per collective; without the variable nothing changes.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist


def _waited() -> bool:
    """Whether to wait on each collective's work (blocking wait asked for, and no CUDA graph
    being captured)."""
    if os.environ.get("TORCH_NCCL_BLOCKING_WAIT", "0").strip().lower() not in ("1", "true"):
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _issue(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """``fn(*args, **kwargs)``, waited on when :func:`_waited`."""
    if _waited():
        work = fn(*args, async_op=True, **kwargs)
        if work is not None:
            work.wait()
    else:
        fn(*args, **kwargs)


def check_group(op: str, name: str, group: Any) -> None:
    """``TypeError`` naming ``name`` unless ``group`` is a ``ProcessGroup`` or ``None``."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{op}: {name} must be a torch.distributed.ProcessGroup or None, got "
                        f"{type(group).__name__} {group!r}"[:300])


def group_size(group: Optional[Any]) -> int:
    """World size of ``group``; 1 for ``None``."""
    if group is None:
        return 1
    check_group("lmfuse", "the process group", group)
    return dist.get_world_size(group)


def group_rank(group: Optional[Any]) -> int:
    """This process's rank in ``group``; 0 for ``None``."""
    if group is None:
        return 0
    check_group("lmfuse", "the process group", group)
    return dist.get_rank(group)


def all_gather_stacked(t: torch.Tensor, group: Any) -> torch.Tensor:
    """``[world, *t.shape]``: every rank's ``t``, in rank order, from one all-gather."""
    world = dist.get_world_size(group)
    t = t.contiguous()
    out = torch.empty((world * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    # torch >= 2.12 names the single-tensor all-gather all_gather_single.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    _issue(gather, out, t, group=group)
    return out.view(world, *t.shape)


#: The ops :func:`check_agreed_once` has checked, per group: held weakly, so a group
#: destroyed and another created at its address (or under its name, which c10d reuses after
#: ``destroy_process_group``) is checked afresh.
_AGREED: "weakref.WeakKeyDictionary[Any, set[str]]" = weakref.WeakKeyDictionary()
#: Nonzero while :func:`check_agreed_once` gathers (the tests' collective counters list its
#: one-time check apart from an op's own collectives).
CHECKING = [0]


def check_agreed_once(op: str, group: Any, device: torch.device, **values: int) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless every rank passes the same
    ``values`` (shard widths, token counts): sizes a collective's ranks must share, whose
    disagreement would otherwise give wrong numbers or abort inside the backend. One small
    all-gather (and a host sync) on the first call of an op with ``group``, none after: a
    cache keyed by a rank's own values would differ between ranks exactly when the values
    do, and the ranks would then disagree on issuing the check's collective. Skipped while
    a CUDA graph is captured or torch.compile traces (the eager calls before check it)."""
    if op in _AGREED.get(group, ()) or torch.compiler.is_compiling() or (
            device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return
    mine = torch.tensor(list(values.values()), dtype=torch.int64, device=device)
    CHECKING[0] += 1
    try:
        every = all_gather_stacked(mine, group).tolist()
    finally:
        CHECKING[0] -= 1
    if any(row != every[0] for row in every):
        per_rank = "; ".join(f"rank {r}: " + ", ".join(f"{k} {v}" for k, v in zip(values, row))
                             for r, row in enumerate(every))
        raise ValueError(f"{op}: every rank of the group must pass the same "
                         f"{' and '.join(values)} ({per_rank})")
    _AGREED.setdefault(group, set()).add(op)


def all_to_all_stacked(t: torch.Tensor, group: Any) -> torch.Tensor:
    """``t [world, ...]`` -> ``[world, ...]``: row ``w`` of ``t`` goes to rank ``w``, row
    ``w`` of the result came from rank ``w``, from one all-to-all (every rank's rows of one
    shape and dtype)."""
    world = dist.get_world_size(group)
    if t.dim() == 0 or t.shape[0] != world:
        raise ValueError(f"all_to_all_stacked: t must be [world={world}, ...], one row per "
                         f"rank, got {tuple(t.shape)}")
    t = t.contiguous()
    out = torch.empty_like(t, memory_format=torch.contiguous_format)
    _issue(dist.all_to_all_single, out, t, group=group)
    return out


def all_reduce_sum(t: torch.Tensor, group: Any) -> torch.Tensor:
    """The elementwise sum of every rank's ``t`` over ``group``, from one all-reduce, in a new
    tensor (``t`` is left as it is)."""
    out = t.clone(memory_format=torch.contiguous_format)
    _issue(dist.all_reduce, out, op=dist.ReduceOp.SUM, group=group)
    return out


def all_reduce_sum_(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum every rank's ``t`` over ``group`` into ``t`` itself (one all-reduce); ``t``."""
    _issue(dist.all_reduce, t, op=dist.ReduceOp.SUM, group=group)
    return t
