"""Reference mixture-of-experts MLP: the specification of :func:`lmfuse.moe_experts`.

Each token ``t`` is routed to ``k`` experts ``expert_ids[t, j]`` with weights
``router_weights[t, j]``; the output is the weighted sum of those experts' MLPs applied to
``hidden[t]``::

    out[t] = sum_j router_weights[t, j] * expert(expert_ids[t, j], hidden[t])
    expert(e, x) = act(x @ w_gate_up[e].T + gate_up_bias[e]) @ w_down[e].T + down_bias[e]

``act`` is one of lmfuse's activations (``activations/reference.py``): gated (``swiglu``,
``geglu``, ``quick_geglu``: the ``2F`` gate/up outputs split into the activated gate and the
linear up part, ``act(gate) * (up + linear_offset)``) or not (``squared_relu``, whose
``w_gate_up`` is ``[E, F, H]``: one up projection). The biases belong to the projections,
so ``clamp_value`` (``gate <= c``, ``-c <= up <= c``) applies after ``gate_up_bias``, as in
GPT-OSS. ``gate_up_layout`` says where the gate and up columns are: ``"halves"`` (gate
``[:F]``, up ``[F:]``) or ``"interleaved"`` (gate ``[0::2]``, up ``[1::2]``, GPT-OSS).

The reference is the per-expert loop written to be read: gather each expert's tokens, the
gate/up GEMM, the activation, the down GEMM, the router-weighted scatter-add. Math is
float32 (float64 for float64 input), the result rounded once to ``hidden``'s dtype; it is
differentiable torch code, so autograd gives the reference gradients.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..activations.reference import activation_reference

# public name -> (lmfuse activation, gated)
ACTIVATIONS = {
    "swiglu": ("silu", True),
    "geglu": ("gelu", True),
    "quick_geglu": ("quick_gelu", True),
    "squared_relu": ("squared_relu", False),
}
LAYOUTS = ("halves", "interleaved")


def split_gate_up(h: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate, up)`` of the gate/up projection's output ``h [..., 2F]``."""
    if layout == "interleaved":
        return h[..., 0::2], h[..., 1::2]
    f = h.shape[-1] // 2
    return h[..., :f], h[..., f:]


def expert_activation(h: torch.Tensor, *, activation: str, linear_offset: float = 0.0,
                      clamp_value: Optional[float] = None,
                      gate_up_layout: str = "halves") -> torch.Tensor:
    """``act(h)`` for the gate/up output ``h [..., 2F]`` (``[..., F]`` for ``squared_relu``),
    bias already added: ``[..., F]`` in ``h``'s dtype (float32 math inside)."""
    name, gated = ACTIVATIONS[activation]
    if gated:
        # activation_reference takes the halves layout; its clamp is the first thing it
        # does, so with no bias passed it clamps the biased values (GPT-OSS's order).
        h = torch.cat(split_gate_up(h, gate_up_layout), dim=-1)
    return activation_reference(h, activation=name, gated=gated, linear_offset=linear_offset,
                                clamp_value=clamp_value)


def moe_experts_reference(
    hidden: torch.Tensor,
    expert_ids: torch.Tensor,
    router_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    gate_up_bias: Optional[torch.Tensor] = None,
    down_bias: Optional[torch.Tensor] = None,
    *,
    activation: str = "swiglu",
    linear_offset: float = 0.0,
    clamp_value: Optional[float] = None,
    gate_up_layout: str = "halves",
) -> torch.Tensor:
    """The routed experts' weighted sum, one expert at a time.

    Args:
        hidden: ``[T, H]`` tokens.
        expert_ids: ``[T, k]`` integer expert of each token's ``k`` slots, in ``[0, E)``.
        router_weights: ``[T, k]`` float weight of each slot.
        w_gate_up: ``[E, 2F, H]`` (``[E, F, H]`` for ``squared_relu``).
        w_down: ``[E, H, F]``.
        gate_up_bias: optional ``[E, 2F]`` (``[E, F]``); down_bias: optional ``[E, H]``.
    Returns:
        ``[T, H]`` in ``hidden``'s dtype.
    """
    compute = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    T, k = expert_ids.shape
    x_all = hidden.to(compute)
    out = torch.zeros(T, hidden.shape[1], dtype=compute, device=hidden.device)
    for e in range(w_gate_up.shape[0]):
        token, slot = (expert_ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        x = x_all[token]
        h = x @ w_gate_up[e].to(compute).T
        if gate_up_bias is not None:
            h = h + gate_up_bias[e].to(compute)
        a = expert_activation(h, activation=activation, linear_offset=linear_offset,
                              clamp_value=clamp_value, gate_up_layout=gate_up_layout)
        y = a @ w_down[e].to(compute).T
        if down_bias is not None:
            y = y + down_bias[e].to(compute)
        y = y * router_weights[token, slot].to(compute)[:, None]
        out = out.index_add(0, token, y)
    return out.to(hidden.dtype)
