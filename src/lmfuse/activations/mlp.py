"""``FusedMLP``: fc1 -> fused activation (its bias folded in) -> fc2, as one ``nn.Module``."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .._dispatch import check_choice, check_number, check_tensor, cpu_fast
from . import ops
from .reference import activation_reference

# name -> (reference activation, gated, takes a bias, op, weighted op or None)
_KINDS = {
    "gelu": ("gelu", False, True, ops.bias_gelu, None),
    "swiglu": ("silu", True, True, ops.swiglu, ops.weighted_swiglu),
    "geglu": ("gelu", True, True, ops.geglu, None),
    "quick_geglu": ("quick_gelu", True, True, ops.quick_geglu, ops.weighted_quick_geglu),
    "squared_relu": ("squared_relu", False, False, ops.squared_relu, ops.weighted_squared_relu),
}


class FusedMLP(nn.Module):
    """The transformer MLP ``fc2(act(fc1(x)))`` with the activation (and fc1's bias) fused.

    Args:
        hidden_size: model width (fc1's input, fc2's output).
        ffn_hidden_size: the activation's output width ``f``; gated activations make fc1
            ``2 f`` wide (the activated half first, as Megatron-Core lays it out).
        activation: ``"swiglu"``, ``"geglu"``, ``"quick_geglu"``, ``"gelu"`` (tanh) or
            ``"squared_relu"``.
        bias: biases on fc1 (added inside the fused activation; for squared ReLU, which takes
            none, by fc1 itself) and fc2.
        linear_offset, clamp_value: Quick-GEGLU's options (see :func:`lmfuse.quick_geglu`).
        gate_multiplier, down_multiplier: SwiGLU's ``silu(x1 * g) * x2 * d`` (Falcon-H1's
            MLP multipliers; see :func:`lmfuse.swiglu`); 1.0 each by default.
        fp8_input_store: keep the activation's saved input as float8.
        impl: the activation's path (``"auto"``, ``"triton"``, ``"torch"``).
        device, dtype: of the parameters, as ``torch.nn.Linear``'s.

    ``forward(x, weights=None)``: ``x [..., hidden_size]``; ``weights [tokens, 1]`` are MoE
    per-token routing weights, applied inside the activation (swiglu, quick_geglu and
    squared_relu have weighted kernels; the others refuse weights). x of another width or
    dtype than the parameters' (outside ``torch.autocast``) raises naming ``x``. NaN and
    inf propagate as through the unfused ``fc2(act(fc1(x)))``.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation: str = "swiglu",
                 bias: bool = True, *, linear_offset: float = 0.0,
                 clamp_value: Optional[float] = None, fp8_input_store: bool = False,
                 gate_multiplier: float = 1.0, down_multiplier: float = 1.0,
                 impl: str = "auto", device=None, dtype=None) -> None:
        super().__init__()
        check_choice("FusedMLP", "activation", activation, tuple(_KINDS))
        for name, v in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"FusedMLP: {name} must be a positive int, got {v!r}")
        if activation != "quick_geglu" and (linear_offset or clamp_value is not None):
            raise ValueError(f"FusedMLP: linear_offset and clamp_value are Quick-GEGLU's "
                             f"options, got them with activation={activation!r}")
        gate_multiplier = check_number("FusedMLP", "gate_multiplier", gate_multiplier,
                                       allow_none=False)
        down_multiplier = check_number("FusedMLP", "down_multiplier", down_multiplier,
                                       allow_none=False)
        if activation != "swiglu" and (gate_multiplier != 1.0 or down_multiplier != 1.0):
            raise ValueError(f"FusedMLP: gate_multiplier and down_multiplier are SwiGLU's "
                             f"options, got them with activation={activation!r}")
        if fp8_input_store and activation not in ("swiglu", "geglu", "quick_geglu"):
            raise ValueError(f"FusedMLP: fp8_input_store is for the gated activations, got "
                             f"activation={activation!r}")
        self.activation, self.impl = activation, impl
        self.linear_offset, self.clamp_value = linear_offset, clamp_value
        self.fp8_input_store = fp8_input_store
        self.gate_multiplier, self.down_multiplier = gate_multiplier, down_multiplier
        act, gated, fused_bias, _, _ = _KINDS[activation]
        width = 2 * ffn_hidden_size if gated else ffn_hidden_size
        kw = dict(device=device, dtype=dtype)
        self.fc1 = nn.Linear(hidden_size, width, bias=bias and not fused_bias, **kw)
        self.bias1 = nn.Parameter(torch.zeros(width, **kw)) if bias and fused_bias else None
        self.fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias=bias, **kw)

    def reset_parameters(self) -> None:
        """The parameters as constructed: ``fc1`` and ``fc2`` by ``nn.Linear``'s
        initialisation, the fused fc1 bias ``bias1`` zeros (after building on the meta
        device and ``to_empty``, every parameter gets its values here)."""
        self.fc1.reset_parameters()
        self.fc2.reset_parameters()
        if self.bias1 is not None:
            with torch.no_grad():
                self.bias1.zero_()

    def _activate(self, h: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
        name, opts = self.activation, {}
        bias1 = self.bias1
        if bias1 is not None and bias1.dtype != h.dtype:  # autocast: fc1 gave h its dtype
            bias1 = bias1.to(h.dtype)
        if name == "quick_geglu":
            opts = dict(linear_offset=self.linear_offset, clamp_value=self.clamp_value)
        if name == "swiglu" and (self.gate_multiplier != 1.0 or self.down_multiplier != 1.0):
            opts = dict(gate_multiplier=self.gate_multiplier,
                        down_multiplier=self.down_multiplier)
        if name in ("swiglu", "geglu", "quick_geglu"):
            opts["fp8_input_store"] = self.fp8_input_store
        _, _, fused_bias, fn, weighted = _KINDS[name]
        args = [h] if weights is None else [h, weights]
        if weights is not None and weighted is None:
            raise ValueError(f"FusedMLP: per-token weights need a weighted activation "
                             f"(swiglu, quick_geglu, squared_relu), got {name!r}")
        if fused_bias:  # (squared ReLU takes none: fc1 adds it)
            args.append(bias1)
        return (fn if weights is None else weighted)(*args, impl=self.impl, **opts)

    def _check(self, x: torch.Tensor, weights: Optional[torch.Tensor]) -> None:
        """x (and the routing weights) against the module's parameters: errors name the
        argument and give the shape, dtype or device seen and the one expected."""
        op, param = "FusedMLP", self.fc1.weight
        H = self.fc1.in_features
        check_tensor(op, "x", x)
        if x.dim() < 1 or x.shape[-1] != H:
            raise ValueError(f"{op}: x must be [..., hidden_size] = [..., {H}], got shape "
                             f"{tuple(x.shape)}")
        if x.device != param.device:
            raise ValueError(f"{op}: x is on {x.device} but the module's parameters are on "
                             f"{param.device}; move one of them")
        # Under autocast the linears cast x themselves (and _activate casts the fused bias).
        if x.dtype != param.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(f"{op}: x has dtype {x.dtype} but the module's parameters are "
                            f"{param.dtype}; cast x or the module (module.to(dtype)), or run "
                            f"under torch.autocast")
        if weights is not None:
            check_tensor(op, "weights", weights)
            tokens = x.numel() // H
            if tuple(weights.shape) not in ((tokens, 1), tuple(x.shape[:-1]) + (1,)):
                raise ValueError(f"{op}: weights must be [tokens, 1] = [{tokens}, 1] (one per "
                                 f"token of x {tuple(x.shape)}), got {tuple(weights.shape)}")
            if weights.device != x.device:
                raise ValueError(f"{op}: weights are on {weights.device} but x is on "
                                 f"{x.device}")

    def forward(self, x: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x [..., hidden_size]`` in the parameters' dtype (or any float dtype under
        ``torch.autocast``) -> ``[..., hidden_size]``. NaN and inf propagate as through the
        unfused ``fc2(act(fc1(x)))``."""
        if (weights is None and self.activation == "swiglu" and self.impl == "auto"
                and self.bias1 is None and self.fp8_input_store is False
                and self.gate_multiplier == 1.0 and self.down_multiplier == 1.0
                and cpu_fast(x) and x.layout is torch.strided and x.dim() > 0
                and x.shape[-1] == self.fc1.in_features
                and self.fc1.weight.is_cpu and self.fc1.weight.dtype is torch.float32):
            # The common CPU call: x is what the checks accept; swiglu's own CPU fast path.
            return self.fc2(ops.swiglu(self.fc1(x)))
        self._check(x, weights)
        return self.fc2(self._activate(self.fc1(x), weights))

    def reference_forward(self, x: torch.Tensor,
                          weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The same module unfused (plain torch, the activation's reference): what
        ``forward`` must equal, outputs and gradients."""
        act, gated, _, _, _ = _KINDS[self.activation]
        h = F.linear(x, self.fc1.weight, self.fc1.bias)
        w = None if weights is None else weights.reshape(-1, 1)
        y = activation_reference(h, self.bias1, w, activation=act, gated=gated,
                                 linear_offset=self.linear_offset,
                                 clamp_value=self.clamp_value,
                                 gate_multiplier=self.gate_multiplier,
                                 down_multiplier=self.down_multiplier)
        return self.fc2(y)

    def extra_repr(self) -> str:
        mult = (f", gate_multiplier={self.gate_multiplier:g}, "
                f"down_multiplier={self.down_multiplier:g}"
                if (self.gate_multiplier, self.down_multiplier) != (1.0, 1.0) else "")
        return (f"activation={self.activation!r}, fused bias={self.bias1 is not None}"
                f"{mult}, impl={self.impl!r}")
