"""A generation request and its sampling options: plain data, no tensors."""

from __future__ import annotations

import enum
import numbers
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._dispatch import check_int, check_number

OP = "Generator"


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops.

    ``temperature == 0``: greedy (the highest logit, lowest id on a tie; ``top_k`` and
    ``top_p`` apply to sampling only, as in Hugging Face's greedy search). Otherwise
    the logits are divided by ``temperature``, restricted to the ``top_k`` highest (None or
    0, as in Hugging Face's generation config: the whole vocabulary) and to
    the smallest set whose probability reaches ``top_p``, and one token is drawn. The draw
    for a request's ``i``-th new token depends only on ``(seed, i)`` and the logits: the
    same seed gives the same tokens whatever else runs in the batch, and after a
    preemption. ``seed``: any int, taken modulo 2**63. ``repetition_penalty`` (> 0, 1:
    none): Hugging Face's, before anything else: the logit of every token already in the
    prompt or the output is divided by it where positive, multiplied where negative
    (greedy and sampled requests alike).
    """

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    eos_token_ids: frozenset[int] = frozenset()
    seed: int = 0  # make(): None draws a random one
    repetition_penalty: float = 1.0

    @classmethod
    def make(cls, *, max_new_tokens: Any, temperature: Any = 0.0, top_k: Any = None,
             top_p: Any = None, eos_token_id: Any = None, seed: Any = None,
             vocab_size: int | None = None, repetition_penalty: Any = 1.0) -> SamplingParams:
        """Checked options (``TypeError`` / ``ValueError`` naming the argument)."""
        max_new_tokens = check_int(OP, "max_new_tokens", max_new_tokens, minimum=1)
        repetition_penalty = check_number(OP, "repetition_penalty", repetition_penalty,
                                          allow_none=False)
        if not (0.0 < repetition_penalty < float("inf")):
            raise ValueError(f"{OP}: repetition_penalty must be a finite number > 0 (1: none), "
                             f"got {repetition_penalty}")
        temperature = check_number(OP, "temperature", temperature, allow_none=False)
        if temperature < 0:
            raise ValueError(f"{OP}: temperature must be >= 0 (0: greedy), got {temperature}")
        if top_k is not None:
            top_k = check_int(OP, "top_k", top_k, minimum=0)
            top_k = top_k or None  # (0: no top-k, as Hugging Face's generation config)
        if top_p is not None:
            top_p = check_number(OP, "top_p", top_p)
            if not 0.0 < top_p <= 1.0:
                raise ValueError(f"{OP}: top_p must be in (0, 1], got {top_p}")
        if not isinstance(eos_token_id, torch.Tensor) and hasattr(eos_token_id, "__array__"):
            eos_token_id = torch.as_tensor(eos_token_id)  # a NumPy array of ids
        if isinstance(eos_token_id, torch.Tensor):  # (as HF's generation config may hold)
            if eos_token_id.is_floating_point() or eos_token_id.is_complex() or \
                    eos_token_id.dtype == torch.bool or eos_token_id.dim() > 1:
                raise TypeError(f"{OP}: eos_token_id as a tensor must hold integers in at "
                                f"most one dimension, got {eos_token_id.dtype} of shape "
                                f"{tuple(eos_token_id.shape)}")
            eos_token_id = eos_token_id.tolist()
        if eos_token_id is None:
            eos: frozenset[int] = frozenset()
        elif isinstance(eos_token_id, numbers.Integral) and not isinstance(eos_token_id, bool):
            eos = frozenset([int(eos_token_id)])
        elif isinstance(eos_token_id, Sequence) and not isinstance(eos_token_id, str):
            eos = frozenset(check_int(OP, "eos_token_id", t) for t in eos_token_id)
        else:
            raise TypeError(f"{OP}: eos_token_id must be an int, a list of ints or None, got "
                            f"{type(eos_token_id).__name__} {eos_token_id!r}")
        if vocab_size is not None:
            bad = sorted(t for t in eos if not 0 <= t < vocab_size)
            if bad:
                raise ValueError(f"{OP}: eos_token_id {bad} outside the vocabulary "
                                 f"[0, {vocab_size})")
        # No seed: a fresh one (two unseeded requests do not draw alike).
        seed = (secrets.randbits(63) if seed is None
                else check_int(OP, "seed", seed) % (1 << 63))
        return cls(max_new_tokens, temperature, top_k, top_p, eos, seed,
                   float(repetition_penalty))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the logits as they are (no penalty): the argmax a decode step's graph
        computes is the token."""
        return self.temperature == 0.0 and self.repetition_penalty == 1.0


class Status(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted: its cache freed, to be recomputed)
    RUNNING = "running"  # in the batch, its tokens in the cache
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One prompt being continued. ``tokens`` = prompt + output; the cache holds the first
    ``num_cached`` of them (a decode step feeds ``tokens[-1]`` at position
    ``len(tokens) - 1``, so a running request has ``num_cached == len(tokens) - 1`` between
    steps)."""

    rid: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    seq_id: int | None = None  # its sequence in the PagedKVCache while running
    num_cached: int = 0
    finish_reason: str | None = None  # "eos" or "length"
    preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def last_token(self) -> int:
        """``tokens[-1]`` without building ``tokens``."""
        return self.output[-1] if self.output else self.prompt[-1]

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    def append(self, token: int) -> bool:
        """Add a sampled token; True when the request is now finished."""
        self.output.append(token)
        if token in self.params.eos_token_ids:
            self.finish_reason = "eos"
        elif len(self.output) >= self.params.max_new_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None
