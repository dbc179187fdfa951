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

Invisible keys get 0 (NaN in a NaN row, below); a row with no visible key is all zeros
(never NaN).

That is exactly PyTorch's ``torch.softmax(z.masked_fill(hidden, -inf), -1)`` (with the sink
as one more logit, dropped from the output), NaN and inf included, with one deviation
(Megatron's): a row whose keys are all hidden or ``-inf`` is all zeros with zero gradient,
whatever the sink, where PyTorch gives NaN. So:

* a NaN or ``+inf`` among a row's visible logits, or a NaN or ``+inf`` sink, makes every
  output of the row NaN (``exp(inf - inf)``), hidden keys included (PyTorch's max is NaN
  and ``exp(-inf - NaN)`` is NaN); the gradient is NaN at the row's visible keys and
  exactly 0 at its hidden keys, as ``masked_fill``'s backward gives them;
* ``-inf`` logits (a score or an additive mask of ``-inf``) get probability 0;
* hidden keys (outside the band, or True in the boolean mask) never read their score: a NaN
  there changes nothing. An additive mask hides nothing: ``NaN + (-inf)`` is NaN, as in
  PyTorch.
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
    # Every key hidden or -inf: nothing to normalise (torch.softmax: NaN); the row is zeros.
    dead = (z == -torch.inf).all(dim=-1, keepdim=True)

    row_max = z.amax(dim=-1, keepdim=True) if sk > 0 else z.new_full((b, np_, sq, 1), -torch.inf)
    if softmax_offset is not None:
        sink = softmax_offset.to(compute).view(1, np_, 1, 1)
        # The shift is only a shift: a NaN-ignoring max (the kernels' too) is as good, and
        # keeps a dead row's exp() at 0 under a NaN sink. A NaN or +inf logit or sink still
        # makes the row NaN through exp(z - shift) or the denominator, as torch.softmax does.
        row_max = torch.fmax(row_max, sink)
    # A dead row's max is -inf: shifting by 0 keeps exp() at 0, not NaN.
    shift = torch.where(row_max == -torch.inf, torch.zeros_like(row_max), row_max).detach()
    e = torch.exp(z - shift)
    denom = e.sum(dim=-1, keepdim=True)
    if softmax_offset is not None:
        denom = denom + torch.exp(sink - shift)
    # A dead row has every e exactly 0: dividing by 1 gives zeros, and its scores a zero
    # gradient. Elsewhere a NaN denom (a NaN or +inf logit or sink) makes every y of the row
    # NaN, hidden keys included (0 / NaN), as in PyTorch; masked_fill's backward still gives
    # the hidden keys a zero gradient.
    y = e / torch.where(dead, torch.ones_like(denom), denom)
    return y.to(scores.dtype)


def fused_softmax_backward_reference(
    y: torch.Tensor, grad: torch.Tensor, hidden: torch.Tensor | None = None
) -> torch.Tensor:
    """The backward of :func:`fused_softmax_reference` as the fused path computes it.

    Returns ``g = d loss / d z = y * (grad - sum(grad * y))`` for ``z = scale * scores +
    mask`` in float32 (float64 for float64), computed from the *saved output* ``y`` as
    stored, in its own dtype: that is what a fused backward reads (it never keeps the
    scores), so for bfloat16/float16 it differs from exact autograd by the rounding of
    ``y``. ``d scores = scale * g``, a learnable additive mask gets ``g`` summed to its
    shape, and ``d offset_h = -sum over rows of p_sink * sum(grad * y)``.

    ``g`` is exactly 0 where ``y`` is 0 (a hidden key of a finite row, a dead row, a key
    whose probability underflowed) and where ``hidden`` (bool, broadcastable to ``y``: the
    keys outside the band or True in the boolean mask) is True: a NaN row stores NaN at its
    hidden keys, and ``masked_fill``'s backward gives them no gradient all the same.
    ``hidden=None`` is right for rows without NaN.
    """
    compute = torch.float64 if y.dtype == torch.float64 else torch.float32
    y_c, g_c = y.to(compute), grad.to(compute)
    g = y_c * (g_c - (y_c * g_c).sum(dim=-1, keepdim=True))
    zero = y_c == 0 if hidden is None else (y_c == 0) | hidden
    return g.masked_fill(zero, 0.0)
