"""Every public op captured in a ``torch.cuda.CUDAGraph`` (forward, and backward where the op
has one) and replayed on new data: outputs, gradients and in-place writes bitwise equal to
an eager call on the same data.

Run on a CUDA machine with the Triton compiler (not the interpreter)::

    LMFUSE_GPU_TESTS=1 python -m pytest -q -rA tests/gpu

Elsewhere (CI: no CUDA, ``TRITON_INTERPRET=1``) every test here is skipped.

How each case runs (:func:`check_graph`): static input buffers (and module parameters) are
made once; the step (the op, then ``torch.autograd.grad`` of its outputs with static upstream
gradients) is warmed up three times on a side stream, as the CUDA-graph docs recommend (the
Triton kernels compile there), then captured. For each of two replays, new random data is
copied into every static input, parameter and upstream gradient, the graph replays, and the
same step runs eagerly on the same buffers (state the step writes in place, a KV cache, is
put back first). The comparison is ``torch.equal``: a replay launches the same kernels with
the same launch parameters on the same data, and lmfuse's kernels are deterministic (no
atomics in any reduction, fixed chunking; ``ce_slices_kernel``'s atomics only hand out
tiles and publish partials, which are merged in a fixed order), as are the cuBLAS GEMMs of
``linear_cross_entropy``, ``FusedMLP`` and ``DecodeAttentionBlock``. The two replays must
also differ from each other, so a graph that ignored its inputs could not pass.

The step's Python runs only at capture: nothing in it may synchronise with the host or
depend on tensor values (the split count of decode attention comes from the cache's
capacity, not from ``cache_seqlens``), and that is what these tests prove.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from helpers import capture_graph

import lmfuse
from lmfuse import megatron

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="CUDA-graph tests need a CUDA GPU and the Triton compiler (run them with "
           "LMFUSE_GPU_TESTS=1, which keeps TRITON_INTERPRET unset)")

DEV = "cuda"
BF16, F32, FP8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
REPLAYS = 2


# --- random inputs (on the GPU) ----------------------------------------------------------------


def rnd(*shape: int, dtype: torch.dtype = BF16, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, device=DEV) * scale).to(dtype)


def targets(n: int, vocab: int, ignored: float = 0.1) -> torch.Tensor:
    """Class ids ``[n]`` with about ``ignored`` of them ``-100``."""
    t = torch.randint(0, vocab, (n,), device=DEV)
    return torch.where(torch.rand(n, device=DEV) < ignored, -100, t)


def lengths(B: int, low: int, high: int) -> torch.Tensor:
    """``[B]`` int32 lengths in ``[low, high]``."""
    return torch.randint(low, high + 1, (B,), device=DEV, dtype=torch.int32)


def paged_table(lens: torch.Tensor, per_seq: int, num_blocks: int,
                block_len: int) -> torch.Tensor:
    """``[B, per_seq + 1]`` int32: distinct random blocks of the pool for each sequence's
    rows, -1 after them (and in the extra column)."""
    B = lens.shape[0]
    ids = torch.randperm(num_blocks, device=DEV)[:B * per_seq].view(B, per_seq).int()
    used = torch.arange(per_seq, device=DEV)[None] < (lens[:, None] + block_len - 1) // block_len
    table = torch.where(used, ids, -1)
    return torch.cat([table, torch.full((B, 1), -1, device=DEV, dtype=torch.int32)], 1)


def cache(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random cache rows (standard normal, rounded to ``dtype``, float8 included)."""
    return torch.randn(shape, device=DEV).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as raw bytes for float8 (which ``torch.equal`` does not compare), else ``t``."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


# --- the harness --------------------------------------------------------------------------------


@dataclass
class Case:
    """One op call to capture.

    ``fresh()`` returns new random inputs (same shapes and dtypes every call); ``fn(*inputs)``
    calls the op, or ``fn(module, *inputs)`` with the module ``module()`` makes (built in the
    test: collection must not touch CUDA). Gradients are taken of the outputs with respect to
    ``inputs[i]`` for ``i`` in ``wrt`` and, with ``module_grads``, to the module's
    parameters; ``mutated`` lists the inputs the op writes in place, compared too. Neither:
    forward only, under ``torch.no_grad()``.
    """

    id: str
    fn: Callable
    fresh: Callable[[], list]
    wrt: tuple[int, ...] = ()
    mutated: tuple[int, ...] = ()
    module: Callable[[], torch.nn.Module] | None = None
    module_grads: bool = True

    @property
    def backward(self) -> bool:
        return bool(self.wrt) or (self.module is not None and self.module_grads)


def _outputs(out) -> tuple:
    if out is None:
        return ()
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _refresh_params(module: torch.nn.Module | None) -> None:
    """New random parameters (norm-like weights around 1, the others small)."""
    if module is None:
        return
    with torch.no_grad():
        for name, p in module.named_parameters():
            new = torch.randn(p.shape, device=DEV)
            if "norm" in name or (name == "weight" and p.dim() == 1):
                new = 1.0 + 0.1 * new
            else:
                new = new / math.sqrt(max(p.shape[-1], 1))
            p.copy_(new.to(p.dtype))


def check_graph(case: Case) -> str:
    """Capture ``case``'s step, replay it on new data and compare with eager; returns the
    summary line."""
    inputs = case.fresh()
    for i in case.wrt:
        inputs[i].requires_grad_(True)
    module = case.module() if case.module is not None else None
    trained = module if case.module_grads else None
    _refresh_params(module)
    named = list(trained.named_parameters()) if trained is not None else []
    leaves = [inputs[i] for i in case.wrt] + [p for _, p in named]
    upstream: list[torch.Tensor] = []

    def call():
        return _outputs(case.fn(*inputs) if module is None else case.fn(module, *inputs))

    def step() -> tuple:
        if not case.backward:
            with torch.no_grad():
                return call()
        outs = call()
        return outs + tuple(torch.autograd.grad(outs, leaves, upstream))

    if case.backward:  # static upstream gradients, shaped by one eager forward
        with torch.no_grad():
            upstream.extend(torch.randn_like(o) for o in call())

    # Detached: the captured autograd graph (its AccumulateGrad nodes, made on the capture
    # stream) must not outlive the capture into the eager calls below.
    graph, static_out = capture_graph(lambda: tuple(t.detach() for t in step()))

    names = [f"output {k}" for k in range(len(static_out) - len(leaves))]
    names += [f"grad of input {i}" for i in case.wrt] + [f"grad of {n}" for n, _ in named]
    names += [f"input {i} written in place" for i in case.mutated]
    replays = []
    for _ in range(REPLAYS):
        with torch.no_grad():
            for t, new in zip(inputs, case.fresh()):
                t.copy_(new)
            for u in upstream:
                u.copy_(torch.randn_like(u))
        _refresh_params(trained)
        before = [inputs[i].clone() for i in case.mutated]
        graph.replay()
        got = [t.clone() for t in static_out] + [inputs[i].clone() for i in case.mutated]
        with torch.no_grad():
            for i, b in zip(case.mutated, before):
                inputs[i].copy_(b)
        want = list(step()) + [inputs[i].clone() for i in case.mutated]
        assert len(got) == len(want) == len(names)
        for name, a, b in zip(names, got, want):
            assert a.shape == b.shape and a.dtype == b.dtype, f"{case.id}: {name}"
            assert torch.equal(bits(a), bits(b)), (
                f"{case.id}: {name} after replay differs from eager: max |diff| "
                f"{(a.double() - b.double()).abs().max().item():.3e}")
        replays.append(got)
    assert any(not torch.equal(bits(a), bits(b)) for a, b in zip(*replays)), (
        f"{case.id}: two replays on different data gave the same results")
    what = "forward+backward" if case.backward else "forward"
    return (f"CUDA graph {case.id}: {what} captured, replayed x{REPLAYS} on new data, "
            f"{len(names)} tensors bitwise equal to eager")


# --- softmax ------------------------------------------------------------------------------------


def _softmax_cases() -> list[Case]:
    b, h, sq, sk = 2, 8, 128, 128

    def scores(dtype=BF16, q=sq, k=sk):
        return rnd(b, h, q, k, dtype=dtype, scale=3.0)

    return [
        Case("fused_softmax-causal-bf16", lambda x: lmfuse.fused_softmax(
            x, scale=0.125, causal=True), lambda: [scores()], wrt=(0,)),
        Case("fused_softmax-bool-mask-bf16", lambda x, m: lmfuse.fused_softmax(
            x, scale=0.125, mask=m), lambda: [scores(), torch.rand(b, 1, sq, sk, device=DEV) < 0.3],
            wrt=(0,)),
        Case("fused_softmax-window-bf16", lambda x: lmfuse.fused_softmax(
            x, scale=0.125, window_size=(32, 0)), lambda: [scores()], wrt=(0,)),
        Case("fused_softmax-causal-sinks-bf16", lambda x, o: lmfuse.fused_softmax(
            x, scale=0.125, causal=True, softmax_offset=o), lambda: [scores(), rnd(h)],
            wrt=(0, 1)),
        Case("fused_softmax-additive-mask-chunked-fp32", lambda x, m: lmfuse.fused_softmax(
            x, mask=m, causal=True), lambda: [scores(F32, 48, 200), rnd(1, h, 48, 200, dtype=F32)],
            wrt=(0,)),
    ]


def _module_softmax_cases() -> list[Case]:
    b, h, s = 2, 8, 96
    mod = lmfuse.FusedScaleMaskSoftmax(False, True, lmfuse.AttnMaskType.padding_causal, True,
                                       None, True, 0.125)
    return [Case("FusedScaleMaskSoftmax-padding_causal-sinks-bf16",
                 lambda x, m, o: mod(x, m, o),
                 lambda: [rnd(b, h, s, s, scale=3.0), torch.rand(b, 1, 1, s, device=DEV) < 0.2,
                          rnd(h)], wrt=(0, 2))]


# --- cross-entropy ------------------------------------------------------------------------------


def _ce_cases() -> list[Case]:
    def ce(n, v, dtype=BF16, ignored=0.1):
        return lambda: [rnd(n, v, dtype=dtype, scale=2.0), targets(n, v, ignored)]

    return [
        # V = 32000: rows streamed, gradient in the forward (fused), backward rescales.
        Case("cross_entropy-plain-V32000-bf16", lambda x, t: lmfuse.cross_entropy(x, t),
             ce(256, 32000, ignored=0.0), wrt=(0,)),
        # V = 100000: the slices kernel (persistent grid, ticket counter zeroed per call).
        Case("cross_entropy-ls-zloss-softcap-V100000-bf16", lambda x, t: lmfuse.cross_entropy(
            x, t, label_smoothing=0.1, z_loss=1e-4, softcap=30.0), ce(64, 100000), wrt=(0,)),
        # reduction="none": stats in the forward, gradient in the backward (deferred path).
        Case("cross_entropy-ignore_index-none-V4000-bf16", lambda x, t: lmfuse.cross_entropy(
            x, t, reduction="none"), ce(512, 4000, ignored=0.25), wrt=(0,)),
        Case("cross_entropy-sum-inplace-V1000-fp32", lambda x, t: lmfuse.cross_entropy(
            x * 1.0, t, reduction="sum", inplace_backward=True), ce(300, 1000, F32), wrt=(0,)),
    ]


def _linear_ce_cases() -> list[Case]:
    n, hidden, v = 256, 256, 8000

    def inputs(dtype=BF16):
        return lambda: [rnd(n, hidden, dtype=dtype), rnd(v, hidden, dtype=dtype, scale=0.06),
                        rnd(v, dtype=dtype, scale=0.1), targets(n, v)]

    chunk = 64 * v * 2  # four chunks of 64 tokens (bf16 logits)
    return [
        Case("linear_cross_entropy-bias-mean-4chunks-bf16",
             lambda h, w, b, t: lmfuse.linear_cross_entropy(h, w, t, bias=b,
                                                            max_chunk_bytes=chunk),
             inputs(), wrt=(0, 1, 2)),
        # reduction="none": logits recomputed chunk by chunk in the backward.
        Case("linear_cross_entropy-bias-none-ls-4chunks-bf16",
             lambda h, w, b, t: lmfuse.linear_cross_entropy(
                 h, w, t, bias=b, reduction="none", label_smoothing=0.1, z_loss=1e-4,
                 max_chunk_bytes=chunk), inputs(), wrt=(0, 1, 2)),
        Case("linear_cross_entropy-bias-mean-fp32",
             lambda h, w, b, t: lmfuse.linear_cross_entropy(h, w, t, bias=b),
             inputs(F32), wrt=(0, 1, 2)),
    ]


# --- activations --------------------------------------------------------------------------------


def _activation_cases() -> list[Case]:
    tokens, f = 512, 688

    def x_b(width, dtype=BF16):
        return lambda: [rnd(tokens, width, dtype=dtype), rnd(width, dtype=dtype, scale=0.1)]

    def x_w(width, dtype=BF16, bias=False):
        def make():
            out = [rnd(tokens, width, dtype=dtype), torch.rand(tokens, 1, device=DEV)]
            return out + [rnd(width, dtype=dtype, scale=0.1)] if bias else out
        return make

    return [
        Case("bias_gelu-bf16", lmfuse.bias_gelu, x_b(f), wrt=(0, 1)),
        Case("swiglu-bias-bf16", lmfuse.swiglu, x_b(2 * f), wrt=(0, 1)),
        Case("swiglu-bias-fp8_input_store-bf16",
             lambda x, b: lmfuse.swiglu(x, b, fp8_input_store=True), x_b(2 * f), wrt=(0, 1)),
        Case("geglu-bias-3d-bf16", lambda x, b: lmfuse.geglu(x.view(8, 64, -1), b),
             x_b(2 * f), wrt=(0, 1)),
        Case("quick_geglu-offset-clamp-bf16", lambda x, b: lmfuse.quick_geglu(
            x, b, linear_offset=1.0, clamp_value=1.5), x_b(2 * f), wrt=(0, 1)),
        Case("weighted_swiglu-bias-bf16",
             lambda x, w, b: lmfuse.weighted_swiglu(x, w, b), x_w(2 * f, bias=True),
             wrt=(0, 1, 2)),
        Case("weighted_quick_geglu-offset-clamp-bf16", lambda x, w: lmfuse.weighted_quick_geglu(
            x, w, linear_offset=1.0, clamp_value=1.5), x_w(2 * f), wrt=(0, 1)),
        Case("squared_relu-bf16", lmfuse.squared_relu, lambda: [rnd(tokens, f)], wrt=(0,)),
        Case("weighted_squared_relu-bf16", lmfuse.weighted_squared_relu, x_w(f), wrt=(0, 1)),
        Case("swiglu-bias-fp32", lmfuse.swiglu, x_b(2 * f, F32), wrt=(0, 1)),
    ]


def _mlp_cases() -> list[Case]:
    def mlp(activation, **kw):
        return lmfuse.FusedMLP(256, 688, activation, device=DEV, dtype=BF16, **kw)

    def tokens_weights():
        return [rnd(256, 256), torch.rand(256, 1, device=DEV)]

    return [
        Case("FusedMLP-swiglu-3d-bf16", lambda m, x: m(x), lambda: [rnd(4, 64, 256)], wrt=(0,),
             module=lambda: mlp("swiglu")),
        Case("FusedMLP-quick_geglu-weights-bf16", lambda m, x, w: m(x, w), tokens_weights,
             wrt=(0, 1), module=lambda: mlp("quick_geglu", linear_offset=1.0, clamp_value=2.0)),
        Case("FusedMLP-squared_relu-weights-bf16", lambda m, x, w: m(x, w), tokens_weights,
             wrt=(0, 1), module=lambda: mlp("squared_relu")),
    ]


# --- Megatron-Core's names ----------------------------------------------------------------------


def _megatron_cases() -> list[Case]:
    tokens, f, v = 256, 512, 32000

    def gated(width=2 * f, bias=True):
        return lambda: [rnd(tokens, width)] + ([rnd(width, scale=0.1)] if bias else [])

    def gated_w(width=2 * f):
        return lambda: [rnd(tokens, width), rnd(width, scale=0.1),
                        torch.rand(tokens, 1, device=DEV)]

    def logits():
        return [rnd(16, 8, v, scale=2.0), targets(128, v).view(16, 8)]

    return [
        Case("megatron.scaled_upper_triang_masked_softmax-bf16",
             lambda x: megatron.scaled_upper_triang_masked_softmax(x, 0.125),
             lambda: [rnd(16, 128, 128, scale=3.0)], wrt=(0,)),
        Case("megatron.scaled_masked_softmax-bf16",
             lambda x, m: megatron.scaled_masked_softmax(x, m, 0.125),
             lambda: [rnd(2, 8, 128, 128, scale=3.0),
                      torch.rand(2, 1, 128, 128, device=DEV) < 0.3], wrt=(0,)),
        Case("megatron.scaled_softmax-bf16", lambda x: megatron.scaled_softmax(x, 0.125),
             lambda: [rnd(2, 8, 128, 128, scale=3.0)], wrt=(0,)),
        Case("megatron.fused_vocab_parallel_cross_entropy-bf16",
             megatron.fused_vocab_parallel_cross_entropy, logits, wrt=(0,)),
        Case("megatron.vocab_parallel_cross_entropy-ls-bf16",
             lambda x, t: megatron.vocab_parallel_cross_entropy(x, t, 0.1), logits, wrt=(0,)),
        Case("megatron.bias_gelu_impl-bf16", megatron.bias_gelu_impl, gated(f), wrt=(0, 1)),
        Case("megatron.bias_swiglu_impl-bf16", megatron.bias_swiglu_impl, gated(), wrt=(0, 1)),
        Case("megatron.bias_geglu_impl-bf16", megatron.bias_geglu_impl, gated(), wrt=(0, 1)),
        Case("megatron.weighted_bias_swiglu_impl-bf16", megatron.weighted_bias_swiglu_impl,
             gated_w(), wrt=(0, 1, 2)),
        Case("megatron.weighted_bias_quick_geglu_impl-bf16",
             lambda x, b, w: megatron.weighted_bias_quick_geglu_impl(
                 x, b, w, linear_offset=1.0, clamp_value=7.0), gated_w(), wrt=(0, 1, 2)),
        Case("megatron.weighted_squared_relu_impl-bf16", megatron.weighted_squared_relu_impl,
             lambda: [rnd(tokens, f), torch.rand(tokens, 1, device=DEV)], wrt=(0, 1)),
    ]


# --- RMSNorm (when lmfuse has it) ---------------------------------------------------------------


def _norm_cases() -> list[Case]:
    cases = []
    if hasattr(lmfuse, "rms_norm"):
        cases.append(Case("rms_norm-bf16", lambda x, w: lmfuse.rms_norm(x, w),
                          lambda: [rnd(512, 1024), 1.0 + rnd(1024, scale=0.1)], wrt=(0, 1)))
        cases.append(Case("rms_norm-weight_offset-fp32", lambda x, w: lmfuse.rms_norm(
            x, w, weight_offset=1.0), lambda: [rnd(4, 128, 768, dtype=F32),
                                               rnd(768, dtype=F32, scale=0.1)], wrt=(0, 1)))
    if hasattr(lmfuse, "RMSNorm"):
        cases.append(Case("RMSNorm-bf16", lambda m, x: m(x), lambda: [rnd(8, 64, 1024)],
                          wrt=(0,), module=lambda: lmfuse.RMSNorm(1024).to(DEV, BF16)))
    if hasattr(lmfuse, "layer_norm"):
        cases.append(Case("layer_norm-bf16", lambda x, w, b: lmfuse.layer_norm(x, w, b),
                          lambda: [rnd(512, 1024), 1.0 + rnd(1024, scale=0.1),
                                   rnd(1024, scale=0.1)], wrt=(0, 1, 2)))
        cases.append(Case("layer_norm-weight_offset-fp32", lambda x, w: lmfuse.layer_norm(
            x, w, weight_offset=1.0), lambda: [rnd(4, 128, 768, dtype=F32),
                                               rnd(768, dtype=F32, scale=0.1)], wrt=(0, 1)))
        cases.append(Case("LayerNorm-bf16", lambda m, x: m(x), lambda: [rnd(8, 64, 1024)],
                          wrt=(0,), module=lambda: lmfuse.LayerNorm(1024).to(DEV, BF16)))
    if hasattr(lmfuse, "apply_rotary_pos_emb"):
        def rope_inputs():  # transformers' layout: [B, S, H, D] viewed as [B, H, S, D]
            angle = torch.rand(2, 256, 64, device=DEV) * 6.3
            angle = torch.cat((angle, angle), -1)
            return [rnd(2, 256, 16, 128).transpose(1, 2), rnd(2, 256, 4, 128).transpose(1, 2),
                    angle.cos().to(BF16), angle.sin().to(BF16)]

        cases.append(Case("apply_rotary_pos_emb-bf16", lmfuse.apply_rotary_pos_emb,
                          rope_inputs, wrt=(0, 1)))
    return cases


# --- decode attention ---------------------------------------------------------------------------


def _decode_cases() -> list[Case]:
    B, S, Hq, Hkv, D = 4, 512, 16, 4, 128
    block_len = 16
    per_seq = S // block_len
    num_blocks = B * per_seq + 3

    def contiguous(s_active=1, dtype=BF16, cache_dtype=None, scales=False):
        def make():
            cd = cache_dtype or dtype
            out = [rnd(B, s_active, Hq, D, dtype=dtype), cache((B, S, Hkv, D), cd),
                   cache((B, S, Hkv, D), cd), lengths(B, s_active, S)]
            if scales:
                out += [0.5 + torch.rand(Hkv, device=DEV), 0.5 + torch.rand(Hkv, device=DEV)]
            return out
        return make

    def paged(s_active=1, dtype=BF16):
        def make():
            lens = lengths(B, s_active, S)
            return [rnd(B, s_active, Hq, D, dtype=dtype),
                    cache((num_blocks, block_len, Hkv, D), dtype),
                    cache((num_blocks, block_len, Hkv, D), dtype), lens,
                    paged_table(lens, per_seq, num_blocks, block_len), rnd(Hq, dtype=F32)]
        return make

    da = lmfuse.decode_attention
    return [
        Case("decode_attention-contiguous-gqa-s1-bf16",
             lambda q, k, v, n: da(q, k, v, n), contiguous()),
        Case("decode_attention-contiguous-s2-fp32", lambda q, k, v, n: da(q, k, v, n),
             contiguous(2, F32)),
        Case("decode_attention-paged-s4-window-sinks-bf16",
             lambda q, k, v, n, t, s: da(q, k, v, n, block_table=t, window_size=100, sinks=s),
             paged(4)),
        Case("decode_attention-paged-s1-num_splits8-return_lse-bf16",
             lambda q, k, v, n, t, s: da(q, k, v, n, block_table=t, num_splits=8,
                                         return_lse=True), paged(1)),
        Case("decode_attention-contiguous-s3-num_splits5-return_lse-bf16",
             lambda q, k, v, n: da(q, k, v, n, num_splits=5, return_lse=True), contiguous(3)),
        Case("decode_attention-fp8-cache-scales-s2-bf16",
             lambda q, k, v, n, ks, vs: da(q, k, v, n, k_scale=ks, v_scale=vs,
                                           return_lse=True),
             contiguous(2, BF16, FP8, scales=True)),
    ]


def _merge_cases() -> list[Case]:
    def states(P, dtype):
        def make():
            lses = torch.randn(P, 4, 2, 16, device=DEV) * 3
            lses[0, 0] = float("-inf")  # a partial that saw no key
            lses[:, 1, 0] = float("-inf")  # rows where every partial is empty
            return [rnd(P, 4, 2, 16, 128, dtype=dtype), lses]
        return make

    return [
        Case("merge_attention_states-P4-bf16", lmfuse.merge_attention_states, states(4, BF16)),
        Case("merge_attention_states-P3-fp32", lmfuse.merge_attention_states, states(3, F32)),
    ]


def _append_cases() -> list[Case]:
    B, S, Hkv, D, s_new = 4, 256, 4, 128, 2
    block_len = 16
    per_seq = S // block_len
    num_blocks = B * per_seq + 3

    def contiguous():
        return [cache((B, S, Hkv, D), BF16), cache((B, S, Hkv, D), BF16),
                rnd(B, s_new, Hkv, D), rnd(B, s_new, Hkv, D), lengths(B, 0, S - s_new)]

    def paged_fp8():
        lens = lengths(B, 0, S - s_new)
        return [cache((num_blocks, block_len, Hkv, D), FP8),
                cache((num_blocks, block_len, Hkv, D), FP8), rnd(B, s_new, Hkv, D),
                rnd(B, s_new, Hkv, D), lens,
                paged_table(lens + s_new, per_seq, num_blocks, block_len),
                0.5 + torch.rand(Hkv, device=DEV), 0.5 + torch.rand(Hkv, device=DEV)]

    return [
        Case("kv_cache_append-contiguous-s2-bf16", lmfuse.kv_cache_append, contiguous,
             mutated=(0, 1)),
        Case("kv_cache_append-paged-fp8-scales-s2-bf16",
             lambda kc, vc, k, v, n, t, ks, vs: lmfuse.kv_cache_append(
                 kc, vc, k, v, n, block_table=t, k_scale=ks, v_scale=vs), paged_fp8,
             mutated=(0, 1)),
    ]


HIDDEN, HQ, HKV, HEAD_DIM = 512, 8, 2, 64


def _block(**flags) -> lmfuse.DecodeAttentionBlock:
    blk = lmfuse.DecodeAttentionBlock(HIDDEN, HQ, HKV, HEAD_DIM, device=DEV, dtype=BF16, **flags)
    _refresh_params(blk)
    return blk


def _block_cases() -> list[Case]:
    B, S, s_active = 4, 256, 2

    def make():
        return [rnd(B, s_active, HIDDEN), cache((B, S, HKV, HEAD_DIM), BF16),
                cache((B, S, HKV, HEAD_DIM), BF16), lengths(B, 0, S - s_active)]

    return [Case("DecodeAttentionBlock-contiguous-s2-qknorm-bias-sinks-window-bf16",
                 lambda blk, x, k, v, n: blk(x, k, v, n), make, mutated=(1, 2),
                 module=lambda: _block(qk_norm=True, qkv_bias=True, sinks=True,
                                       window_size=64), module_grads=False)]


CASES = (_softmax_cases() + _module_softmax_cases() + _ce_cases() + _linear_ce_cases()
         + _activation_cases() + _mlp_cases() + _megatron_cases() + _norm_cases()
         + _decode_cases() + _merge_cases() + _append_cases() + _block_cases())


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_op_replays_like_eager(case: Case) -> None:
    print(check_graph(case))


# --- a decode loop over a PagedKVCache, one captured step replayed per token ------------------


@pytest.mark.parametrize("cache_dtype", [BF16, FP8], ids=["bf16-cache", "fp8-cache"])
def test_paged_decode_loop_replays_like_eager(cache_dtype: torch.dtype) -> None:
    """A serving loop: each step reserves a token per sequence in a ``PagedKVCache`` (host
    bookkeeping, then its block table and lengths copied into the graph's static buffers,
    ``reserve(max_blocks=...)`` keeping their shape fixed), and the captured
    ``DecodeAttentionBlock`` step (append into the pool + attention) is replayed. Sequences
    cross block boundaries during the loop. Every step's output and the pool it wrote equal
    an eager step from the same pool."""
    B, block_len, width, steps = 4, 16, 8, 6
    scales = ({} if cache_dtype != FP8 else
              {"k_scale": 0.5 + torch.rand(HKV, device=DEV),
               "v_scale": 0.5 + torch.rand(HKV, device=DEV)})
    pool = lmfuse.PagedKVCache(B * width, block_len, HKV, HEAD_DIM, cache_dtype, DEV, **scales)
    with torch.no_grad():
        for c in pool.k_caches + pool.v_caches:
            c.copy_(torch.randn(c.shape, device=DEV).to(cache_dtype))
    seqs = [pool.add_sequence() for _ in range(B)]
    pool.reserve(seqs, [13, 16, 47, 1])  # prompts already in the pool (its random rows)
    blk = _block(qk_norm=True, sinks=True)
    k_cache, v_cache = pool.k_caches[0], pool.v_caches[0]
    k_scale, v_scale = pool.k_scales[0], pool.v_scales[0]
    x = rnd(B, 1, HIDDEN)
    table = torch.empty((B, width), dtype=torch.int32, device=DEV)
    lens = torch.empty((B,), dtype=torch.int32, device=DEV)

    def load(step) -> None:
        table.copy_(step.block_table)
        lens.copy_(step.seqlens_before)

    def decode() -> torch.Tensor:
        with torch.no_grad():
            return blk(x, k_cache, v_cache, lens, block_table=table, k_scale=k_scale,
                       v_scale=v_scale)

    load(pool.reserve(seqs, 1, max_blocks=width))
    graph, y = capture_graph(decode)
    outputs = []
    for t in range(steps):
        if t:
            load(pool.reserve(seqs, 1, max_blocks=width))
        x.copy_(rnd(B, 1, HIDDEN))
        k0, v0 = k_cache.clone(), v_cache.clone()
        graph.replay()
        got = (y.clone(), k_cache.clone(), v_cache.clone())
        k_cache.copy_(k0)
        v_cache.copy_(v0)
        want = (decode(), k_cache, v_cache)
        for name, a, b in zip(("output", "k pool", "v pool"), got, want):
            assert torch.equal(bits(a), bits(b)), (
                f"step {t}: {name} after replay differs from eager")
        assert not torch.equal(bits(k_cache), bits(k0)), \
            f"step {t}: the step wrote nothing into the pool"
        outputs.append(got[0])
    assert not torch.equal(outputs[0], outputs[1])
    print(f"CUDA graph PagedKVCache+DecodeAttentionBlock decode loop ({cache_dtype}): "
          f"{steps} steps replayed, outputs and pools bitwise equal to eager")
