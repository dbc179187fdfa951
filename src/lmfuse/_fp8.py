"""fp8 rounding and saturation for the Triton kernels that store float8 values: the KV cache
appends (attention, serving) and the fp8 input stores (activations, MoE experts). One
definition, below the families (it imports Triton: the kernels modules import it, nothing
imported by ``import lmfuse`` does; the torch side's cast is ``_launch.to_e4m3``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_fp8(x, FP8_MANT: tl.constexpr, FP8_MIN_EXP: tl.constexpr):
    """float32 ``x`` (already within the format's range) rounded to the nearest value of an
    fp8 format with ``FP8_MANT`` mantissa bits and smallest normal exponent ``FP8_MIN_EXP``,
    ties to even, so the conversion that stores it has nothing left to round. The hardware's
    conversion (``cvt.rn``) would round the same way; Triton 3.9's interpreter rounds fp8
    half-up and can drop the carry into the exponent (0.49 -> 0.25), which this sidesteps.
    Adding ``1.5 * 2**23 * spacing`` leaves ``spacing`` as the sum's last place, so float32
    addition itself does the rounding; the sign of a zero result is kept."""
    biased = (x.to(tl.int32, bitcast=True) >> 23) & 0xFF
    biased = tl.maximum(biased, FP8_MIN_EXP + 127)  # fp8 subnormals: the smallest spacing
    spacing = ((biased - FP8_MANT) << 23).to(tl.float32, bitcast=True)
    magic = spacing * 12582912.0
    r = (x + magic) - magic
    return tl.where(r == 0.0, x * 0.0, r)


@triton.jit
def saturate_fp8(x, fp8_max, FP8_MANT: tl.constexpr, FP8_MIN_EXP: tl.constexpr):
    """float32 ``x`` as a value of the fp8 format (still float32): saturated at its largest
    finite value ``fp8_max`` instead of rounding to NaN, and rounded exactly (see
    ``round_fp8``); NaN stays NaN (the clamp alone would turn it into ``-fp8_max``:
    max.f32 skips NaNs)."""
    r = round_fp8(tl.minimum(tl.maximum(x, -fp8_max), fp8_max), FP8_MANT, FP8_MIN_EXP)
    return tl.where(x != x, x, r)


@triton.jit
def saturate_e4m3(x):
    """``saturate_fp8`` for e4m3: +-448, 3 mantissa bits, smallest normal exponent -6."""
    return saturate_fp8(x, 448.0, 3, -6)


@triton.jit
def store_e4m3(ptr, v, mask):
    """float32 ``v`` stored at ``ptr`` as float8_e4m3fn values (``saturate_e4m3``): into a
    float8_e4m3fn buffer, NaN's bits set by hand (Triton 3.9's interpreter converts a
    float32 NaN to e4m3 384; a GPU's conversion gives 0x7F already, and the select costs a
    memory-bound store nothing that shows); into a wider buffer (a GPU that cannot convert
    to float8, compute capability < 8.9) as those same values, which it holds exactly."""
    v = saturate_e4m3(v)
    if ptr.dtype.element_ty == tl.float8e4nv:
        bits = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        bits = tl.where(v != v, 0x7F, bits).to(tl.uint8)
        tl.store(ptr, bits.to(tl.float8e4nv, bitcast=True), mask=mask)
    else:
        tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)
