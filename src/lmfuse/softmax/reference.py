"""The specification of fused scale → mask → softmax, in plain PyTorch (float32 math).

It is the CPU path, the test oracle and the definition the Triton kernels are read
against. For ``scores [b, np, sq, sk]`` and a query row ``i`` whose position among the
keys is ``p = i + (sk - sq)`` (bottom-right alignment, so chunked prefill with
``sq < sk`` works), key ``j`` is *visible* when

* ``j >= p - left`` (when ``left`` is bounded; a window of ``w`` keys back),
* ``j <= p + right`` (when ``right`` is bounded; ``causal`` means ``right = 0``),
* and the boolean ``mask`` is False there (True = masked out, Megatron's convention).

Then ``z = scale * scores + additive_mask`` over visible keys, and

    y_j = exp(z_j) / (sum_visible exp(z_k) + exp(offset_h))       (offset term optional)

Invisible keys get 0; a row with no visible key is all zeros (never NaN).

Non-finite values behave as in PyTorch's ``softmax(z.masked_fill(hidden, -inf))`` (with the
sink as one more logit), except that hidden keys stay exact zeros:

* a NaN or ``+inf`` among a row's visible logits, or a NaN or ``+inf`` sink, makes every
  visible output of the row NaN (``exp(inf - inf)``), and its gradients NaN;
* ``-inf`` logits (a score or an additive mask of ``-inf``) get probability 0, and a row of
  nothing but ``-inf`` logits is all zeros, like a fully masked one;
* hidden keys (outside the band, or True in the boolean mask) never read their score: a NaN
  there changes nothing, their output is 0 and their gradient 0, even in a NaN row. An
  additive mask hides nothing: ``NaN + (-inf)`` is NaN, as in PyTorch.
"""

from __future__ import annotations

import torch

# A bound this large never clips a key index; it stands for "unbounded" in (left, right).
UNBOUNDED = 1 << 30


def visible_keys(sq: int, sk: int, left: int, right: int, device: torch.device) -> torch.Tensor:
    """``[sq, sk]`` bool, True where the (left, right) band lets query row i see key j."""
    p = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    return (j >= p - left) & (j <= p + right)


def fused_softmax_reference(
    scores: torch.Tensor,
    *,
    scale: float = 1.0,
    mask: torch.Tensor | None = None,
    left: int = UNBOUNDED,
    right: int = UNBOUNDED,
    softmax_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference scale-mask-softmax over the last dim of ``scores [b, np, sq, sk]``.

    ``left``/``right`` are the resolved band bounds (see the module docstring);
    ``mask`` is bool (True = masked) or an additive float mask, broadcastable to
    ``scores``; ``softmax_offset [np]`` adds ``exp(offset_h)`` to each denominator.
    Math runs in float32 (float64 for float64 input); the result has ``scores.dtype``.
    Differentiable in ``scores``, a float ``mask`` and ``softmax_offset``.
    """
    compute = torch.float64 if scores.dtype == torch.float64 else torch.float32
    b, np_, sq, sk = scores.shape
    z = scores.to(compute) * scale
    hidden = torch.zeros(1, 1, sq, sk, dtype=torch.bool, device=scores.device)
    if left < UNBOUNDED or right < UNBOUNDED:
        hidden = hidden | ~visible_keys(sq, sk, left, right, scores.device)
    if mask is not None and mask.dtype == torch.bool:
        hidden = hidden | mask
    elif mask is not None:
        z = z + mask.to(compute)
    z = z.masked_fill(hidden, float("-inf"))

    row_max = z.amax(dim=-1, keepdim=True) if sk > 0 else z.new_full((b, np_, sq, 1), -torch.inf)
    if softmax_offset is not None:
        sink = softmax_offset.to(compute).view(1, np_, 1, 1)
        row_max = torch.maximum(row_max, sink)
    # A row with nothing visible has max -inf; shifting by 0 keeps exp() at 0, not NaN. A
    # NaN or +inf max stays: exp(z - shift) then makes the row NaN, as torch.softmax does.
    shift = torch.where(row_max == -torch.inf, torch.zeros_like(row_max), row_max).detach()
    e = torch.exp(z - shift)
    denom = e.sum(dim=-1, keepdim=True)
    if softmax_offset is not None:
        denom = denom + torch.exp(sink - shift)
    # denom == 0 only where every e is 0: the row is all zeros, and so is its gradient. A
    # NaN denom (a NaN or +inf logit) is kept.
    y = e / torch.where(denom == 0, torch.ones_like(denom), denom)
    # Hidden keys are exact zeros, even in a NaN row (0 / NaN would be NaN).
    y = y.masked_fill(hidden, 0.0)
    return y.to(scores.dtype)


def fused_softmax_backward_reference(y: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The backward of :func:`fused_softmax_reference` as the fused path computes it.

    Returns ``g = d loss / d z = y * (grad - sum(grad * y))`` for ``z = scale * scores +
    mask`` in float32 (float64 for float64), computed from the *saved output* ``y`` as
    stored, in its own dtype: that is what a fused backward reads (it never keeps the
    scores), so for bfloat16/float16 it differs from exact autograd by the rounding of
    ``y``. ``d scores = scale * g``, a learnable additive mask gets ``g`` summed to its
    shape, and ``d offset_h = -sum over rows of p_sink * sum(grad * y)``. ``g`` is exactly 0
    where ``y`` is 0.
    """
    compute = torch.float64 if y.dtype == torch.float64 else torch.float32
    y_c, g_c = y.to(compute), grad.to(compute)
    g = y_c * (g_c - (y_c * g_c).sum(dim=-1, keepdim=True))
    # Where y is 0 (a hidden key, or one whose probability underflowed) g is exactly 0, even
    # in a NaN row: masked_fill's backward gives a hidden key no gradient.
    return g.masked_fill(y_c == 0, 0.0)
