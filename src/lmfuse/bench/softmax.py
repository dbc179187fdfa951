"""Benchmark ``lmfuse.fused_softmax`` against torch eager, torch.compile and Megatron-Core.

Run it as ``lmfuse bench softmax [--json PATH] [--plot PATH] [--quick]``. Every case
reports the median time, the achieved TB/s over the *minimal* bytes the op must move
(visible keys read, the full output written; the backward reads y and dy on visible keys
and writes dx), and each peer's time as a multiple of lmfuse's. A device-to-device copy
of the same size, timed in the same run, is the bandwidth ceiling.
"""

from __future__ import annotations

import torch

import lmfuse
from lmfuse._launch import dtype_name
from lmfuse.bench.common import Case, compile_per_shape, finish, measure_copy, run_cases, start


def eager_softmax(x, scale, causal=False, mask=None, offset=None):
    """The unfused expression a user writes (float32 math), also the torch.compile input."""
    z = x.float() * scale
    sq, sk = x.shape[-2:]
    if causal:
        hidden = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(sk - sq + 1)
        z = z.masked_fill(hidden, float("-inf"))
    if mask is not None:
        z = z.masked_fill(mask, float("-inf"))
    if offset is not None:
        sink = offset.float().view(1, -1, 1, 1).expand(z.shape[0], -1, sq, 1)
        return torch.softmax(torch.cat([z, sink], dim=-1), dim=-1)[..., :-1].to(x.dtype)
    return torch.softmax(z, dim=-1).to(x.dtype)


_compiled = compile_per_shape(eager_softmax, fullgraph=False)


def _megatron(causal: bool, scale: float, dtype: torch.dtype):
    try:
        from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.utils import attention_mask_func
    except Exception:
        return None
    return FusedScaleMaskSoftmax(
        input_in_fp16=dtype == torch.float16, input_in_bf16=dtype == torch.bfloat16,
        attn_mask_type=AttnMaskType.causal if causal else AttnMaskType.padding,
        scaled_masked_softmax_fusion=False, mask_func=attention_mask_func,
        softmax_in_fp32=True, scale=scale,
    )


def make_case(shape, dtype, device, *, kind: str, backward: bool) -> Case:
    b, np_, sq, sk = shape
    scale = 1.0 / 8.0
    causal = kind in ("causal", "causal+sink")
    x = torch.randn(shape, dtype=dtype, device=device).requires_grad_(backward)
    g = torch.randn(shape, dtype=dtype, device=device)
    mask = offset = None
    if kind == "padding":
        mask = torch.rand(b, 1, 1, sk, device=device) < 0.1
    if kind == "causal+sink":
        offset = torch.randn(np_, device=device, dtype=torch.float32).requires_grad_(backward)
    elt = x.element_size()
    # visible keys: causal query i sees keys 0 .. i + sk - sq
    n = b * np_ * sq * sk
    v = b * np_ * sum(min(sk, i + sk - sq + 1) for i in range(sq)) if causal else n
    nbytes = (v + n) * elt + ((2 * v + n) * elt if backward else 0)

    def wrap(f):
        if not backward:
            return lambda: f(x)
        inputs = [x] + ([offset] if offset is not None else [])
        return lambda: torch.autograd.grad(f(x), inputs, g)

    impls = {
        "lmfuse": wrap(lambda t: lmfuse.fused_softmax(
            t, scale=scale, causal=causal, mask=mask, softmax_offset=offset)),
        "torch": wrap(lambda t: eager_softmax(t, scale, causal, mask, offset)),
        "torch.compile": wrap(lambda t: _compiled(t, scale, causal, mask, offset)),
    }
    notes = {}
    mod = _megatron(causal, scale, dtype) if device.type == "cuda" else None
    if mod is not None and kind in ("causal", "plain", "padding", "causal+sink"):
        impls["megatron-core(torch)"] = wrap(lambda t: mod(t, mask, offset))
        notes["megatron-core(torch)"] = "FusedScaleMaskSoftmax, torch path"
    mode = "fwd+bwd" if backward else "fwd"
    name = f"{kind} {mode} {list(shape)} {dtype_name(dtype)}"
    return Case(name, nbytes, impls, notes)


def build_cases(device: torch.device, quick: bool) -> list[Case]:
    bf16 = torch.bfloat16
    if quick:
        s = (2, 4, 128, 128)
        return [make_case(s, torch.float32, device, kind=k, backward=bw)
                for k in ("causal", "plain") for bw in (False, True)]
    a, big, long_rows = (4, 32, 2048, 2048), (1, 16, 8192, 8192), (2, 8, 128, 65536)
    cases = [(a, "causal", False), (a, "causal", True), (a, "plain", False), (a, "plain", True),
             (a, "padding", False), (a, "causal+sink", True), (big, "causal", False),
             (big, "causal", True), (big, "plain", False), (long_rows, "plain", False),
             (long_rows, "plain", True), (long_rows, "causal", True)]
    return [make_case(s, bf16, device, kind=k, backward=bw) for s, k, bw in cases]


def main(argv: list[str] | None = None) -> int:
    args, device, quick, env = start("lmfuse bench softmax", __doc__, argv)
    copy = measure_copy(4 * 32 * 2048 * 2048 * 2 if not quick else 2 * 4 * 128 * 128 * 4,
                        device)
    results = run_cases(build_cases(device, quick), device)
    return finish(args, env, copy, results,
                  f"fused_softmax on {env['device']} (copy: {copy['tbps']:.2f} TB/s)")


if __name__ == "__main__":
    raise SystemExit(main())
