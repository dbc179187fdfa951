"""The search behind ``lmfuse tune``: time candidate configs, keep the fastest.

A family describes its search as stages, each a config key and the values to try for it;
:func:`coordinate_sweep` times the starting config, then goes through the stages in order,
trying each value with the best config found so far (a coordinate descent: a few dozen
timings instead of the product of every stage). Every candidate passes the family's
guard before it runs, so a config that could not launch is reported as rejected, never
launched.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

Config = dict[str, Any]
Timer = Callable[[Callable[[], Any]], float]


def cuda_timer(reps: int = 10, warmup: int = 2) -> Timer:
    """A timer for ``fn`` on the current CUDA device: the median of ``reps`` calls, in ms,
    each between CUDA events, after ``warmup`` calls (compilation, allocator)."""
    def timer(fn: Callable[[], Any]) -> float:
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    return timer


@dataclass
class Trial:
    """One candidate: its time in ms, or why it did not run."""
    config: Config
    ms: Optional[float] = None
    rejected: Optional[str] = None  # the guard's message: never launched
    failed: Optional[str] = None    # launched and raised


@dataclass
class Outcome:
    best: Config
    ms: float
    trials: list[Trial] = field(default_factory=list)


def coordinate_sweep(start: Config, stages: Sequence[tuple[str, Sequence[Any]]],
                     run: Callable[[Config], Any], check: Callable[[Config], Config],
                     timer: Timer, log: Callable[[str], None] = lambda s: None, *,
                     prefer: Optional[Callable[[Config], Any]] = None,
                     tolerance: float = 0.0, confirm: int = 0) -> Outcome:
    """Time ``start``, then each stage's values for its key on the best config so far.

    ``check(config)`` returns the config to run or raises ``ValueError`` (a rejection);
    ``run(config)`` does the timed work once. The best is the fastest, or, with
    ``prefer``, the config with the smallest ``prefer(config)`` among those within
    ``tolerance`` (a fraction) of the fastest: a smaller memory budget, say, for a time
    within noise. Ties keep the earlier config. Raises ``RuntimeError`` if not even
    ``start`` ran.

    With ``confirm`` > 1, the ``confirm`` fastest configs are timed again at the end,
    in turns (A, B, C, A, B, C, ...: a GPU's clock drifting over the sweep then affects
    them alike), and each one's time becomes the median of all its timings before the
    final choice.
    """
    trials: list[Trial] = []
    best: Optional[Trial] = None
    seen: list[Config] = []

    def attempt(cfg: Config) -> None:
        nonlocal best
        if cfg in seen:
            return
        seen.append(cfg)
        trial = Trial(cfg)
        trials.append(trial)
        try:
            checked = check(cfg)
        except ValueError as e:
            trial.rejected = str(e)
            log(f"  rejected  {_brief(cfg)}: {e}")
            return
        try:
            trial.ms = timer(lambda: run(checked))
        except Exception as e:  # noqa: BLE001 - a candidate that raises is recorded, not fatal
            trial.failed = f"{type(e).__name__}: {e}"
            log(f"  failed    {_brief(cfg)}: {trial.failed}")
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return
        log(f"  {trial.ms:9.3f} ms {_brief(cfg)}")
        best = _choose(trials, prefer, tolerance)

    attempt(dict(start))
    for key, values in stages:
        base = dict(best.config) if best is not None else dict(start)
        for value in values:
            attempt(dict(base, **{key: value}))
    if best is None:
        raise RuntimeError("lmfuse tune: no candidate ran; see the rejections above")
    if confirm > 1:
        best = _confirm(trials, confirm, run, check, timer, log, prefer, tolerance)
    return Outcome(best.config, best.ms, trials)


def _confirm(trials, k, run, check, timer, log, prefer, tolerance) -> Trial:
    top = sorted((t for t in trials if t.ms is not None), key=lambda t: t.ms)[:k]
    times = {id(t): [t.ms] for t in top}
    for _ in range(3):
        for t in top:
            checked = check(t.config)
            times[id(t)].append(timer(lambda: run(checked)))
    for t in top:
        t.ms = statistics.median(times[id(t)])
        log(f"  confirmed {t.ms:9.3f} ms (median of {len(times[id(t)])}) {_brief(t.config)}")
    return _choose(top, prefer, tolerance)


def _choose(trials: list[Trial], prefer, tolerance: float) -> Trial:
    timed = [t for t in trials if t.ms is not None]
    fastest = min(timed, key=lambda t: t.ms)
    if prefer is None:
        return fastest
    near = [t for t in timed if t.ms <= fastest.ms * (1.0 + tolerance)]
    return min(near, key=lambda t: (prefer(t.config), t.ms))


def _brief(cfg: Config) -> str:
    return ", ".join(f"{k}={v}" for k, v in cfg.items())
