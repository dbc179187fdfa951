"""``lmfuse demo`` (src/lmfuse/demo.py), shortened: the lmfuse model learns, its loss curve
is the plain PyTorch model's, and paged decoding continues prompts as a full re-forward
does.

conftest.py sets TRITON_INTERPRET=1, under which ``impl="auto"`` would run the Triton
kernels in the interpreter on the CPU (slow at these shapes); the demo runs here with
``impl="torch"``, the ops' reference paths.
"""

from __future__ import annotations

import pytest

from lmfuse.demo import DemoConfig, run

SMALL = dict(steps=40, d_model=32, n_layers=2, n_heads=2, ffn=64, seq_len=32, batch=4,
             lr=1e-2, impl="torch", new_tokens=8, quiet=True)


@pytest.fixture(scope="module")
def result():
    return run(DemoConfig(**SMALL))


def test_demo_loss_falls(result):
    assert len(result.lmfuse.losses) == SMALL["steps"]
    assert result.lmfuse.losses[-1] < 0.8 * result.lmfuse.losses[0]


def test_demo_lmfuse_matches_plain_pytorch(result):
    # fp32, same weights and batches: the curves differ by rounding only.
    assert result.max_loss_rel_diff < 1e-3, result.max_loss_diff


def test_demo_paged_decode_matches_full_forward(result):
    assert result.decoded == result.full_forward
    assert result.decode_logits_ok and result.decode_logit_err < 1e-4, result.decode_logit_err
    assert [len(c) for c in result.decoded] == [SMALL["new_tokens"]] * len(result.prompts)
    assert len({len(p) for p in result.prompts}) > 1  # prompts of different lengths


def test_demo_sampling_and_custom_text(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    r = run(DemoConfig(**{**SMALL, "steps": 5}, text=str(text), sample=True))
    assert r.sampled is not None and all(len(c) == SMALL["new_tokens"] for c in r.sampled)
    assert all(0 <= t < 256 for c in r.sampled for t in c)
