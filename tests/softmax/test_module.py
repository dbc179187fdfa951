"""``lmfuse.FusedScaleMaskSoftmax`` and ``AttnMaskType`` / ``as_mask_type`` (``softmax/module.py``).

The module must behave like Megatron-Core's: same constructor, ``forward(input, mask)``,
mask True = masked out, ``causal`` / ``padding_causal`` add the causal band. The oracle
is a plain float32 ``torch.softmax`` over ``masked_fill(-inf)`` scores, forward and
backward. The fused (Triton) backward reads the output it saved, rounded to the dtype, so
in the half types its gradient is checked against the backward formula evaluated on the
module's own output (see ``fused_softmax_backward_reference``); the unfused path is plain
autograd and is checked against float32 autograd.
"""

from __future__ import annotations

import copy
import enum
from typing import Callable

import pytest
import torch
from helpers import assert_close, rand_bool, randn
from torch import nn

import lmfuse
from lmfuse.softmax import module as module_mod
from lmfuse.softmax import ops
from lmfuse.softmax.module import AttnMaskType, FusedScaleMaskSoftmax, as_mask_type
from lmfuse.softmax.reference import fused_softmax_backward_reference

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = [pytest.param(d, id=str(d).replace("torch.", "")) for d in (F32, F16, BF16)]
FUSION = [pytest.param(True, id="fused"), pytest.param(False, id="unfused")]


def make_module(mask_type, *, fusion: bool = True, dtype: torch.dtype = F32,
                scale: float | None = None, **kwargs) -> FusedScaleMaskSoftmax:
    """Constructed exactly as Megatron-Core's attention builds its softmax."""
    return FusedScaleMaskSoftmax(
        input_in_fp16=dtype == F16,
        input_in_bf16=dtype == BF16,
        attn_mask_type=mask_type,
        scaled_masked_softmax_fusion=fusion,
        mask_func=None,
        softmax_in_fp32=True,
        scale=scale,
        **kwargs,
    )


def causal_hidden(sq: int, sk: int) -> torch.Tensor:
    """``[sq, sk]`` True above the (bottom-right aligned) diagonal: keys a row cannot see."""
    return torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1)


def band_hidden(sq: int, sk: int, left: int, right: int) -> torch.Tensor:
    """``[sq, sk]`` True outside keys ``p - left .. p + right`` with ``p = i + sk - sq``."""
    p = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    return (j < p - left) | (j > p + right)


def plain_softmax(x32: torch.Tensor, scale: float, hidden: torch.Tensor | None) -> torch.Tensor:
    """float32 ``softmax(scale * x)`` with hidden keys at -inf; a row hiding every key is 0."""
    z = x32 * scale
    if hidden is None:
        return torch.softmax(z, dim=-1)
    hidden = hidden.expand_as(z)
    dead = hidden.all(dim=-1, keepdim=True)
    # Leave dead rows unmasked inside softmax (no NaN, even in the backward), then zero them.
    z = z.masked_fill(hidden & ~dead, float("-inf"))
    return torch.softmax(z, dim=-1).masked_fill(dead, 0.0)


# (id, mask type, [b, np, sq, sk], mask shape or None, scale)
CASES = [
    ("causal", AttnMaskType.causal, (2, 2, 5, 5), None, 0.5),
    ("causal-sq<sk", AttnMaskType.causal, (1, 2, 3, 7), None, None),
    ("padding-b11k", AttnMaskType.padding, (2, 3, 4, 6), "b11k", 0.7),
    ("padding-b1qk", AttnMaskType.padding, (2, 2, 4, 6), "b1qk", 1.3),
    ("padding-no-mask", AttnMaskType.padding, (1, 2, 3, 5), None, 0.9),
    ("padding_causal-b11k", AttnMaskType.padding_causal, (2, 2, 5, 5), "b11k", 0.6),
    ("no_mask", AttnMaskType.no_mask, (1, 3, 2, 7), None, 2.0),
    ("arbitrary-b1qk", AttnMaskType.arbitrary, (2, 1, 4, 5), "b1qk", None),
]


def make_mask(kind: str | None, b: int, sq: int, sk: int) -> torch.Tensor | None:
    if kind is None:
        return None
    return rand_bool((b, 1, 1, sk) if kind == "b11k" else (b, 1, sq, sk))


def expected_hidden(mask_type: AttnMaskType, mask: torch.Tensor | None, sq: int,
                    sk: int) -> torch.Tensor | None:
    hidden = None
    if mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal):
        hidden = causal_hidden(sq, sk)
    if mask is not None:
        hidden = mask if hidden is None else hidden | mask
    return hidden


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fusion", FUSION)
@pytest.mark.parametrize("case_id, mask_type, shape, mask_kind, scale", CASES,
                         ids=[c[0] for c in CASES])
def test_matches_plain_float32_softmax(case_id: str, mask_type: AttnMaskType,
                                       shape: tuple[int, int, int, int], mask_kind: str | None,
                                       scale: float | None, fusion: bool,
                                       dtype: torch.dtype) -> None:
    what = f"{case_id} {'fused' if fusion else 'unfused'} {dtype}"
    b, np_, sq, sk = shape
    softmax = make_module(mask_type, fusion=fusion, dtype=dtype, scale=scale)
    x = randn(shape, dtype, scale=2.0, requires_grad=True)
    mask = make_mask(mask_kind, b, sq, sk)
    grad = randn(shape, dtype)

    y = softmax(x, mask)
    y.backward(grad)

    s = 1.0 if scale is None else scale
    hidden = expected_hidden(mask_type, mask, sq, sk)
    x32 = x.detach().float().requires_grad_(True)
    y32 = plain_softmax(x32, s, hidden)
    y32.backward(grad.float())

    assert y.dtype == dtype and y.shape == shape, f"{what}: got {y.dtype} {tuple(y.shape)}"
    assert_close(y, y32.to(dtype), dtype, f"{what}: forward vs plain float32 softmax")
    if fusion and dtype != F32:
        # The fused backward reads y as stored (rounded to dtype): its oracle is the
        # softmax-backward formula on that same y.
        expected_dx = (s * fused_softmax_backward_reference(y.detach().double(), grad)).to(dtype)
    else:
        expected_dx = x32.grad.to(dtype)
    assert x.grad.dtype == dtype
    assert_close(x.grad, expected_dx, dtype, f"{what}: d input")

    # The functional op, same arguments, same path: bitwise the same answer.
    causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
    same = lmfuse.fused_softmax(x.detach(), scale=scale, mask=mask, causal=causal,
                                impl="auto" if fusion else "torch")
    assert torch.equal(y.detach(), same), f"{what}: differs from fused_softmax on the same path"

    if hidden is not None:
        hid = hidden.expand(shape)
        zeros = torch.zeros(int(hid.sum()), dtype=dtype)
        assert torch.equal(y.detach()[hid], zeros), f"{what}: y != 0 where masked"
        assert torch.equal(x.grad[hid], zeros), f"{what}: d input != 0 where masked"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fusion", FUSION)
def test_fully_masked_row_is_zeros_not_uniform(fusion: bool, dtype: torch.dtype) -> None:
    # Megatron's mask_func fill of -10000 would give a uniform row here; lmfuse is exact.
    softmax = make_module(AttnMaskType.padding, fusion=fusion, dtype=dtype, scale=0.5)
    x = randn((2, 2, 3, 6), dtype, requires_grad=True)
    mask = torch.zeros(2, 1, 3, 6, dtype=torch.bool)
    mask[0, :, 1] = True
    mask[1] = True
    y = softmax(x, mask)
    y.backward(randn(y.shape, dtype))
    dead = mask.expand_as(y)
    assert torch.equal(y.detach()[dead], torch.zeros(int(dead.sum()), dtype=dtype))
    assert torch.equal(x.grad[dead], torch.zeros(int(dead.sum()), dtype=dtype))
    live = y.detach()[0, :, 0].float().sum(-1)
    assert torch.allclose(live, torch.ones_like(live), atol=1e-2), "a live row lost its mass"


# --- which path runs -------------------------------------------------------------------


class LaunchCounter:
    """Wraps ``ops._launch_fwd`` (the Triton forward launcher) and counts its calls."""

    def __init__(self, real: Callable) -> None:
        self.real, self.calls = real, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.real(*args, **kwargs)


def test_fusion_false_takes_the_torch_reference_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_triton(*args, **kwargs):
        raise AssertionError("the Triton kernel was launched with fusion=False")

    monkeypatch.setattr(ops, "_launch_fwd", no_triton)
    softmax = make_module(AttnMaskType.causal, fusion=False, scale=0.8)
    assert softmax.impl == "torch"
    x = randn((1, 2, 4, 4), requires_grad=True)
    y = softmax(x, None)
    y.sum().backward()
    assert torch.equal(y, lmfuse.fused_softmax(x, scale=0.8, causal=True, impl="torch"))
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_fusion_true_launches_the_triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    counter = LaunchCounter(ops._launch_fwd)
    monkeypatch.setattr(ops, "_launch_fwd", counter)
    softmax = make_module(AttnMaskType.padding, fusion=True, scale=0.8)
    assert softmax.impl == "auto"
    x = randn((1, 2, 3, 5))
    mask = rand_bool((1, 1, 1, 5))
    y = softmax(x, mask)
    assert counter.calls == 1
    assert torch.equal(y, lmfuse.fused_softmax(x, scale=0.8, mask=mask, impl="triton"))


def test_module_passes_its_arguments_to_fused_softmax(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def spy(scores, **kwargs):
        seen.update(kwargs)
        return scores

    monkeypatch.setattr(module_mod, "fused_softmax", spy)
    offset = randn((2,))
    mask = rand_bool((1, 1, 3, 5))
    softmax = make_module(AttnMaskType.padding_causal, fusion=False, scale=0.25,
                          window_size=[3, 0])
    softmax(randn((1, 2, 3, 5)), mask, offset)
    assert seen == dict(scale=0.25, mask=mask, causal=True, window_size=(3, 0),
                        softmax_offset=offset, softmax_in_fp32=True, impl="torch")


# --- Megatron-Core's arguments -----------------------------------------------------------


@pytest.mark.parametrize("fusion", FUSION)
def test_mask_func_is_accepted_and_never_called(fusion: bool) -> None:
    # module.py documents mask_func as "accepted for compatibility and not called":
    # masking is exact (-inf), so Megatron's attention_mask_func (fill -10000) is not used.
    def mask_func(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        raise AssertionError("mask_func was called")

    softmax = FusedScaleMaskSoftmax(False, False, AttnMaskType.padding, fusion, mask_func,
                                    True, 0.5)
    assert softmax.mask_func is mask_func
    x = randn((2, 2, 3, 5), requires_grad=True)
    mask = rand_bool((2, 1, 3, 5))
    mask[..., 0] = False  # no dead rows, so the plain oracle needs no special case
    y = softmax(x, mask)
    y.sum().backward()
    expected = plain_softmax(x.detach(), 0.5, mask)
    assert_close(y, expected, F32, "mask_func given: forward")


@pytest.mark.parametrize("fusion", FUSION)
def test_scale_with_softmax_in_fp32_false_is_accepted(fusion: bool) -> None:
    # Megatron asserts "softmax should be in fp32 when scaled"; lmfuse always computes in
    # float32, so the flag changes nothing and the combination is allowed.
    kwargs = dict(input_in_fp16=True, input_in_bf16=False, attn_mask_type=AttnMaskType.causal,
                  scaled_masked_softmax_fusion=fusion, mask_func=None, scale=0.3)
    low = FusedScaleMaskSoftmax(softmax_in_fp32=False, **kwargs)
    high = FusedScaleMaskSoftmax(softmax_in_fp32=True, **kwargs)
    x = randn((1, 2, 4, 6), F16)
    y = low(x, None)
    assert torch.equal(y, high(x, None))
    assert_close(y, plain_softmax(x.float(), 0.3, causal_hidden(4, 6)).to(F16), F16,
                 "softmax_in_fp32=False + scale: forward")


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_flags_do_not_restrict_the_input_dtype(dtype: torch.dtype) -> None:
    # Megatron's flags pick a kernel; here the dtype is read from the input.
    softmax = make_module(AttnMaskType.causal, dtype=F32, scale=0.5)
    assert not softmax.input_in_float16
    x = randn((1, 2, 3, 4), dtype)
    y = softmax(x, None)
    assert y.dtype == dtype
    assert_close(y, plain_softmax(x.float(), 0.5, causal_hidden(3, 4)).to(dtype), dtype,
                 f"flags fp32, input {dtype}")


@pytest.mark.parametrize("fp16, bf16, half", [(True, False, True), (False, True, True),
                                              (False, False, False)],
                         ids=["fp16", "bf16", "fp32"])
def test_input_in_float16_attribute(fp16: bool, bf16: bool, half: bool) -> None:
    softmax = FusedScaleMaskSoftmax(fp16, bf16, "causal", True, None, True, None)
    assert (softmax.input_in_fp16, softmax.input_in_bf16) == (fp16, bf16)
    assert softmax.input_in_float16 is half


@pytest.mark.parametrize("fusion", FUSION)
@pytest.mark.parametrize("window, left, right", [
    pytest.param((2, 0), 2, 0, id="(2,0)"),
    pytest.param([1, 1], 1, 1, id="list[1,1]"),
    pytest.param(2, 2, 0, id="int2"),
    pytest.param((-1, 1), 100, 1, id="(-1,1)"),
])
def test_window_size(window, left: int, right: int, fusion: bool) -> None:
    softmax = make_module(AttnMaskType.padding, fusion=fusion, scale=0.9, window_size=window)
    assert softmax.window_size == (tuple(window) if isinstance(window, list) else window)
    x = randn((1, 2, 5, 6), requires_grad=True)
    mask = rand_bool((1, 1, 1, 6), p_true=0.2)
    grad = randn(x.shape)
    y = softmax(x, mask)
    y.backward(grad)
    x32 = x.detach().clone().requires_grad_(True)
    y32 = plain_softmax(x32, 0.9, band_hidden(5, 6, left, right) | mask)
    y32.backward(grad)
    assert_close(y, y32, F32, f"window {window}: forward")
    assert_close(x.grad, x32.grad, F32, f"window {window}: d input")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fusion", FUSION)
def test_softmax_offset(fusion: bool, dtype: torch.dtype) -> None:
    softmax = make_module(AttnMaskType.causal, fusion=fusion, dtype=dtype, scale=0.7)
    x = randn((2, 3, 4, 5), dtype, requires_grad=True)
    offset = randn((3,), dtype, requires_grad=True)
    grad = randn(x.shape, dtype)
    y = softmax(x, None, offset)
    y.backward(grad)

    # float32 oracle: the sink is one more logit per row whose probability is dropped.
    x32 = x.detach().float().requires_grad_(True)
    o32 = offset.detach().float().requires_grad_(True)
    z = (x32 * 0.7).masked_fill(causal_hidden(4, 5), float("-inf"))
    sink = o32.view(1, 3, 1, 1).expand(2, 3, 4, 1)
    y32 = torch.softmax(torch.cat([z, sink], dim=-1), dim=-1)[..., :-1]
    y32.backward(grad.float())

    what = f"softmax_offset {'fused' if fusion else 'unfused'} {dtype}"
    assert_close(y, y32.to(dtype), dtype, f"{what}: forward")
    assert offset.grad is not None and offset.grad.dtype == dtype
    if fusion and dtype != F32:
        expected_dx = (0.7 * fused_softmax_backward_reference(y.detach().double(), grad))
        assert_close(x.grad, expected_dx.to(dtype), dtype, f"{what}: d input")
    else:
        assert_close(x.grad, x32.grad.to(dtype), dtype, f"{what}: d input")
        assert_close(offset.grad, o32.grad.to(dtype), dtype, f"{what}: d softmax_offset")


# --- AttnMaskType and as_mask_type -----------------------------------------------------


class MegatronAttnMaskType(enum.Enum):
    """A stand-in for ``megatron.core.transformer.enums.AttnMaskType`` (same names)."""

    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5
    causal_bottom_right = 6


def test_attn_mask_type_mirrors_megatron() -> None:
    assert {m.name: m.value for m in AttnMaskType} == {
        "padding": 1, "causal": 2, "no_mask": 3, "padding_causal": 4, "arbitrary": 5,
        "causal_bottom_right": 6}
    assert lmfuse.AttnMaskType is AttnMaskType
    assert lmfuse.FusedScaleMaskSoftmax is FusedScaleMaskSoftmax


def test_attn_mask_type_equals_megatron_cores_enum() -> None:
    """The whole enum against the installed megatron-core's (a test dependency)."""
    enums = pytest.importorskip("megatron.core.transformer.enums")
    assert {m.name: m.value for m in AttnMaskType} == {
        m.name: m.value for m in enums.AttnMaskType}
    for member in enums.AttnMaskType:
        assert as_mask_type(member) is AttnMaskType[member.name]


def test_causal_bottom_right_is_the_bottom_right_causal_band() -> None:
    x = randn((2, 3, 4, 6))
    got = make_module(AttnMaskType.causal_bottom_right, scale=1.0)(x, None)
    assert torch.equal(got, make_module(AttnMaskType.causal, scale=1.0)(x, None))
    assert torch.equal(got[0, 0][causal_hidden(4, 6)], torch.zeros(int(causal_hidden(4, 6).sum())))


@pytest.mark.parametrize("fusion", [True, False])
def test_is_kernel_available_any_shape(fusion: bool) -> None:
    """Megatron's check (fp16/bf16, 16 < sk <= 4096, multiples of 4) does not apply: with
    fusion on and Triton able to run (the interpreter here), every shape takes the kernel."""
    softmax = make_module(AttnMaskType.causal, fusion=fusion)
    for b, np_, sq, sk in ((1, 1, 1, 1), (3, 5, 7, 9), (2, 4, 16, 8192)):
        assert softmax.is_kernel_available(None, b, np_, sq, sk) is fusion
        assert softmax.is_kernel_available(torch.zeros(1, 1, sq, sk, dtype=torch.bool), b,
                                           np_, sq, sk) is fusion


@pytest.mark.parametrize("member", list(AttnMaskType), ids=lambda m: m.name)
def test_as_mask_type_accepts_enum_foreign_enum_and_name(member: AttnMaskType) -> None:
    assert as_mask_type(member) is member
    assert as_mask_type(MegatronAttnMaskType[member.name]) is member
    assert as_mask_type(member.name) is member
    softmax = make_module(MegatronAttnMaskType[member.name])
    assert softmax.attn_mask_type is member


def test_megatron_enum_member_drives_the_causal_band() -> None:
    x = randn((1, 1, 3, 3))
    y = make_module(MegatronAttnMaskType.causal, scale=1.0)(x, None)
    assert torch.equal(y, make_module(AttnMaskType.causal, scale=1.0)(x, None))
    assert torch.equal(y[0, 0][causal_hidden(3, 3)], torch.zeros(3))


class OtherEnum(enum.Enum):
    sliding = 1


@pytest.mark.parametrize("value", ["bogus", "Causal", "", 2, None, OtherEnum.sliding],
                         ids=repr)
def test_unknown_mask_type_raises_naming_the_argument(value) -> None:
    with pytest.raises(ValueError, match=r"attn_mask_type must be one of .*padding.*causal"):
        as_mask_type(value)
    with pytest.raises(ValueError, match=r"^FusedScaleMaskSoftmax: attn_mask_type") as exc:
        make_module(value)
    assert repr(value) in str(exc.value)


# --- bad arguments -----------------------------------------------------------------------


def test_fp16_and_bf16_both_true_raises() -> None:
    with pytest.raises(ValueError, match=r"^FusedScaleMaskSoftmax: input_in_fp16 and "
                                         r"input_in_bf16 cannot both be True"):
        FusedScaleMaskSoftmax(True, True, AttnMaskType.causal, True, None, True, None)


@pytest.mark.parametrize("fusion", FUSION)
@pytest.mark.parametrize("kwargs, error, message", [
    pytest.param(dict(scale="0.5"), TypeError, r"scale must be a float, got str", id="scale-str"),
    pytest.param(dict(scale=float("nan")), ValueError, r"scale must be finite", id="scale-nan"),
    pytest.param(dict(window_size=(-3, 0)), ValueError, r"window_size\[left\] must be >= -1",
                 id="window-neg"),
    pytest.param(dict(window_size=2.5), TypeError, r"window_size must be None", id="window-float"),
])
def test_bad_scale_or_window_raises_at_forward_naming_it(kwargs, error, message,
                                                         fusion: bool) -> None:
    args = dict(scale=None)
    args.update(kwargs)
    softmax = make_module(AttnMaskType.padding, fusion=fusion, **args)
    with pytest.raises(error, match=rf"^fused_softmax: {message}"):
        softmax(randn((1, 1, 2, 3)), None)


@pytest.mark.parametrize("fusion", FUSION)
@pytest.mark.parametrize("make_input, mask, offset, error, message", [
    pytest.param(lambda: randn((2, 3, 4)), None, None, ValueError,
                 r"input must be 4-D, got 3-D with shape \(2, 3, 4\)", id="input-3d"),
    pytest.param(lambda: [[[[1.0]]]], None, None, TypeError,
                 r"input must be a torch.Tensor, got list", id="input-list"),
    pytest.param(lambda: torch.ones(1, 2, 3, 4, dtype=torch.int32), None, None, TypeError,
                 r"input must have dtype in \(.*\), got torch.int32", id="input-int"),
    pytest.param(lambda: randn((1, 2, 3, 4)), rand_bool((1, 1, 3, 5)), None, ValueError,
                 r"mask of shape \(1, 1, 3, 5\) is not broadcastable to input \(1, 2, 3, 4\); "
                 r"expected \[b\|1, np\|1, sq\|1, sk\|1\] with \[b, np, sq, sk\] = "
                 r"\[1, 2, 3, 4\]", id="mask-shape"),
    pytest.param(lambda: randn((1, 2, 3, 4)), rand_bool((2, 1, 3, 4)), None, ValueError,
                 r"mask of shape \(2, 1, 3, 4\) is not broadcastable to input", id="mask-batch"),
    pytest.param(lambda: randn((1, 2, 3, 4)), torch.ones(1, 1, 3, 4, dtype=torch.int64), None,
                 TypeError, r"mask must be bool .* got torch.int64", id="mask-int"),
    pytest.param(lambda: randn((1, 2, 3, 4)), None, randn((3,)), ValueError,
                 r"softmax_offset must have shape \[np\] = \[2\], got \(3,\) \(input is "
                 r"\[1, 2, 3, 4\]\)", id="sink-length"),
    pytest.param(lambda: randn((1, 2, 5, 4)), None, None, ValueError,
                 r"attn_mask_type=causal needs input \[b, np, sq, sk\] with sq <= sk .* got "
                 r"\[1, 2, 5, 4\]", id="causal-sq>sk"),
])
def test_bad_forward_input_raises_naming_the_argument(make_input, mask, offset, error,
                                                      message, fusion: bool) -> None:
    """The module's own argument names (input, mask, softmax_offset), the shape or dtype
    seen and the one expected."""
    softmax = make_module(AttnMaskType.causal, fusion=fusion)
    with pytest.raises(error, match=rf"^FusedScaleMaskSoftmax: {message}"):
        softmax(make_input(), mask, offset)


# --- as an nn.Module ---------------------------------------------------------------------


class TinyAttention(nn.Module):
    """One attention head block, the way Megatron's CoreAttention uses the softmax."""

    def __init__(self, dim: int, heads: int, softmax: nn.Module) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.softmax = softmax

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, d = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        probs = self.softmax(q @ k.transpose(-1, -2), mask)  # [b, np, s, s]
        return self.out((probs @ v).transpose(1, 2).reshape(b, s, d))


class PlainSoftmax(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        s = scores.shape[-1]
        return plain_softmax(scores, self.scale, causal_hidden(s, s))


def test_works_as_a_submodule_forward_and_backward() -> None:
    torch.manual_seed(0)
    scale = 0.5
    fused = TinyAttention(8, 2, make_module(AttnMaskType.causal, scale=scale))
    plain = copy.deepcopy(fused)
    plain.softmax = PlainSoftmax(scale)
    model = nn.Sequential(nn.Linear(8, 8), fused)
    ref_model = nn.Sequential(copy.deepcopy(model[0]), plain)

    # A parameter-free module: it adds nothing to state_dict or the optimiser.
    assert isinstance(fused.softmax, nn.Module)
    assert list(fused.softmax.parameters()) == [] and fused.softmax.state_dict() == {}
    assert "1.softmax" in dict(model.named_modules())
    assert "attn_mask_type=causal" in repr(model) and "impl=auto" in repr(model)

    h = randn((2, 5, 8))
    out, ref = model(h), ref_model(h)
    assert_close(out, ref, F32, "attention block: forward")
    out.square().sum().backward()
    ref.square().sum().backward()
    for (name, p), (_, p_ref) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert p.grad is not None, f"{name}: no gradient"
        assert_close(p.grad, p_ref.grad, F32, f"attention block: d {name}")

    # train()/eval() and deepcopy leave the behaviour unchanged (no dropout inside).
    model.eval()
    assert torch.equal(model(h), out.detach())
    clone = copy.deepcopy(model)
    assert torch.equal(clone(h), out.detach())


def test_extra_repr_names_the_configuration() -> None:
    text = repr(make_module("padding_causal", fusion=False, scale=0.125, window_size=(4, 0)))
    assert text.startswith("FusedScaleMaskSoftmax(")
    for part in ("attn_mask_type=padding_causal", "scale=0.125", "window_size=(4, 0)",
                 "impl=torch"):
        assert part in text, f"{part!r} not in {text!r}"
