"""``lmfuse/_collectives.py`` (re-exported by ``lmfuse.distributed.collectives``): under
``TORCH_NCCL_BLOCKING_WAIT=1`` every collective is issued with ``async_op=True`` and waited
on (so that a timed-out NCCL collective raises on the waiting rank;
``tests/gpu/faults_nccl.py``), otherwise it is one plain synchronous call."""

from __future__ import annotations

from typing import Any

import pytest

from lmfuse import _collectives as collectives


class Recorder:
    """A stand-in collective: records its keyword arguments and whether its work was
    waited on."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.waited = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        recorder = self

        class Work:
            def wait(self) -> bool:
                recorder.waited += 1
                return True

        return Work() if kwargs.get("async_op") else None


@pytest.mark.parametrize("value, waited", [(None, False), ("0", False), ("1", True),
                                           ("true", True)])
def test_collectives_wait_on_their_work_under_blocking_wait(monkeypatch, value, waited) -> None:
    if value is None:
        monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", value)
    fn = Recorder()
    collectives._issue(fn, "out", "in", group="g")
    assert fn.calls == [dict(group="g", async_op=True) if waited else dict(group="g")]
    assert fn.waited == (1 if waited else 0)


def test_a_failed_wait_raises_to_the_caller(monkeypatch) -> None:
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")

    class Broken:
        def wait(self) -> None:
            raise RuntimeError("collective timed out")

    with pytest.raises(RuntimeError, match="collective timed out"):
        collectives._issue(lambda *a, **k: Broken(), group=None)


def test_the_distributed_name_reexports_the_same_functions() -> None:
    # Outside code and the benchmarks import lmfuse.distributed.collectives; the families
    # call lmfuse._collectives: both names must be the same functions.
    from lmfuse.distributed import collectives as public

    for name in public.__all__:
        assert getattr(public, name) is getattr(collectives, name), name


def test_the_agreement_check_runs_once_per_live_group(monkeypatch) -> None:
    # Keyed by the group object, held weakly: a group destroyed and a new one created at its
    # address (or under its name, which c10d reuses after destroy_process_group) must be
    # checked again, not skipped as the old one's key (an id) once made it.
    import gc

    import torch

    gathers: list[Any] = []

    def gather(t: torch.Tensor, group: Any) -> torch.Tensor:
        gathers.append(group)
        return torch.stack([t, t])  # two ranks that agree

    class Group:  # a stand-in ProcessGroup (weakly referenceable, as c10d's are)
        pass

    monkeypatch.setattr(collectives, "all_gather_stacked", gather)
    monkeypatch.setattr(collectives, "_AGREED", type(collectives._AGREED)())
    cpu = torch.device("cpu")
    first, second = Group(), Group()
    for _ in range(3):
        collectives.check_agreed_once("op", first, cpu, tokens=4)
    collectives.check_agreed_once("other op", first, cpu, tokens=4)
    collectives.check_agreed_once("op", second, cpu, tokens=4)
    assert gathers == [first, first, second]
    del first, gathers[:]
    gc.collect()
    assert list(collectives._AGREED.keys()) == [second]  # the dead group's entry went with it
