"""Shared test helpers: tolerances by dtype, relative error, random inputs.

The gloo spawn helper for parallel ops is in ``tests/distributed/spawn.py``.

Tolerances are for comparing an implementation against the reference *in the same
dtype*: both compute in float32 (float64 for float64) and round once to the output
dtype, so the difference is a few roundings of that dtype. Two metrics must both hold:

* ``rel_err(a, b) = ||a - b|| / ||b||`` (whole-tensor, in float64);
* ``max|a - b| / max|b|`` (so one wrong element in a large tensor is not averaged away).

Values: about 4 ulps of the dtype for the half types (where the Triton backward reads
the output rounded to that dtype), and float32 / float64 well above their rounding noise
but far below any real error. Never widen one to make a test pass: find out why.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

TOL: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}

_TINY = 1e-30


def tol(dtype: torch.dtype) -> float:
    """The comparison tolerance for results in ``dtype``."""
    return TOL[dtype]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / max(||b||, tiny)``, in float64."""
    a64, b64 = a.detach().to(torch.float64), b.detach().to(torch.float64)
    return (torch.linalg.vector_norm(a64 - b64) /
            max(torch.linalg.vector_norm(b64).item(), _TINY)).item()


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max(max|b|, tiny)``, in float64."""
    a64, b64 = a.detach().to(torch.float64), b.detach().to(torch.float64)
    if a64.numel() == 0:
        return 0.0
    return ((a64 - b64).abs().max() / max(b64.abs().max().item(), _TINY)).item()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                 what: str) -> None:
    """Assert ``actual`` matches ``expected`` within ``TOL[dtype]``; ``what`` names the case."""
    assert isinstance(actual, torch.Tensor), f"{what}: got {type(actual).__name__}, not a tensor"
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    )
    assert not torch.isnan(actual).any(), f"{what}: result has NaN"
    assert torch.equal(torch.isfinite(actual), torch.isfinite(expected)), (
        f"{what}: finite/non-finite pattern differs from the expected one"
    )
    limit = tol(dtype)
    fin = torch.isfinite(expected)
    err = rel_err(actual[fin], expected[fin])
    assert err <= limit, f"{what}: relative error {err:.3e} > {limit:.1e} ({dtype})"
    err_max = max_rel_err(actual[fin], expected[fin])
    assert err_max <= limit, (
        f"{what}: max abs error / max |expected| = {err_max:.3e} > {limit:.1e} ({dtype})"
    )


def randn(shape: tuple[int, ...] | list[int], dtype: torch.dtype = torch.float32, *,
          scale: float = 1.0, requires_grad: bool = False) -> torch.Tensor:
    """Standard-normal values times ``scale``, drawn in float32 then cast (never zeros)."""
    t = torch.randn(tuple(shape), dtype=torch.float32) * scale
    # An exact 0 has no sign and no relative error; it would hide scaling bugs.
    t = torch.where(t == 0, torch.full_like(t, 1e-3), t).to(dtype)
    return t.requires_grad_(requires_grad)


def rand_bool(shape: tuple[int, ...] | list[int], p_true: float = 0.3) -> torch.Tensor:
    """A bool tensor, True with probability ``p_true``."""
    return torch.rand(tuple(shape)) < p_true


# --- Megatron-Core's activation formulas (tests of lmfuse.activations) ----------------


def megatron_act(name: str, a: torch.Tensor) -> torch.Tensor:
    """Megatron-Core's activation formulas, written out (its constants)."""
    if name == "gelu":
        return a * 0.5 * (1.0 + torch.tanh(0.79788456 * a * (1.0 + 0.044715 * a * a)))
    if name == "silu":
        return a * torch.sigmoid(a)
    if name == "quick_gelu":
        return a * torch.sigmoid(1.702 * a)
    assert name == "squared_relu"
    return torch.relu(a) ** 2


def megatron_act_grad(name: str, a: torch.Tensor) -> torch.Tensor:
    """Megatron's hand-written derivatives (not autograd)."""
    if name == "gelu":
        t = torch.tanh(0.79788456 * a * (1.0 + 0.044715 * a * a))
        return 0.5 * a * ((1.0 - t * t) * (0.79788456 + 0.1070322243 * a * a)) + 0.5 * (1.0 + t)
    if name == "silu":
        s = torch.sigmoid(a)
        return s * (1.0 + a * (1.0 - s))
    if name == "quick_gelu":
        s = torch.sigmoid(1.702 * a)
        return s * (1.0 + 1.702 * a * (1.0 - s))
    assert name == "squared_relu"
    return 2.0 * torch.relu(a)


def to_paged(caches, lens, block_len: int, *, extra_columns: int = 1, spare_blocks: int = 2,
             fill: float = float("nan"), index_dtype: torch.dtype = torch.int32,
             generator=None):
    """The same sequences of each ``[B, S, Hkv, D]`` cache as pools ``[num_blocks, block_len,
    Hkv, D]`` sharing one block table ``[B, blocks + extra_columns]``: block ids a random
    permutation of the pool (``spare_blocks`` of them unused), rows no sequence holds set to
    ``fill`` (NaN: a kernel that reads them shows it), -1 after each sequence's blocks."""
    B, S, Hkv, D = caches[0].shape
    per_seq = max(1, -(-S // block_len))
    num_blocks = B * per_seq + spare_blocks
    order = torch.randperm(num_blocks, generator=generator)
    pools = [torch.full((num_blocks, block_len, Hkv, D), fill).to(c.dtype) for c in caches]
    table = torch.full((B, per_seq + extra_columns), -1, dtype=index_dtype)
    for b, length in enumerate(lens):
        for n in range(-(-int(length) // block_len)):
            blk = int(order[b * per_seq + n])
            table[b, n] = blk
            for pool, cache in zip(pools, caches):
                rows = cache[b, n * block_len:(n + 1) * block_len]
                pool[blk, :rows.shape[0]] = rows
    return pools, table


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``lmfuse.cli.main(argv)`` -> (exit code, stdout, stderr), ``capsys`` a pytest capture
    fixture; argparse exits become exit codes."""
    from lmfuse import cli

    try:
        code = cli.main(list(argv))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


# Tiny random-weight causal LMs of every family lmfuse.serving supports: small enough for
# CPU float32 tests, with every feature the family has switched on where it would stay
# silent at default sizes (windows shorter than the test prompts, tight soft-caps).
TINY_LM = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=97,
               max_position_embeddings=256)
TINY_LM_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
                    "gpt_oss")
#: The other mixture-of-experts families the Generator serves (the model's own forward, its
#: experts through lmfuse.moe_experts in CUDA graphs).
TINY_MOE_LM_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe")


def capture_graph(fn: Callable[[], Any]) -> tuple[Any, Any]:
    """``fn`` run three times on a side stream (warm-up: compilation, allocator pools), then
    captured in a CUDA graph: ``(graph, the captured call's result)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def tiny_causal_lm(model_type: str, seed: int = 0, **overrides: Any) -> Any:
    """A ``transformers`` causal LM of ``model_type`` with random weights, float32, eval
    mode, ``attn_implementation="eager"`` (the exact reference: soft-caps and sinks
    included)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(TINY_LM)
    if model_type == "gpt_oss":
        kw.update(num_local_experts=4, num_experts_per_tok=2,
                  rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "truncate": False,
                                   "original_max_position_embeddings": 64,
                                   "rope_theta": 150000.0})
    if model_type in ("mixtral", "granitemoe"):
        kw.update(num_local_experts=4, num_experts_per_tok=2)
    if model_type in ("qwen2_moe", "qwen3_moe", "olmoe"):
        kw.update(num_experts=4, num_experts_per_tok=2)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        kw.update(moe_intermediate_size=32)
    if model_type == "qwen2_moe":
        kw.update(shared_expert_intermediate_size=48)
    if model_type == "mixtral":
        kw["sliding_window"] = 6
    if model_type == "granitemoe":  # its scalings away from 1
        kw.update(embedding_multiplier=2.0, logits_scaling=3.0, residual_multiplier=0.5,
                  attention_multiplier=0.2)
    if model_type == "gemma":
        # Tied, sqrt(hidden)-scaled embeddings at random init just repeat the last token.
        kw["tie_word_embeddings"] = False
    if model_type in ("mistral", "gemma2", "gemma3_text", "gpt_oss"):
        kw["sliding_window"] = 6
    if model_type == "gemma2":
        kw.update(attn_logit_softcapping=2.0, final_logit_softcapping=5.0)
    if model_type == "llama":
        kw["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64}
    kw.update(overrides)
    config = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.eval()


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """``model.generate(do_sample=False)``'s new tokens for one prompt, exactly
    ``max_new_tokens`` of them (no end-of-sequence stop)."""
    ids = torch.tensor([prompt])
    # The mask given: with pad_token_id=0 and none, HF masks the prompt's own 0 tokens.
    out = model.generate(ids, attention_mask=torch.ones_like(ids),
                         max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# --- NaN/inf and property tests (tests/*/test_nonfinite.py, test_properties.py) ----------


def _test_scale() -> int:
    raw = os.environ.get("LMFUSE_TEST_SCALE", "1")
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ValueError(f"LMFUSE_TEST_SCALE must be a positive integer, got {raw!r}")
    return int(raw)


#: ``LMFUSE_TEST_SCALE=n`` multiplies the property tests' drawn sizes (for a GPU run).
SCALE = _test_scale()
#: Where the NaN/inf and property tests put their tensors: CUDA under
#: ``LMFUSE_GPU_TESTS=1`` on a CUDA machine, else the CPU.
TEST_DEVICE = torch.device("cuda" if os.environ.get("LMFUSE_GPU_TESTS") == "1"
                           and torch.cuda.is_available() else "cpu")


@contextlib.contextmanager
def value_checks_on() -> Iterator[None]:
    """``lmfuse.set_checks(True)`` inside the block, as it was after: a CUDA call then
    checks its input values (out-of-range targets, ...) as a CPU call always does."""
    import lmfuse
    from lmfuse import _dispatch

    before = _dispatch._VALUE_CHECKS
    lmfuse.set_checks(True)
    try:
        yield
    finally:
        lmfuse.set_checks(before)


def flush_subnormal(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` with magnitudes below the smallest normal number of ``dtype`` (and of float32,
    the compute type) set to 0: whether those survive depends on the backend (a GPU
    flushes float32 subnormals), so they are compared as zeros."""
    tiny = max(torch.finfo(dtype).tiny, torch.finfo(torch.float32).tiny)
    return torch.where(t.abs() < tiny, torch.zeros_like(t), t)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, what: str,
                   values: torch.Tensor | None = None, *, pattern_only: bool = False) -> None:
    """NaN, +inf and -inf of ``actual`` exactly where ``expected`` (float64, rounded to
    ``actual``'s dtype) has them; unless ``pattern_only``, the finite values of ``actual``
    within the dtype's tolerance of ``values`` (default: ``expected``) rounded to the
    dtype, subnormals compared as zeros."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}"
    want = expected.detach().to(actual.dtype)
    for name, where in (("NaN", torch.isnan), ("+inf", torch.isposinf),
                        ("-inf", torch.isneginf)):
        got, exp = where(actual.detach()), where(want)
        if not torch.equal(got, exp):
            at = (got != exp).nonzero()[:4].tolist()
            raise AssertionError(f"{what}: {name} pattern differs at {at}: got "
                                 f"{[actual[tuple(i)].item() for i in at]}, expected "
                                 f"{[expected[tuple(i)].item() for i in at]}")
    if pattern_only:
        return
    fin = torch.isfinite(want)
    ref = want if values is None else values.detach().to(actual.dtype)
    got = flush_subnormal(actual.detach()[fin].to(torch.float64), actual.dtype)
    assert_close(got.cpu(), flush_subnormal(ref[fin].to(torch.float64), actual.dtype).cpu(),
                 actual.dtype, what)


def inject(t: torch.Tensor, position: int, value: float) -> None:
    """``value`` at one element of ``t`` (any strides), the ``position``-th modulo its size."""
    if t.numel():
        index = np.unravel_index(position % t.numel(), tuple(t.shape))
        with torch.no_grad():
            t[tuple(int(i) for i in index)] = value


# --- cross-entropy launches ------------------------------------------------------------------

# Launches of the cross-entropy kernels forced through ``lmfuse.cross_entropy.ops._config``
# (the option suites): the table's own, streamed 16-column chunks, 4-row tiles, the sliced
# fused launch, and the whole-row fused ones with their 2-D stats loop (with prefetch or not).
_CE_CHUNKED = dict(BLOCK_M=1, BLOCK_V=16, SINGLE_BLOCK=False, num_warps=4)
CE_LAUNCHES: dict[str, Any] = {
    "table": None,
    "chunked": _CE_CHUNKED,
    "tile-4rows": dict(BLOCK_M=4, BLOCK_V=64, SINGLE_BLOCK=True, num_warps=4),
    "sliced": dict(_CE_CHUNKED, fused=dict(BLOCK_V=16, num_warps=4, programs_per_sm=2,
                                           slice=32, lag=1)),
    "vec-prefetch": dict(_CE_CHUNKED, fused=dict(BLOCK_V=16, num_warps=4, programs_per_sm=1,
                                                 hints=1, vec=8, prefetch=1)),
    "vec": dict(_CE_CHUNKED, fused=dict(BLOCK_V=32, num_warps=2, programs_per_sm=2, vec=4)),
}


def ce_config(config: dict[str, Any]) -> Any:
    """The ``cross_entropy.ops.CEConfig`` a launch dict (``BLOCK_M``, ``BLOCK_V``,
    ``SINGLE_BLOCK``, ``num_warps`` and, for streamed rows, ``fused``: a table entry)
    describes, for forcing ``ops._config``. Streamed rows without ``fused`` take the stats
    chunks' block and warps for the gradient pass too, and the table's programs per SM."""
    from lmfuse import tuning
    from lmfuse.cross_entropy.ops import CEConfig, StreamLaunch

    tiles = tuning.RowTiles(config["BLOCK_M"], config["BLOCK_V"], config["SINGLE_BLOCK"],
                            config["num_warps"])
    if tiles.single:
        return CEConfig(tiles)
    per_sm = tuning.table("cross_entropy", torch.device("cpu"))["programs_per_sm"]
    fused = config.get("fused") or dict(BLOCK_V=tiles.block_n, num_warps=tiles.num_warps,
                                        programs_per_sm=per_sm)
    return CEConfig(tiles, per_sm, StreamLaunch.of(fused))


def force_ce_launch(mp: Any, name: str) -> None:
    """Make every cross-entropy call under the monkeypatch ``mp`` take launch ``name`` of
    :data:`CE_LAUNCHES` (``"table"``: the tuning table's, unchanged)."""
    from lmfuse.cross_entropy import ops

    config = CE_LAUNCHES[name]
    if config is not None:
        forced = ce_config(config)
        mp.setattr(ops, "_config", lambda V, device, softcap=False, itemsize=2, aligned=True:
                   forced)


def ce_through_custom_ops(mp: Any) -> None:
    """Make the cross-entropy launches under the monkeypatch ``mp`` go through their
    ``torch.library`` custom ops, as compiled code does (eager calls run them directly), so
    a dispatch mode sees them and every argument crosses the ops' schemas."""
    from lmfuse.cross_entropy import ops, vocab_parallel

    for module in (ops, vocab_parallel):
        for name, launch in list(vars(module).items()):  # each kernel_op's result
            if isinstance(getattr(launch, "op", None), torch.library.CustomOpDef):
                mp.setattr(module, name, launch.op)


# moe_experts' activation cases: (activation, linear_offset, clamp_value, gate_up_layout)
MOE_ACT_CASES = [
    ("swiglu", 0.0, None, "halves"),
    ("swiglu", 0.0, None, "interleaved"),
    ("geglu", 0.0, None, "halves"),
    ("geglu", 0.0, None, "interleaved"),
    ("quick_geglu", 1.0, 0.7, "halves"),  # GPT-OSS's form, a clamp that bites
    ("quick_geglu", 1.0, 0.7, "interleaved"),
    ("squared_relu", 0.0, None, "halves"),
]


def assert_same_grads(a: torch.nn.Module, b: torch.nn.Module, what: str,
                      zero_suffixes: tuple[str, ...] = ()) -> None:
    """Every parameter of ``b`` has ``a``'s gradient (presence, then values within the
    float32 tolerance). Parameters named with a suffix in ``zero_suffixes`` have a gradient
    that is zero but for rounding (a key bias, which the softmax cancels): both below 1e-6,
    where no relative comparison can hold."""
    grads_b = dict(b.named_parameters())
    for name, p in a.named_parameters():
        q = grads_b[name]
        assert (p.grad is None) == (q.grad is None), f"{what}: {name} grad presence differs"
        if p.grad is None:
            continue
        if name.endswith(zero_suffixes):
            assert p.grad.abs().max() < 1e-6 and q.grad.abs().max() < 1e-6, name
            continue
        assert_close(q.grad, p.grad, torch.float32, f"{what}: grad of {name}")


COPY_ROWS = ("lmfuse", "torch", "torch.compile", "liger-kernel", "copy")


def check_copy_rows(rows: list[dict], cases: list[str]) -> dict[str, dict[str, dict]]:
    """A benchmark run against the copy rate (``lmfuse.bench.common.run_against_copy``),
    written as JSON results ``rows``: each of ``cases`` has the rows of :data:`COPY_ROWS`
    in order, lmfuse, torch, torch.compile and the copy timed, lmfuse's ratio 1, each
    float32 peer within 1e-5 of lmfuse's result, and Liger-Kernel timed or saying why it
    failed (in the interpreter its libdevice calls fail). Returns case -> impl -> row."""
    assert list(dict.fromkeys(r["case"] for r in rows)) == cases
    out = {}
    for name in cases:
        by = {r["impl"]: r for r in rows if r["case"] == name}
        assert list(by) == list(COPY_ROWS)
        for impl in ("lmfuse", "torch", "torch.compile", "copy"):
            ms = by[impl]["ms"]
            assert ms is not None and math.isfinite(ms) and ms > 0, (name, impl, by[impl])
        assert by["lmfuse"]["ratio"] == 1.0
        for impl in ("torch", "torch.compile"):  # float32: lmfuse's result up to rounding
            note = by[impl]["note"]
            diff = re.search(r"rel\. diff ([0-9.e+-]+)", note)
            assert diff and float(diff.group(1)) < 1e-5 and "CHECK" not in note, note
        liger = by["liger-kernel"]
        assert (liger["ms"] or 0) > 0 or liger["note"].startswith("failed: "), liger
        out[name] = by
    return out


def labelled_ids(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` of a tiny causal-LM batch (2 x 7 ids in ``[3, vocab)``, fixed
    seed), the first three labels of the first row ignored (-100)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (2, 7), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels
