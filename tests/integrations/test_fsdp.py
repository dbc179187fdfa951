"""apply_lmfuse on models sharded by FSDP2 (``fully_shard``) on 2 gloo CPU ranks: the
probes of the detected families meet the sharded weights (DTensors) and must still find the
norms (RMSNorms, Nemotron's LayerNorm1P), MLPs and experts they find unsharded, and the
patched model must train as the unpatched one under the same sharding."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "distributed"))
from spawn import spawn_gloo  # noqa: E402

pytest.importorskip("transformers")
fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("this torch has no FSDP2 fully_shard", allow_module_level=True)


def _counts(model) -> dict:
    p = model.lmfuse_patches
    return {k: v if isinstance(v, bool) else len(v) for k, v in p.items()}


def _sharded_rank(rank: int, world: int, model_type: str, per_module: bool) -> None:
    from torch.distributed.fsdp import fully_shard
    from helpers import tiny_causal_lm
    from lmfuse.integrations.transformers import apply_lmfuse

    unsharded = tiny_causal_lm(model_type)
    apply_lmfuse(unsharded)
    want = _counts(unsharded)
    assert want["rms_norm"] or want["layer_norm"], want
    assert want["moe_experts"] or want["swiglu"] or want["squared_relu"], want

    models = [tiny_causal_lm(model_type).train() for _ in range(2)]
    for m in models:
        for layer in m.model.layers:
            if per_module:  # the MLP and a norm units of their own, as wrap policies make
                fully_shard(layer.mlp)
                fully_shard(layer.post_attention_layernorm)
            fully_shard(layer)
        fully_shard(m)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left unpatched, nothing warned
        apply_lmfuse(models[1])
    assert _counts(models[1]) == want
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, models[0].config.vocab_size, (2, 8), generator=g)
    labels = ids.clone()
    labels[:, :2] = -100
    losses = []
    for m in models:
        loss = m(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        torch.testing.assert_close(b.grad.full_tensor(), a.grad.full_tensor(), rtol=1e-4,
                                   atol=1e-6, msg=name)


@pytest.mark.parametrize("model_type, per_module", [("olmo2", False), ("gpt_oss", False),
                                                     ("olmo2", True), ("nemotron", True)])
def test_apply_lmfuse_after_fully_shard(model_type: str, per_module: bool) -> None:
    """OLMo-2 (norms and MLP found by probes), GPT-OSS (its clamped experts' probe) and
    Nemotron (its LayerNorm1P's probe): patched after fully_shard (of the layers, or of each
    MLP and a norm too), the same patches as unsharded, no warning, and the sharded training
    step's loss and gradients equal the unpatched sharded model's."""
    spawn_gloo(2, _sharded_rank, model_type, per_module, timeout=240)
