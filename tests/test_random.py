"""``rlx.random``: the Threefry-2x32 hash against Random123's known answers and an independent
Python implementation, keys and draws as JAX's original scheme, the draws' distributions, and
their composition with ``rlx.jit`` and ``rlx.vmap``."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

import rlx
import rlx.random as rr
from rlx import Graph

M = 0xFFFFFFFF


def _python_threefry(k0: int, k1: int, x0: int, x1: int) -> tuple[int, int]:
    """Threefry-2x32, 20 rounds, written from the Random123 paper with Python ints."""
    rotations = ((13, 15, 26, 6), (17, 29, 16, 24))
    keys = (k0, k1, k0 ^ k1 ^ 0x1BD11BDA)
    x0, x1 = (x0 + k0) & M, (x1 + k1) & M
    for block in range(5):
        for r in rotations[block % 2]:
            x0 = (x0 + x1) & M
            x1 = (((x1 << r) | (x1 >> (32 - r))) & M) ^ x0
        x0 = (x0 + keys[(block + 1) % 3]) & M
        x1 = (x1 + keys[(block + 2) % 3] + block + 1) & M
    return x0, x1


def _python_bits(key: np.ndarray, count: int) -> list[int]:
    counters = list(range(count)) + [0] * (count % 2)
    half = len(counters) // 2
    k0, k1 = int(key[0]), int(key[1])
    pairs = [_python_threefry(k0, k1, a, b) for a, b in zip(counters[:half], counters[half:], strict=True)]
    return ([a for a, _ in pairs] + [b for _, b in pairs])[:count]


KNOWN_ANSWERS = [  # Random123's known-answer tests for threefry2x32_20
    ((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
    ((M, M), (M, M), (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
]


def test_threefry_known_answers_compiled_and_in_the_reference() -> None:
    g = Graph()
    k = g.input("k", (2,), dtype="int64")
    x = g.input("x", (2,), dtype="int64")
    a, b = rr.threefry_2x32(k[0], k[1], x[0], x[1])
    g.output(a=a, b=b)
    exe = rlx.compile(g)
    for key, words, want in KNOWN_ANSWERS:
        arrays = {"k": np.array(key, np.int64), "x": np.array(words, np.int64)}
        for got in (exe(**arrays), rlx.reference.run(g, **arrays)):
            assert (int(got["a"]), int(got["b"])) == want
        assert _python_threefry(*key, *words) == want


def test_keys_split_and_draw_as_jax_does() -> None:
    key = rr.key(0)
    assert key.tolist() == [0, 0] and rr.key(2**40 + 5).tolist() == [256, 5]
    # jax.random.split(jax.random.PRNGKey(0)) in JAX's original (non-partitionable) scheme.
    assert rr.split(key).tolist() == [[4146024105, 967050713], [2718843009, 1272950319]]
    for count in (1, 2, 7, 10):
        assert rr.bits(rr.key(42), (count,)).tolist() == _python_bits(rr.key(42), count)
    words = _python_bits(rr.key(7), 5)
    np.testing.assert_array_equal(
        rr.uniform(rr.key(7), (5,)), np.array([(w >> 9) * 2.0**-23 for w in words], np.float32)
    )
    assert rr.split(key, 3).shape == (3, 2)
    assert rr.fold_in(key, 3).tolist() == list(_python_threefry(0, 0, 0, 3))


def test_draws_have_their_distributions() -> None:
    key = rr.key(123)
    u = rr.uniform(key, (200_000,))
    assert u.dtype == np.float32 and u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    scaled = rr.uniform(key, (1000,), -3.0, 5.0)
    assert scaled.min() >= -3.0 and scaled.max() < 5.0
    z = rr.normal(rr.fold_in(key, 1), (200_000,))
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1.0) < 0.01
    for edge, tail in ((1.0, 0.1587), (2.0, 0.02275)):  # P(Z > edge)
        assert abs((z > edge).mean() - tail) < 0.004
    b = rr.bernoulli(rr.fold_in(key, 2), 0.3, (100_000,))
    assert b.dtype == np.bool_ and abs(b.mean() - 0.3) < 0.01
    assert not np.array_equal(rr.uniform(rr.key(1), (8,)), rr.uniform(rr.key(2), (8,)))
    np.testing.assert_array_equal(rr.normal(key, (3, 4)), rr.normal(key, (3, 4)))


def test_erfinv_inverts_erf() -> None:
    g = Graph()
    u = g.input("u", (9,))
    g.output(x=rr.erfinv(u))
    values = np.array([-0.999, -0.9, -0.5, -0.01, 0.0, 0.2, 0.7, 0.99, 0.9999], np.float32)
    got = rlx.compile(g)(u=values)["x"]
    np.testing.assert_allclose([math.erf(float(x)) for x in got], values, rtol=2e-6, atol=2e-7)
    edges = rlx.compile(g)(u=np.array([-1, 1, 1.5, -2, 0, 0, 0, 0, 0], np.float32))["x"]
    assert edges[0] == -np.inf and edges[1] == np.inf and np.isnan(edges[2:4]).all()


def test_under_jit_and_vmap() -> None:
    keys = rr.split(rr.key(5), 4)
    mapped = rlx.vmap(lambda k: rr.uniform(k, (3,)))(keys)
    np.testing.assert_array_equal(mapped, np.stack([rr.uniform(k, (3,)) for k in keys]))

    @rlx.jit
    def dropout(x: Any, key: Any, rate: float) -> Any:
        keep = rr.bernoulli(key, 1.0 - rate, x.shape)
        return rlx.where(keep, x / (1.0 - rate), 0.0)

    x = np.ones((64, 64), np.float32)
    first, again = dropout(x, rr.key(0), 0.25), dropout(x, rr.key(0), 0.25)
    np.testing.assert_array_equal(first, again)
    assert abs((first == 0).mean() - 0.25) < 0.03 and set(np.unique(first)) == {0.0, np.float32(1 / 0.75)}
    assert not np.array_equal(first, dropout(x, rr.key(1), 0.25))
    assert dropout.compile_count == 1


def test_errors() -> None:
    with pytest.raises(rlx.RlxValueError, match="two 32-bit words"):
        rr.uniform(np.array([1, 2, 3]), (2,))
    with pytest.raises(rlx.RlxValueError, match="two 32-bit words"):
        rr.uniform(np.array([-1, 2]), (2,))
    with pytest.raises(rlx.RlxValueError, match="p must be"):
        rr.bernoulli(rr.key(0), 1.5, (2,))
    with pytest.raises(rlx.RlxValueError, match="shape"):
        rr.normal(rr.key(0), (2, -1))
    with pytest.raises(rlx.RlxTypeError, match="seed"):
        rr.key(1.5)  # type: ignore[arg-type]
    g = Graph()
    with pytest.raises(rlx.RlxTypeError, match="int64"):
        rr.uniform(g.input("k", (2,)), (3,))
    assert rlx.random is rr


def test_randint_and_categorical() -> None:
    draws = rr.randint(rr.key(3), (6000,), -5, 7)
    assert draws.dtype == np.int32 and draws.min() == -5 and draws.max() == 6
    counts = np.bincount(draws + 5, minlength=12) / draws.size
    assert np.abs(counts - 1 / 12).max() < 0.02
    # The same words as an independent computation of JAX's rule from the split key's bits.
    halves = rr.split(rr.key(3), 2)
    hi, lo = (np.array(_python_bits(k, 6000), np.uint64) for k in halves)
    span = 12
    want = (((hi % span) * (2**32 % span) % 2**32 + lo % span) % 2**32 % span).astype(np.int64) - 5
    np.testing.assert_array_equal(draws, want)
    logits = np.log(np.array([[0.1, 0.6, 0.3], [0.5, 0.25, 0.25]], np.float32))
    picks = rlx.vmap(lambda k: rr.categorical(k, logits))(rr.split(rr.key(9), 8_000))
    assert picks.shape == (8_000, 2) and picks.dtype == np.int64
    for row, probabilities in enumerate(np.exp(logits)):
        frequencies = np.bincount(picks[:, row], minlength=3) / len(picks)
        np.testing.assert_allclose(frequencies, probabilities, atol=0.02)
    np.testing.assert_array_equal(rr.categorical(rr.key(1), logits, axis=0), rr.categorical(rr.key(1), logits, axis=0))
    with pytest.raises(rlx.RlxValueError, match="minval < maxval"):
        rr.randint(rr.key(0), (2,), 3, 3)
