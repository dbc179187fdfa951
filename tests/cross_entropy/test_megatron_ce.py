"""``lmfuse.megatron``'s cross-entropy drop-ins on one rank (``tp_group=None``).

Each is compared, forward and backward, with Megatron-Core's formula written out by hand
in float64 (``tensor_parallel/cross_entropy.py``): ``nll = lse - x_t`` and, with label
smoothing, ``smoothing = label_smoothing * V / (V - 1)`` and
``loss = (1 - smoothing) * nll - smoothing * mean_j(log_softmax(x)_j)``. The functions run
the Triton kernels (``impl="auto"``, the interpreter here); the per-token losses are
float32 ``[s, b]``, the gradient is in the logits' dtype.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, ce_through_custom_ops, randn
from torch.utils._python_dispatch import TorchDispatchMode

from lmfuse import megatron

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
DTYPES = [pytest.param(d, id=str(d).replace("torch.", "")) for d in (F32, F16, BF16)]
SHAPES = [pytest.param((3, 2, 37), id="s3-b2-V37"), pytest.param((1, 1, 5), id="s1-b1-V5"),
          pytest.param((2, 3, 1000), id="s2-b3-V1000")]


def megatron_loss(logits: torch.Tensor, target: torch.Tensor,
                  label_smoothing: float) -> torch.Tensor:
    """Megatron-Core's per-token loss ``[s, b]``, in float64."""
    V = logits.shape[-1]
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    nll = -log_probs.gather(-1, target[..., None].long())[..., 0]
    if label_smoothing == 0:
        return nll
    smoothing = label_smoothing * V / (V - 1)
    return (1.0 - smoothing) * nll - smoothing * log_probs.mean(dim=-1)


def check(what: str, fn, shape: tuple[int, int, int], dtype: torch.dtype,
          label_smoothing: float) -> None:
    logits = randn(shape, dtype, scale=3.0)
    target = torch.randint(0, shape[-1], shape[:-1])
    grad_out = randn(shape[:-1])
    leaf = logits.clone().requires_grad_(True)
    loss = fn(leaf, target)
    loss.backward(grad_out)

    x64 = logits.double().requires_grad_(True)
    expected = megatron_loss(x64, target, label_smoothing)
    expected.backward(grad_out.double())

    assert loss.shape == shape[:-1] and loss.dtype == F32, f"{what}: {loss.dtype} {loss.shape}"
    assert_close(loss, expected.float(), F32, f"{what}: forward")
    assert leaf.grad.dtype == dtype
    assert_close(leaf.grad, x64.grad.to(dtype), dtype, f"{what}: d logits")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_vocab_parallel_cross_entropy(shape: tuple[int, int, int],
                                            dtype: torch.dtype) -> None:
    check(f"fused_vocab_parallel_cross_entropy {shape} {dtype}",
          lambda x, t: megatron.fused_vocab_parallel_cross_entropy(x, t, tp_group=None),
          shape, dtype, 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1, 0.4], ids=lambda s: f"ls{s}")
def test_vocab_parallel_cross_entropy(shape: tuple[int, int, int], dtype: torch.dtype,
                                      label_smoothing: float) -> None:
    check(f"vocab_parallel_cross_entropy ls={label_smoothing} {shape} {dtype}",
          lambda x, t: megatron.vocab_parallel_cross_entropy(x, t, label_smoothing),
          shape, dtype, label_smoothing)


def test_megatron_smoothing_differs_from_torch_smoothing() -> None:
    """Megatron's ls * V / (V - 1) is not F.cross_entropy's ls: the drop-in keeps Megatron's."""
    logits = randn((2, 2, 4), scale=2.0)
    target = torch.randint(0, 4, (2, 2))
    ours = megatron.vocab_parallel_cross_entropy(logits, target, 0.3)
    torch_style = torch.nn.functional.cross_entropy(
        logits.double().view(-1, 4), target.view(-1), label_smoothing=0.3, reduction="none")
    assert not torch.allclose(ours.double().view(-1), torch_style, rtol=1e-3)
    assert_close(ours, megatron_loss(logits, target, 0.3).float(), F32, "Megatron smoothing")


class _Names(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "lmfuse":
            self.names.append(func._schema.name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["fused_vocab_parallel_cross_entropy",
                                  "vocab_parallel_cross_entropy"])
def test_runs_the_triton_kernels(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ce_through_custom_ops(monkeypatch)
    logits = randn((2, 3, 9), requires_grad=True)
    target = torch.randint(0, 9, (2, 3))
    with _Names() as rec:
        getattr(megatron, name)(logits, target).sum().backward()
    assert rec.names == ["lmfuse::ce_stats", "lmfuse::ce_grad"], rec.names


@pytest.mark.parametrize("call, error, message", [
    pytest.param(lambda x, t: megatron.vocab_parallel_cross_entropy(x, t, 0.99), ValueError,
                 r"^vocab_parallel_cross_entropy: label_smoothing=0.99 gives Megatron's "
                 r"smoothing = ls \* V / \(V - 1\) = 1.2375 > 1 at V = 5", id="smoothing>1"),
    pytest.param(lambda x, t: megatron.vocab_parallel_cross_entropy(x[..., :1], t * 0, 0.1),
                 ValueError, r"^vocab_parallel_cross_entropy: label smoothing needs a "
                 r"vocabulary of at least 2, got V = 1", id="V1-smoothing"),
    pytest.param(lambda x, t: megatron.vocab_parallel_cross_entropy(x, t, "0.1"), TypeError,
                 r"^vocab_parallel_cross_entropy: label_smoothing must be a float, got str",
                 id="ls-str"),
    pytest.param(lambda x, t: megatron.vocab_parallel_cross_entropy(x, t, True), TypeError,
                 r"^vocab_parallel_cross_entropy: label_smoothing must be a float, got bool",
                 id="ls-bool"),
    pytest.param(lambda x, t: megatron.fused_vocab_parallel_cross_entropy(x, t.float()),
                 TypeError, r"^cross_entropy: target must have dtype", id="target-float"),
    pytest.param(lambda x, t: megatron.fused_vocab_parallel_cross_entropy(x, t[:1]),
                 ValueError, r"^cross_entropy: target must have shape", id="target-shape"),
])
def test_bad_input_raises(call, error: type[Exception], message: str) -> None:
    logits = randn((2, 3, 5))
    target = torch.randint(0, 5, (2, 3))
    with pytest.raises(error, match=message):
        call(logits, target)


def test_label_smoothing_zero_on_one_class() -> None:
    """V = 1 without smoothing: every token's loss and gradient are 0."""
    leaf = randn((2, 3, 1), requires_grad=True)
    loss = megatron.vocab_parallel_cross_entropy(leaf, torch.zeros(2, 3, dtype=torch.long))
    loss.sum().backward()
    assert torch.equal(loss, torch.zeros(2, 3))
    assert torch.equal(leaf.grad, torch.zeros(2, 3, 1))


@pytest.mark.parametrize("name", ["fused_vocab_parallel_cross_entropy",
                                  "vocab_parallel_cross_entropy"])
def test_targets_outside_the_vocabulary_are_ignored(name: str) -> None:
    """Padding labels (-1, -100, V and past it): loss 0 and a zero gradient row, so that the
    loss mask of 0 they come with gives 0 as Megatron's log-sum-exp there does (lmfuse's
    cross_entropy raises on CPU and gives +inf on CUDA, NaN under that mask); the other
    tokens keep Megatron's loss."""
    shape = (3, 2, 37)
    logits = randn(shape, F32, scale=3.0)
    target = torch.randint(0, 37, shape[:-1])
    target[0, 1], target[1, 0], target[2, 0], target[2, 1] = -1, -100, 37, 1000
    outside = (target < 0) | (target >= 37)
    leaf = logits.clone().requires_grad_(True)
    loss = getattr(megatron, name)(leaf, target)
    loss.backward(torch.ones(shape[:-1]))
    assert torch.equal(loss[outside], torch.zeros(4))
    assert torch.equal(leaf.grad[outside], torch.zeros(4, 37))
    want = megatron_loss(logits.double(), target.clamp(0, 36), 0.0)
    assert_close(loss[~outside], want[~outside].float(), F32, name)
    mask = (~outside).float()
    assert torch.isfinite((loss * mask).sum())
