"""Counter-based random numbers, as ``jax.random``: ``key``, ``split``, ``fold_in``, ``bits``,
``uniform``, ``normal``, ``bernoulli``, ``randint`` and ``categorical``.

A key is two 32-bit words (held as an int64 array of shape ``(2,)``, entries in ``[0, 2**32)``).
Every draw is a pure function of its key: the Threefry-2x32 hash (20 rounds, JAX's and
Random123's; checked against Random123's known answers) of a counter per drawn word, built from
the graph's int64 ops, so it fuses into one loop nest, differentiates as data (a draw has no
gradient with respect to its key), batches under ``rlx.vmap`` and runs under ``rlx.jit``. Keys
split and draw as JAX's original scheme does (``jax_threefry_partitionable=False``), and
``uniform`` keeps a word's top 23 bits as JAX does; ``normal`` is ``sqrt(2) * erfinv(u)`` of a
uniform ``u`` in (-1, 1), with the single-precision ``erfinv`` XLA uses (Giles).

Called on values (inside ``rlx.jit``, or on a graph's values) the functions build into that
graph; called on NumPy keys, they run jitted, once per shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.graph import Graph, Value
from rlx.tracing import Jitted

_MASK = 0xFFFFFFFF
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def key(seed: int) -> np.ndarray:
    """A key from an integer seed, as ``jax.random.PRNGKey``: ``[seed >> 32, seed & 0xFFFFFFFF]``."""
    return _seed_words(seed)


def _seed_words(seed: int) -> np.ndarray:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise RlxTypeError(f"rlx.random.key: the seed must be an int, got {type(seed).__name__}")
    seed = int(seed)
    if not -(2**63) <= seed < 2**64:
        raise RlxValueError(f"rlx.random.key: the seed {seed} does not fit 64 bits")
    seed &= 2**64 - 1
    return np.array([seed >> 32, seed & _MASK], dtype=np.int64)


# ----------------------------------------------------------------------------- the hash


def _rotate_left(x: Value, r: int) -> Value:
    return ((x << r) | (x >> (32 - r))) & _MASK


def threefry_2x32(k0: Value, k1: Value, x0: Value, x1: Value) -> tuple[Value, Value]:
    """Threefry-2x32 with 20 rounds of the words ``x0, x1`` under the key ``k0, k1`` (int64 values
    holding 32-bit words; they broadcast). Sums wrap to 32 bits after every addition."""
    keys = (k0, k1, k0 ^ k1 ^ 0x1BD11BDA)
    x0, x1 = (x0 + k0) & _MASK, (x1 + k1) & _MASK
    for block in range(5):
        for r in _ROTATIONS[block % 2]:
            x0 = (x0 + x1) & _MASK
            x1 = _rotate_left(x1, r) ^ x0
        x0 = (x0 + keys[(block + 1) % 3]) & _MASK
        x1 = (x1 + keys[(block + 2) % 3] + (block + 1)) & _MASK
    return x0, x1


def _hash_counts(graph: Graph, key: Value, count: int) -> Value:
    """JAX's ``threefry_2x32(key, iota(count))``: the counters' first half and second half are
    the two words hashed together (a zero appended to an odd count), the results joined."""
    k0, k1 = key[0], key[1]
    padded = count + count % 2
    counters = np.arange(padded, dtype=np.int64)
    counters[count:] = 0
    half = padded // 2
    x0, x1 = threefry_2x32(k0, k1, graph.constant(counters[:half]), graph.constant(counters[half:]))
    joined = graph.concat([x0, x1], axis=0)
    return joined[:count] if padded != count else joined


# ----------------------------------------------------------------------------- keys and draws


def _on_values(public: Callable[..., Any], key: object, build: Any, *static: Any) -> Any:
    """``build(graph, key_value)`` in the key's graph; on a NumPy key, ``public(key, *static)``
    jitted (traced once per shapes and static arguments, its key a value)."""
    name = public.__name__
    if isinstance(key, Value):
        if key.dtype != np.int64 or key.shape[-1:] != (2,):
            raise RlxTypeError(f"rlx.random.{name}: a key is an int64 array of shape (..., 2), got {key.type}")
        if key.ndim != 1:
            raise RlxValueError(
                f"rlx.random.{name}: one key at a time (shape (2,)), got {key.type}; map over keys with rlx.vmap"
            )
        return build(key.graph, key)
    array = np.asarray(key)
    if array.shape != (2,) or array.dtype.kind not in "iu" or array.min() < 0 or array.max() > _MASK:
        raise RlxValueError(
            f"rlx.random.{name}: a key is two 32-bit words (rlx.random.key(seed)), got {array.dtype}{list(array.shape)}"
        )
    jitted = _JITTED.get(name)
    if jitted is None:
        jitted = _JITTED[name] = Jitted(public)
    return jitted(array.astype(np.int64), *static)


_JITTED: dict[str, Jitted] = {}


def _shape(name: str, shape: object) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (int(shape),)
    if not isinstance(shape, Sequence) or not all(isinstance(d, (int, np.integer)) and d >= 0 for d in shape):
        raise RlxValueError(f"rlx.random.{name}: shape must be a tuple of static sizes >= 0, got {shape!r}")
    return tuple(int(d) for d in shape)


def split(key: Any, num: int = 2) -> Any:
    """``num`` new keys from ``key`` (shape ``(num, 2)``), as ``jax.random.split``."""
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise RlxValueError(f"rlx.random.split: num must be an int >= 1, got {num!r}")
    return _on_values(split, key, lambda g, k: g.reshape(_hash_counts(g, k, 2 * num), (num, 2)), num)


def fold_in(key: Any, data: int) -> Any:
    """A new key from ``key`` and an int (a step, a layer's index), as ``jax.random.fold_in``."""
    if isinstance(data, bool) or not isinstance(data, (int, np.integer)):
        raise RlxTypeError(f"rlx.random.fold_in: data must be an int, got {type(data).__name__}")
    words = _seed_words(int(data))

    def build(g: Graph, k: Value) -> Value:
        x0, x1 = threefry_2x32(k[0], k[1], g.constant(words[:1]), g.constant(words[1:]))
        return g.concat([x0, x1], axis=0)

    return _on_values(fold_in, key, build, int(data))


def bits(key: Any, shape: Sequence[int] | int = ()) -> Any:
    """Random 32-bit words of ``shape`` (int64 values in ``[0, 2**32)``), as ``jax.random.bits``."""
    dims = _shape("bits", shape)
    count = math.prod(dims)

    def build(g: Graph, k: Value) -> Value:
        if count == 0:
            raise RlxValueError("rlx.random.bits: a shape with no entries")
        return g.reshape(_hash_counts(g, k, count), dims)

    return _on_values(bits, key, build, dims)


def uniform(key: Any, shape: Sequence[int] | int = (), minval: float = 0.0, maxval: float = 1.0) -> Any:
    """float32 draws from ``[minval, maxval)``, as ``jax.random.uniform``: a word's top 23 bits as
    the mantissa of a number in [0, 1), scaled and shifted."""
    dims = _shape("uniform", shape)
    low, high = float(minval), float(maxval)

    def build(g: Graph, k: Value) -> Value:
        unit = g.cast(bits(k, dims) >> 9, "float32") * float(2.0**-23)
        return g.maximum(unit * (high - low) + low, low)

    return _on_values(uniform, key, build, dims, low, high)


def normal(key: Any, shape: Sequence[int] | int = ()) -> Any:
    """float32 standard normal draws, as ``jax.random.normal``: ``sqrt(2) * erfinv(u)`` of a
    uniform ``u`` in (-1, 1)."""
    dims = _shape("normal", shape)
    low = float(np.nextafter(np.float32(-1.0), np.float32(0.0)))

    def build(g: Graph, k: Value) -> Value:
        return math.sqrt(2.0) * erfinv(uniform(k, dims, low, 1.0))

    return _on_values(normal, key, build, dims)


def bernoulli(key: Any, p: float = 0.5, shape: Sequence[int] | int = ()) -> Any:
    """bool draws, True with probability ``p``, as ``jax.random.bernoulli``: ``uniform < p``."""
    dims = _shape("bernoulli", shape)
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        raise RlxValueError(f"rlx.random.bernoulli: p must be a number in [0, 1], got {p!r}")
    chance = float(p)
    return _on_values(bernoulli, key, lambda g, k: uniform(k, dims) < chance, chance, dims)


def randint(key: Any, shape: Sequence[int] | int, minval: int, maxval: int) -> Any:
    """int32 draws from ``[minval, maxval)``, as ``jax.random.randint`` draws them: two words per
    entry (from the key split in two), ``(hi % span) * (2**32 % span) + lo % span`` modulo the
    span, so that no residue is favoured by more than 2**-32."""
    dims = _shape("randint", shape)
    for label, bound in (("minval", minval), ("maxval", maxval)):
        if isinstance(bound, bool) or not isinstance(bound, (int, np.integer)):
            raise RlxTypeError(f"rlx.random.randint: {label} must be an int, got {type(bound).__name__}")
    low, high = int(minval), int(maxval)
    if not -(2**31) <= low < high <= 2**31:
        raise RlxValueError(f"rlx.random.randint: need -2**31 <= minval < maxval <= 2**31, got [{low}, {high})")
    span = high - low
    multiplier = pow(2**16 % span, 2, span)  # 2**32 modulo the span, in the span's range

    def build(g: Graph, k: Value) -> Value:
        keys = split(k, 2)
        higher, lower = bits(keys[0], dims), bits(keys[1], dims)
        # 32-bit words wrap as JAX's uint32 arithmetic does: the low 32 bits of each result.
        offset = ((((higher % span) * multiplier) & _MASK) + lower % span) & _MASK
        offset = offset % span
        return g.cast(offset + low, "int32")

    return _on_values(randint, key, build, dims, low, high)


def categorical(key: Any, logits: Any, axis: int = -1) -> Any:
    """Indices drawn with probabilities ``softmax(logits)`` along ``axis`` (int64), as
    ``jax.random.categorical``: the largest of ``logits`` plus Gumbel noise."""
    if isinstance(logits, Value) and not isinstance(key, Value):  # a NumPy key beside a graph's logits
        key = logits.graph.constant(np.asarray(key, np.int64))

    def build(g: Graph, k: Value) -> Value:
        scores = logits if isinstance(logits, Value) else g.constant(np.asarray(logits, np.float32))
        if scores.graph is not g:
            raise RlxValueError("rlx.random.categorical: the key and the logits are values of different graphs")
        tiny = float(np.finfo(np.float32).tiny)
        noise = -g.log(-g.log(uniform(k, scores.static_shape, tiny, 1.0)))
        return g.argmax(scores + noise, axis=axis)

    return _on_values(categorical, key, build, logits, axis)


def erfinv(x: Value) -> Value:
    """The inverse error function in float32 (Giles's approximation, as XLA computes it): NaN
    outside [-1, 1], infinite at the ends."""
    g = x.graph
    w = -g.log((1.0 - x) * (1.0 + x))
    near = w - 2.5
    p = g.constant(np.float32(2.81022636e-08))
    for c in (3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087, -0.00125372503, -0.00417768164,
              0.246640727, 1.50140941):  # fmt: skip
        p = c + p * near
    far = g.sqrt(w) - 3.0
    q = g.constant(np.float32(-0.000200214257))
    for c in (0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773, -0.0076224613, 0.00943887047,
              1.00167406, 2.83297682):  # fmt: skip
        q = c + q * far
    out = g.where(w < 5.0, p, q) * x
    return g.where(g.equal(g.abs(x), 1.0), x * float("inf"), out)
