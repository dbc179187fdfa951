"""The checks and error handling every sharded decode op (``cp``, ``kvdp``, their grid) shares:
input facts compared across ranks, errors raised on every rank, the metadata device of a
group's backend, the batch-lengths check."""

from __future__ import annotations

import struct
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .._dispatch import check_same_device, check_tensor
from .._launch import FLOAT_DTYPES, INDEX_DTYPES, dtype_name
from .._collectives import all_gather_stacked, group_size

_DTYPE_CODES = FLOAT_DTYPES  # a query dtype's code is its index here, the same on every rank
_MESSAGE_BYTES = 240
_KINDS = (ValueError, TypeError, RuntimeError, Exception)  # error codes 1.. of a rank check


#: Facts compared as float64 bits (:func:`float_code`), shown as floats when they differ.
FLOAT_FIELDS = ("scale", "softcap")


def float_code(x: Any) -> int:
    """A float option as the int64 of its float64 bits, None as -1 (a NaN's bits, which a
    checked option never has): equal codes on two ranks mean the same option."""
    return -1 if x is None else struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _float_of(code: int) -> Optional[float]:
    return None if code == -1 else struct.unpack("<d", struct.pack("<q", code))[0]


def dtype_code(dtype: torch.dtype) -> int:
    """A small int naming a query dtype, for comparing dtypes across ranks."""
    return _DTYPE_CODES.index(dtype) if dtype in _DTYPE_CODES else len(_DTYPE_CODES)


def check_on_all_ranks(op: str, group: Any, check_ranks: bool, device: torch.device,
                       fields: Sequence[str], validate: Callable[[], Sequence[int]]) -> None:
    """Run ``validate()`` (which raises for bad local input, and returns one int per name in
    ``fields``: facts every rank must agree on).

    Without ``check_ranks`` a local error raises on its rank at once (before any collective
    of the op). With it, every rank joins one small all-gather of ``[error code, *facts,
    message bytes]`` first, so that a rank's bad input, or facts that differ between ranks,
    raise on every rank of the group (the failing rank's own message is shown everywhere)
    instead of leaving the other ranks waiting in the op's collectives. That costs the
    all-gather and a host synchronisation: for first steps and debugging.
    """
    if not check_ranks or group_size(group) == 1:
        validate()
        return
    error: Optional[Exception] = None
    try:
        facts = [int(x) for x in validate()]
    except Exception as e:  # re-raised below, after the other ranks have heard of it
        error, facts = e, [0] * len(fields)
    code = 0 if error is None else 1 + next(i for i, kind in enumerate(_KINDS)
                                            if isinstance(error, kind))
    message = list(str(error).encode()[:_MESSAGE_BYTES]) if error is not None else []
    row = torch.tensor([code, *facts, *message, *[0] * (_MESSAGE_BYTES - len(message))],
                       dtype=torch.int64, device=device)
    rows = all_gather_stacked(row, group).tolist()
    failed = [w for w, r in enumerate(rows) if r[0]]
    if error is not None:
        raise error
    if failed:
        w = failed[0]
        text = bytes(b for b in rows[w][1 + len(fields):] if b).decode(errors="replace")
        raise _KINDS[rows[w][0] - 1](f"{op}: rank {w} of the group rejected its inputs "
                                     f"(rank(s) {failed} failed): {text}")
    for i, name in enumerate(fields):
        seen = [r[1 + i] for r in rows]
        if len(set(seen)) > 1:
            if name == "query dtype":
                seen = [dtype_name(_DTYPE_CODES[c]) if c < len(_DTYPE_CODES) else "other"
                        for c in seen]
            elif name in FLOAT_FIELDS:
                seen = [_float_of(c) for c in seen]
            raise ValueError(f"{op}: the ranks of the group disagree on {name}: {seen} in rank "
                             f"order; every rank must pass the same {name}")


def meta_device(group: Any, t: Any) -> torch.device:
    """Where the metadata of :func:`check_on_all_ranks` lives for ``group``'s backend."""
    if "nccl" not in str(dist.get_backend(group)):
        return torch.device("cpu")
    if isinstance(t, torch.Tensor) and t.is_cuda:
        return t.device
    return torch.device("cuda", torch.cuda.current_device())


def check_no_grad(op: str, q: Any, sinks: Any) -> None:
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in (q, sinks)):
        raise ValueError(f"{op}: there is no backward through the collectives (decode "
                         "attention is an inference op); run it under torch.no_grad()")


def wrap_errors(prefix: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, with ``prefix`` put before the message of a ValueError/TypeError."""
    try:
        return fn()
    except (ValueError, TypeError) as e:
        raise (ValueError if isinstance(e, ValueError) else TypeError)(f"{prefix}: {e}") from None


def check_lengths(op: str, name: str, t: Any, batch: int, ref: torch.Tensor, *,
                  ref_name: str = "q", label: str = "B", note: str = "") -> None:
    """``t`` must be ``[batch]`` int32/int64 on ``ref``'s device (``label`` names the batch
    in the message, ``note`` follows the shape)."""
    check_tensor(op, name, t, ndim=1, dtypes=INDEX_DTYPES)
    if t.shape[0] != batch:
        raise ValueError(f"{op}: {name} must be [{label}={batch}]{note}, got {tuple(t.shape)}")
    check_same_device(op, ref_name, ref, **{name: t})
