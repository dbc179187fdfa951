"""``routing.route_small`` (one launch of ``moe_route_kernel``) against the torch ops it
replaces: ``ops._route``, ``ops._tiles`` and the router weights gathered in sorted order, bit
for bit (``torch.equal``, and the same dtypes and shapes).

Cases: every ``(T, k, E)`` of T in {1, 2, 5, 16, 64}, k in {1, 2, 4, 8}, E in {1, 4, 32,
128} with ``k <= E`` that ``route_small_ok`` takes, in groups by ``(T, E)``; random ids with
repeats inside a token (``randint``: ties, empty experts) and distinct ones (``randperm``, as
a top-k router gives them); block_m 16 and 64; int64/int32/int16/int8/uint8 ids,
float32/bfloat16/float16/float64 router weights; non-contiguous inputs; one expert for every
pair (the order must stay the pairs'); no pairs; one launch; ``route_small_ok``'s limits; a
CUDA-graph replay on new ids (on a GPU only).

Tensors live on ``helpers.TEST_DEVICE`` (the CPU and Triton's interpreter in CI).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from helpers import TEST_DEVICE, capture_graph

from lmfuse.moe import ops, routing
from lmfuse.moe.routing import MAX_ELEMENTS, MAX_ROWS, route_small, route_small_ok

NAMES = ("perm", "token", "offsets", "inv", "tiles", "weights")
TS, KS, ES = (1, 2, 5, 16, 64), (1, 2, 4, 8), (1, 4, 32, 128)
ID_DTYPES = (torch.int64, torch.int32, torch.int16)
RW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def expected(ids: torch.Tensor, rw: torch.Tensor, E: int, block_m: int) -> tuple:
    """What ``ops._forward`` computes with the torch ops, in ``route_small``'s order."""
    perm, token, offsets, inv = ops._route(ids, E)
    weights = rw.reshape(-1).index_select(0, perm).to(torch.float32)
    return perm, token, offsets, inv, ops._tiles(offsets, ids.numel(), block_m), weights


def assert_same(ids: torch.Tensor, rw: torch.Tensor, E: int, block_m: int, what: str) -> None:
    got = route_small(ids, rw, E, block_m)
    want = expected(ids, rw, E, block_m)
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (
            f"{what}: {name} is {g.dtype} {tuple(g.shape)}, expected {w.dtype} {tuple(w.shape)}")
        assert torch.equal(g, w), f"{what}: {name}\n got {g.tolist()}\nwant {w.tolist()}"


def make_ids(T: int, k: int, E: int, distinct: bool, dtype=torch.int64) -> torch.Tensor:
    """``[T, k]`` ids: each token's distinct (a top-k router's), or drawn with repeats."""
    if distinct:
        ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    else:
        ids = torch.randint(0, E, (T, k))
    return ids.to(dtype).to(TEST_DEVICE)


def make_rw(T: int, k: int, dtype=torch.float32) -> torch.Tensor:
    return (torch.rand(T, k) + 0.01).to(dtype).to(TEST_DEVICE)


@pytest.mark.parametrize("E", ES)
@pytest.mark.parametrize("T", TS)
def test_matches_torch_ops(T: int, E: int) -> None:
    """Every ``k`` the size limit takes, ids with repeats and distinct, both block sizes,
    the id and weight dtypes taken in turn."""
    ran = 0
    for n, k in enumerate(KS):
        if k > E or not route_small_ok(T * k, E, 64):
            continue
        for distinct in (False, True):
            block_m = (16, 64)[(n + distinct) % 2]
            id_dtype = ID_DTYPES[(n + T) % len(ID_DTYPES)]
            rw_dtype = RW_DTYPES[(n + E + distinct) % len(RW_DTYPES)]
            ids = make_ids(T, k, E, distinct, id_dtype)
            assert_same(ids, make_rw(T, k, rw_dtype), E, block_m,
                        f"T={T} k={k} E={E} block_m={block_m} distinct={distinct} "
                        f"{id_dtype} {rw_dtype}")
            ran += 1
    assert ran, f"T={T} E={E}: no k within the limits"


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32, torch.int16, torch.int8,
                                      torch.uint8])
@pytest.mark.parametrize("rw_dtype", [torch.float32, torch.bfloat16, torch.float16,
                                      torch.float64])
def test_dtypes(id_dtype: torch.dtype, rw_dtype: torch.dtype) -> None:
    """Every integer dtype of ids and float dtype of weights ``moe_experts`` takes (float64
    weights are rounded to float32 to nearest, as ``.to(torch.float32)`` does)."""
    T, k, E = 16, 4, 32
    rw = torch.randn(T, k, dtype=torch.float64).to(rw_dtype).to(TEST_DEVICE)
    assert_same(make_ids(T, k, E, False, id_dtype), rw, E, 16, f"{id_dtype} {rw_dtype}")


def test_non_contiguous_inputs() -> None:
    """Strided ids and weights (a transposed top-k output, a slice) are read in place."""
    T, k, E = 12, 3, 8
    ids = make_ids(k, T, E, False).t()
    rw = make_rw(T, 2 * k)[:, ::2]
    assert not ids.is_contiguous() and not rw.is_contiguous()
    assert_same(ids, rw, E, 16, "strided")


def test_one_expert_keeps_pair_order() -> None:
    """Every pair on one expert (the others empty): the sort keeps the pairs' order, and that
    expert's rows fill several tiles, the last one partial."""
    T, k, E = 20, 2, 4
    ids = torch.full((T, k), 2, dtype=torch.int64, device=TEST_DEVICE)
    perm, token, offsets, inv, tiles, _ = route_small(ids, make_rw(T, k), E, 16)
    assert torch.equal(perm.cpu(), torch.arange(T * k))
    assert offsets.tolist() == [0, 0, 0, T * k, T * k]
    assert tiles.tolist()[:4] == [[2, 0, 16], [2, 16, 32], [2, 32, 40], [0, 0, 0]]
    assert_same(ids, make_rw(T, k), E, 16, "one expert")


def test_ids_out_of_range_still_give_a_whole_permutation() -> None:
    """On CUDA the ids' range is not checked by default (lmfuse.set_checks turns it on), and
    some expert-parallel code marks dropped pairs -1 or E: such pairs belong to no expert,
    take the rows after the experts' in pair order, and every output stays a permutation
    (no unwritten row for a later kernel to follow); the valid pairs' routing and tiles are
    those of the same call without the bad pairs."""
    E = 8
    ids = torch.tensor([[0, 8], [1, 2], [3, -1], [4, 5]], device=TEST_DEVICE)
    rw = make_rw(4, 2)
    perm, token, offsets, inv, tiles, weights = route_small(ids, rw, E, 16)
    assert sorted(perm.tolist()) == list(range(8))
    assert torch.equal(inv[perm].cpu(), torch.arange(8))
    assert perm.tolist()[-2:] == [1, 5]  # the two bad pairs, in pair order
    assert token.tolist() == [p // 2 for p in perm.tolist()]
    assert torch.equal(weights, rw.reshape(-1)[perm].float())
    assert offsets.tolist() == [0, 1, 2, 3, 4, 5, 6, 6, 6]
    assert tiles.tolist()[:7] == [[e, r, r + 1] for e, r in
                                  zip([0, 1, 2, 3, 4, 5], range(6))] + [[0, 0, 0]]


def test_no_pairs() -> None:
    """No tokens: empty routing, offsets all zero, no tile slots."""
    E = 4
    ids = torch.zeros(0, 2, dtype=torch.int64, device=TEST_DEVICE)
    rw = torch.zeros(0, 2, device=TEST_DEVICE)
    assert route_small_ok(0, E, 16)
    assert_same(ids, rw, E, 16, "no pairs")
    assert route_small(ids, rw, E, 16)[2].tolist() == [0] * (E + 1)


def test_one_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole routing is one launch of one program."""
    kernel = routing._kernels().moe_route_kernel
    grids = []

    class Counting:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(routing, "_kernels",
                        lambda: SimpleNamespace(moe_route_kernel=Counting()))
    ids = make_ids(64, 4, 32, True)
    assert_same(ids, make_rw(64, 4), 32, 16, "GPT-OSS decode size")
    assert grids == [(1,)]


def test_limits() -> None:
    """Taken up to the register budget (padded pairs x padded experts) and 1024 pairs;
    refused beyond, and ``route_small`` refuses what ``route_small_ok`` refuses."""
    assert MAX_ROWS == 1024 and MAX_ELEMENTS == 16384
    assert route_small_ok(1024, 16, 16) and route_small_ok(512, 32, 64)
    assert route_small_ok(128, 128, 16) and route_small_ok(256, 33, 16)  # 256 x 64
    assert route_small_ok(64 * 4, 32, 16)  # GPT-OSS, 64 tokens
    assert route_small_ok(1024, 1, 1) and route_small_ok(1, 16384, 16)
    assert not route_small_ok(1025, 1, 16)
    assert not route_small_ok(129, 128, 16)
    assert not route_small_ok(513, 32, 16)
    assert not route_small_ok(256, 65, 16)
    assert not route_small_ok(1024, 17, 16)
    assert not route_small_ok(1, 16385, 16)
    assert not route_small_ok(-1, 4, 16)
    assert not route_small_ok(4, 0, 16)
    assert not route_small_ok(4, 4, 0)
    assert not route_small_ok(4, 4, (1 << 16) + 1)
    with pytest.raises(ValueError, match="route_small_ok"):
        route_small(make_ids(129, 1, 128, False), make_rw(129, 1), 128, 16)


@pytest.mark.skipif(
    TEST_DEVICE.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1",
    reason="a CUDA graph needs a CUDA GPU and the Triton compiler (LMFUSE_GPU_TESTS=1)")
def test_cuda_graph_replay() -> None:
    """Captured once, replayed on new ids and weights: equal to the torch ops on them."""
    T, k, E, block_m = 16, 4, 32, 16
    ids, rw = make_ids(T, k, E, True), make_rw(T, k)
    graph, out = capture_graph(lambda: route_small(ids, rw, E, block_m))
    for _ in range(2):
        ids.copy_(make_ids(T, k, E, True))
        rw.copy_(make_rw(T, k))
        graph.replay()
        for name, g, w in zip(NAMES, out, expected(ids, rw, E, block_m)):
            assert torch.equal(g, w), f"replay: {name}"


def test_torch_ops_route_puts_ids_out_of_range_after_the_experts() -> None:
    """``ops._route`` (the training sizes' routing) agrees with ``route_small`` on pairs
    outside ``[0, E)``: no expert's, after the experts' rows in pair order."""
    E = 8
    ids = torch.tensor([[0, 8], [1, 2], [3, -1], [4, 5], [-7, 1000]], device=TEST_DEVICE)
    perm, token, offsets, inv = ops._route(ids, E)
    assert perm.tolist() == [0, 2, 3, 4, 6, 7, 1, 5, 8, 9]
    assert offsets.tolist() == [0, 1, 2, 3, 4, 5, 6, 6, 6]
    assert token.tolist() == [p // 2 for p in perm.tolist()]
    assert torch.equal(inv[perm].cpu(), torch.arange(10))
    small = route_small(ids[:4], make_rw(4, 2), E, 16)
    want = ops._route(ids[:4], E)
    for g, w in zip(small[:4], want):
        assert torch.equal(g, w)


# --- route_large: the three-launch counting sort of the training sizes ------------------------

LARGE_NAMES = ("perm", "token", "offsets", "inv", "weights")


def assert_large_same(ids: torch.Tensor, rw: torch.Tensor, E: int, what: str) -> None:
    got = routing.route_large(ids, rw, E)
    perm, token, offsets, inv = ops._route(ids, E)
    want = (perm, token, offsets, inv, rw.reshape(-1).index_select(0, perm).to(torch.float32))
    for name, g, w in zip(LARGE_NAMES, got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (
            f"{what}: {name} is {g.dtype} {tuple(g.shape)}, expected {w.dtype} {tuple(w.shape)}")
        assert torch.equal(g, w), f"{what}: {name}\n got {g.tolist()}\nwant {w.tolist()}"


@pytest.mark.parametrize("T, k, E", [(40, 8, 128), (37, 2, 8), (100, 1, 1), (30, 4, 127),
                                     (3, 2, 4), (64, 2, 16)])
def test_large_matches_torch_ops(T: int, k: int, E: int, monkeypatch) -> None:
    """Bit for bit the torch ops', over several blocks (blocks of 64 pairs here, so that the
    interpreter's sort stays quick): ties, empty experts, a last block part full, one
    expert, ``E + 1`` a power of two (the out-of-range key fills the last padded bin)."""
    monkeypatch.setattr(routing, "LARGE_BLOCK", 64)
    for distinct in (False, True):
        if distinct and k > E:
            continue
        assert_large_same(make_ids(T, k, E, distinct), make_rw(T, k), E,
                          f"T {T} k {k} E {E} distinct {distinct}")


def test_large_at_its_own_block_size() -> None:
    """The real block (1024 pairs): two blocks, the second part full."""
    assert routing.LARGE_BLOCK == 1024
    assert_large_same(make_ids(160, 8, 128, True), make_rw(160, 8), 128, "Qwen3-MoE-like")


@pytest.mark.parametrize("id_dtype", ID_DTYPES + (torch.int8, torch.uint8))
def test_large_dtypes_strides_and_ids_out_of_range(id_dtype, monkeypatch) -> None:
    """Any integer ids and float weights, non-contiguous; ids outside ``[0, E)`` (negative,
    ``E``, far beyond) go after the experts' rows in pair order, as the torch ops put them."""
    monkeypatch.setattr(routing, "LARGE_BLOCK", 64)
    T, k, E = 50, 3, 9
    ids = make_ids(2 * T, k, E, False, id_dtype)[::2]
    ids[::7, 0] = E
    if id_dtype.is_signed:
        ids[::5, 1] = -1
        ids[3, 2] = 100
    rw = make_rw(k, 2 * T, torch.bfloat16).t()[::2]
    assert not ids.is_contiguous() and not rw.is_contiguous()
    assert_large_same(ids, rw, E, f"{id_dtype}")


def test_large_no_pairs_three_launches_and_limits(monkeypatch) -> None:
    perm, token, offsets, inv, weights = routing.route_large(
        make_ids(0, 2, 4, False), make_rw(0, 2), 4)
    assert perm.numel() == token.numel() == inv.numel() == weights.numel() == 0
    assert offsets.tolist() == [0] * 5
    kernels = routing._kernels()
    launched = []

    class Counting:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            launched.append((self.name, grid))
            return getattr(kernels, self.name)[grid]

    names = ("moe_count_kernel", "moe_base_kernel", "moe_place_kernel")
    monkeypatch.setattr(routing, "_kernels",
                        lambda: SimpleNamespace(**{n: Counting(n) for n in names}))
    monkeypatch.setattr(routing, "LARGE_BLOCK", 64)
    assert_large_same(make_ids(100, 2, 8, True), make_rw(100, 2), 8, "counted")
    assert launched == [("moe_count_kernel", (4,)), ("moe_base_kernel", (1,)),
                        ("moe_place_kernel", (4,))]
    for E in (0, 2**15):
        with pytest.raises(ValueError, match="E must be"):
            routing.route_large(make_ids(4, 1, 1, False), make_rw(4, 1), E)


@pytest.mark.skipif(
    TEST_DEVICE.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1",
    reason="a CUDA graph needs a CUDA GPU and the Triton compiler (LMFUSE_GPU_TESTS=1)")
def test_large_cuda_graph_replay() -> None:
    """No host synchronisation: captured once, replayed on new ids and weights."""
    T, k, E = 1024, 8, 128
    ids, rw = make_ids(T, k, E, True), make_rw(T, k)
    graph, out = capture_graph(lambda: routing.route_large(ids, rw, E))
    for _ in range(2):
        ids.copy_(make_ids(T, k, E, True))
        rw.copy_(make_rw(T, k))
        graph.replay()
        perm, token, offsets, inv = ops._route(ids, E)
        want = (perm, token, offsets, inv, rw.reshape(-1)[perm].float())
        for name, g, w in zip(LARGE_NAMES, out, want):
            assert torch.equal(g, w), f"replay: {name}"
