"""``lmfuse.serving.sampling``: counter-based noise, top-k / top-p filtering, greedy and
sampled rows in one batch."""

from __future__ import annotations

import pytest
import torch

from lmfuse.serving.request import SamplingParams
from lmfuse.serving.sampling import filtered_logits, sample, uniform_noise


def params(**kw) -> SamplingParams:
    return SamplingParams.make(max_new_tokens=4, **kw)


def test_noise_is_uniform_deterministic_and_keyed_by_seed_and_counter() -> None:
    seeds = torch.tensor([1, 1, 2, (1 << 62) + 5])
    counters = torch.tensor([0, 1, 0, 0])
    u = uniform_noise(seeds, counters, 50000)
    assert u.dtype == torch.float64 and bool(((u > 0) & (u < 1)).all())
    assert torch.equal(u, uniform_noise(seeds, counters, 50000))
    for a, b in ((0, 1), (0, 2), (0, 3), (1, 2)):
        assert (u[a] == u[b]).float().mean() < 1e-3  # different streams
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    # Column j of a row does not depend on the vocabulary's size.
    assert torch.equal(uniform_noise(seeds, counters, 100), u[:, :100])


def test_every_seed_bit_keys_its_own_stream() -> None:
    """Seeds differing in any bit (the high half too) draw different noise, and draws of
    one seed at one counter never repeat another seed's at another counter. Seed
    4506039813039718401 had 12345's row key under the earlier 32-bit key (the high half
    added in linearly), so the two sampled the same tokens."""
    base = 4506039813039718401
    seeds = torch.tensor([12345, base] + [base ^ (1 << b) for b in range(63)])
    for counter in (0, 1, 7):
        u = uniform_noise(seeds, torch.full_like(seeds, counter), 4096)
        same = (u[:, None, :] == u[None, :, :]).float().mean(-1)
        same.fill_diagonal_(0.0)
        assert float(same.max()) < 0.01, f"counter {counter}: two seeds share their noise"
    # (seed, counter) pairs: 65 seeds x 8 counters, all distinct streams
    grid_s = seeds.repeat_interleave(8)
    grid_c = torch.arange(8).repeat(len(seeds))
    u = uniform_noise(grid_s, grid_c, 64)
    assert len({tuple(r) for r in u.tolist()}) == len(grid_s)


def test_repetition_penalty_scales_the_seen_tokens_before_temperature() -> None:
    """HF's order: the penalty on the raw logits (seen positive logits divided, negative
    multiplied; a token seen twice once), then temperature and filters; rows without a
    penalty untouched, so their greedy tokens are the plain argmax."""
    from lmfuse.serving.sampling import penalized
    logits = torch.tensor([[4.0, 3.0, -1.0, 2.5], [4.0, 3.0, -1.0, 2.5]])
    rows = [params(repetition_penalty=2.0), params()]
    x = penalized(logits, rows, [[0, 2, 0], [0]])
    assert x[0].tolist() == [2.0, 3.0, -2.0, 2.5] and x[1].tolist() == logits[1].tolist()
    assert sample(logits, rows, [0, 0], [[0, 2, 0], [0]]).tolist() == [1, 0]
    # sampled: the same seed draws from the penalised logits (token 0 at 4 -> 0.04 leaves
    # token 1 alone at the top of a near-greedy temperature)
    hot = [params(temperature=1e-3, seed=5, repetition_penalty=100.0)]
    assert sample(logits[:1], hot, [3], [[0]]).tolist() == [1]
    with pytest.raises(ValueError, match="needs the requests' token histories"):
        sample(logits, rows, [0, 0])


def test_top_k_and_top_p_filter_each_row_by_its_own_options() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]] * 4)
    rows = [params(temperature=1.0, top_k=2), params(temperature=1.0, top_p=0.5),
            params(temperature=2.0), params(temperature=1.0, top_k=3, top_p=0.999)]
    x = filtered_logits(logits, rows)
    inf = float("-inf")
    assert x[0].tolist() == [inf, 0.0, inf, -1.0, inf]  # less the row's maximum
    # softmax of [3, 2, 1, 0, -1]: 0.636, 0.234, ...: the top token alone reaches 0.5
    assert x[1].tolist() == [inf, 0.0, inf, inf, inf]
    assert torch.allclose(x[2], (logits[2] - 3.0) / 2)
    assert x[3].tolist() == [inf, 0.0, -2.0, -1.0, inf]
    # top_k=0 is no top-k, as in Hugging Face's generation config (and vLLM's)
    assert params(temperature=1.0, top_k=0).top_k is None
    assert torch.equal(filtered_logits(logits[:1], [params(temperature=1.0, top_k=0)]),
                       logits[:1] - 3.0)


@pytest.mark.parametrize("temperature", [1e-50, 1e-40, 1e-38, 1e-30])
def test_a_tiny_temperature_draws_the_top_token(temperature) -> None:
    """Temperatures that round to 0 in float32, or make the top logits overflow when
    divided: the draw is the greedy token (not the lowest id of a tie of infinities, nor
    NaN's), and a NaN logit is still the one drawn, as greedy's."""
    logits = torch.tensor([[5.0, 10.0, 1.0, 0.0], [5.0, 10.0, float("nan"), 0.0]])
    rows = [params(temperature=temperature, seed=s) for s in (0, 1)]
    for step in range(4):
        assert sample(logits, rows, [step, step]).tolist() == [1, 2]


def test_sample_mixes_greedy_and_sampled_rows() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 300)
    rows = [params(), params(temperature=1.0, seed=3), params(),
            params(temperature=0.7, top_k=5, seed=4), params(temperature=1.0, top_p=0.9),
            params(temperature=1.0, top_k=1, seed=9)]
    got = sample(logits, rows, [0, 0, 1, 2, 0, 5])
    assert got.dtype == torch.int64 and got.shape == (6,)
    best = logits.argmax(-1)
    assert got[0] == best[0] and got[2] == best[2] and got[5] == best[5]
    assert int(got[3]) in torch.topk(logits[3], 5).indices.tolist()
    assert torch.equal(got, sample(logits, rows, [0, 0, 1, 2, 0, 5]))
    # Another draw index, another token (with 300 candidates, almost surely).
    draws = {int(sample(logits[1:2], rows[1:2], [i])[0]) for i in range(20)}
    assert len(draws) > 5


def test_sampling_follows_the_distribution() -> None:
    """Over many draw indices, each token's frequency matches its softmax probability."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = params(temperature=1.0, seed=11)
    n = 4000
    counts = torch.zeros(4)
    for start in range(0, n, 500):
        rows = [p] * 500
        toks = sample(logits.expand(500, 4), rows, list(range(start, start + 500)))
        counts += torch.bincount(toks, minlength=4).float()
    freq = counts / n
    assert torch.allclose(freq, torch.softmax(logits[0], 0), atol=0.03), freq


@pytest.mark.parametrize("kw, error, match", [
    ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be >= 1"),
    ({"max_new_tokens": 2, "temperature": float("nan")}, ValueError, "temperature must be finite"),
    ({"max_new_tokens": 2, "top_p": 0.0}, ValueError, "top_p must be in"),
    ({"max_new_tokens": 2, "eos_token_id": "2"}, TypeError, "eos_token_id must be"),
    ({"max_new_tokens": 2, "eos_token_id": [1, 2.0]}, TypeError, "eos_token_id must be an int"),
    ({"max_new_tokens": 2, "seed": 1.5}, TypeError, "seed must be an int"),
])
def test_bad_sampling_params(kw, error, match) -> None:
    with pytest.raises(error, match=match):
        SamplingParams.make(**kw)


def test_unseeded_requests_draw_their_own_seeds() -> None:
    seeds = {SamplingParams.make(max_new_tokens=1, temperature=1.0).seed for _ in range(8)}
    assert len(seeds) == 8 and all(0 <= s < (1 << 63) for s in seeds)
    assert SamplingParams.make(max_new_tokens=1, seed=-1).seed == (1 << 63) - 1


def test_top_p_keeps_transformers_tokens_among_ties_at_the_cut() -> None:
    """Tied logits at the top-p boundary: the ids transformers' TopPLogitsWarper keeps (the
    highest of the tie), and the same mask as the warper's on random rows with ties
    (rounded logits, as bfloat16's), temperatures and top-k before it."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    x = filtered_logits(torch.tensor([[1.0, 1.0, 1.0, 0.0]]),
                        [params(temperature=1.0, top_p=0.5)])
    assert torch.isfinite(x[0]).tolist() == [False, True, True, False]
    g = torch.Generator().manual_seed(0)
    for case in range(200):
        logits = (torch.randn(1, 12, generator=g) * 2).round()  # many ties
        t = [1.0, 0.7, 1.3][case % 3]
        top_p = [0.3, 0.5, 0.8, 0.95][case % 4]
        top_k = [None, 3, 6][case % 3]
        scores = TemperatureLogitsWarper(t)(None, logits.clone())
        if top_k is not None:
            scores = TopKLogitsWarper(top_k)(None, scores)
        scores = TopPLogitsWarper(top_p)(None, scores)
        ours = filtered_logits(logits, [params(temperature=t, top_p=top_p, top_k=top_k)])
        assert torch.equal(torch.isfinite(ours), torch.isfinite(scores)), (case, logits)
