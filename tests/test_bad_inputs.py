"""A corpus of bad inputs to general ops: each gives a clear rlx error naming what was wrong; none crashes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import rlx
from rlx import Graph, RlxTypeError, RlxValueError


def _g() -> tuple[Graph, dict[str, rlx.Value]]:
    g = Graph("bad")
    values = {
        "x": g.input("x", (2, 3, 4)),
        "y": g.input("y", (5,)),
        "w": g.input("w", (4, 6)),
        "ids": g.input("ids", (2, 3), "int64"),
        "flags": g.input("flags", (2, 3), "bool"),
    }
    return g, values


BUILD_ERRORS: list[tuple[str, Callable[[Graph, dict[str, rlx.Value]], object], type[Exception], str]] = [
    ("shapes do not broadcast", lambda g, v: v["x"] + v["y"], RlxValueError, r"add .*do not broadcast"),
    ("int operand to float op", lambda g, v: g.exp(v["ids"]), RlxTypeError, r"exp .*x must be f32, got i64"),
    ("bool operand to arithmetic", lambda g, v: v["flags"] * 2.0, RlxTypeError, r"mul .*a must be f32, got bool"),
    ("axis out of range", lambda g, v: g.sum(v["x"], axis=3), RlxValueError, r"sum: axis 3 is out of range for rank 3"),
    ("repeated axis", lambda g, v: g.mean(v["x"], axis=(1, -2)), RlxValueError, r"mean: axis .* repeats an axis"),
    ("axis of wrong type", lambda g, v: g.max(v["x"], axis="1"), RlxTypeError, r"max: axis must be"),
    ("softmax axis", lambda g, v: g.softmax(v["x"], axis=-4), RlxValueError, r"softmax: axis -4 is out of range"),
    ("matmul inner dims", lambda g, v: v["x"] @ v["x"], RlxValueError, r"matmul .*inner dimensions differ"),
    ("matmul vector inner dims", lambda g, v: v["y"] @ v["w"], RlxValueError, r"matmul: inner dimensions differ"),
    ("matmul scalar", lambda g, v: v["w"] @ 2.0, RlxValueError, r"matmul: operands need rank >= 1"),
    ("reshape count", lambda g, v: g.reshape(v["x"], (5, 5)), RlxValueError, r"cannot reshape .*24 elements.*25"),
    ("reshape two -1", lambda g, v: g.reshape(v["x"], (-1, -1)), RlxValueError, r"at most one -1"),
    ("transpose not a permutation", lambda g, v: g.transpose(v["x"], (0, 0, 1)), RlxValueError, r"not a permutation"),
    ("split unequal", lambda g, v: g.split(v["x"], 3, axis=-1), RlxValueError, r"split: axis -1 .* 3 parts"),
    ("concat mismatch", lambda g, v: g.concat([v["x"], v["w"]], axis=0), RlxValueError, r"concat .*does not match"),
    ("broadcast_to bad", lambda g, v: g.broadcast_to(v["x"], (3, 4)), RlxValueError, r"cannot broadcast"),
    (
        "norm weight shape",
        lambda g, v: g.rms_norm(v["x"], v["y"]),
        RlxValueError,
        r"rms_norm .*weight must be f32\[4\]",
    ),
    (
        "embedding float ids",
        lambda g, v: g.embedding(v["w"], v["x"]),
        RlxTypeError,
        r"embedding .*ids must be int32 or int64",
    ),
    (
        "cross_entropy shape",
        lambda g, v: g.cross_entropy(v["x"], v["ids"][0] if False else v["y"]),
        RlxTypeError,
        r"targets must be int",
    ),
    ("where cond not bool", lambda g, v: g.where(v["x"], v["x"], v["x"]), RlxTypeError, r"where .*cond must be bool"),
    (
        "gelu approximate",
        lambda g, v: g.gelu(v["x"], approximate="fast"),
        RlxValueError,
        r"approximate must be 'none' or 'tanh'",
    ),
    ("list operand", lambda g, v: v["x"] + [1.0, 2.0], RlxTypeError, r"a Python number or a NumPy array, got list"),
    ("grad of int x", lambda g, v: rlx.grad(g, g.sum(v["x"]), [v["ids"]]), RlxTypeError, r"xs\[0\] .*only float32"),
    ("grad without dy", lambda g, v: rlx.grad(g, v["x"] * 2.0, [v["x"]]), RlxValueError, r"dy is needed"),
]


@pytest.mark.parametrize(("label", "build", "error", "match"), BUILD_ERRORS, ids=[c[0] for c in BUILD_ERRORS])
def test_build_errors_are_clear(label: str, build: Callable, error: type[Exception], match: str) -> None:
    g, values = _g()
    before = str(g)
    with pytest.raises(error, match=match):
        build(g, values)
    assert str(g) == before or label.startswith("grad"), "a refused build must not leave nodes behind"


def _embedding_exe() -> rlx.codegen.Executable:
    g = Graph("emb")
    g.output(y=g.embedding(g.input("table", (4, 8)), g.input("ids", (3,), "int32")))
    return rlx.compile(g)


@pytest.mark.parametrize("ids", [[0, 4, 1], [-1, 0, 0], [0, 0, 2**31 - 1]])
def test_out_of_range_ids_are_refused_at_call_time(ids: list[int]) -> None:
    exe = _embedding_exe()
    with pytest.raises(RlxValueError, match=r"input 'ids': .* out of range \[0, 4\)"):
        exe(table=np.zeros((4, 8), np.float32), ids=np.array(ids, np.int32))


def _targets_graph(rows: int | str, with_grad: bool) -> Graph:
    g = Graph("ce")
    logits = g.input("logits", (rows, 6))
    targets = g.input("targets", (rows,), "int64")
    loss = g.cross_entropy(logits, targets)
    g.output(loss=loss)
    if with_grad:
        g.output(dlogits=rlx.grad(g, loss, [logits])[0])
    return g


@pytest.mark.parametrize("rows", [5, "N"], ids=["static", "symbolic"])
@pytest.mark.parametrize("with_grad", [False, True], ids=["loss", "loss+grad"])
@pytest.mark.parametrize("passes", [None, []], ids=["default", "as-built"])
@pytest.mark.parametrize("bad", [6, -1, 2**40])
def test_out_of_range_targets_are_refused_at_call_time(
    rows: int | str, with_grad: bool, passes: list[str] | None, bad: int
) -> None:
    """cross_entropy becomes a one-hot comparison when compiled, which reads no memory with the
    targets, so nothing would crash; the loss would silently leave the bad row out. SPEC 3 asks
    for the error, compiled as in the reference."""
    g = _targets_graph(rows, with_grad)
    exe = rlx.compile(g, passes=passes)
    logits = np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32)
    targets = np.array([0, 5, 2, 3, 1])
    np.testing.assert_allclose(
        exe(logits=logits, targets=targets)["loss"],
        rlx.reference.run(g, logits=logits, targets=targets)["loss"],
        rtol=1e-5,
    )
    targets[3] = bad
    message = rf"input 'targets': {bad} is out of range \[0, 6\) for the class index of cross_entropy"
    with pytest.raises(RlxValueError, match=message):
        exe(logits=logits, targets=targets)
    with pytest.raises(RlxValueError, match=message):
        rlx.reference.run(g, logits=logits, targets=targets)


def test_out_of_range_one_hot_ids_are_refused_at_call_time() -> None:
    g = Graph("oh")
    ids = g.input("ids", (4,), "int32")
    g.output(y=g.one_hot(ids, 3) * 2.0)
    exe = rlx.compile(g)
    np.testing.assert_array_equal(exe(ids=np.array([0, 2, 1, 0], np.int32))["y"], 2.0 * np.eye(3)[[0, 2, 1, 0]])
    with pytest.raises(RlxValueError, match=r"input 'ids': 3 is out of range \[0, 3\) for the class index of one_hot"):
        exe(ids=np.array([0, 3, 1, 0], np.int32))


def test_wrong_dtype_and_shape_at_call_time() -> None:
    exe = _embedding_exe()
    with pytest.raises(RlxTypeError, match=r"input 'ids': expected dtype int32"):
        exe(table=np.zeros((4, 8), np.float32), ids=np.array([0, 1, 2], np.int64))
    with pytest.raises(RlxValueError, match=r"input 'table': wrong shape"):
        exe(table=np.zeros((8, 4), np.float32), ids=np.array([0, 1, 2], np.int32))


def test_nan_and_inf_propagate() -> None:
    g = Graph("nan")
    x = g.input("x", (2, 20))
    g.output(s=g.softmax(x), n=g.rms_norm(x, g.constant(np.ones(20, np.float32))), m=g.max(x, axis=-1))
    a = np.ones((2, 20), np.float32)
    a[0, 3] = np.nan
    a[1, 5] = np.inf
    got = rlx.compile(g)(x=a)
    want = rlx.reference.run(g, x=a)
    for name in want:
        np.testing.assert_array_equal(np.isnan(got[name]), np.isnan(want[name]), err_msg=name)


def test_huge_shapes_are_refused_before_allocating() -> None:
    g = Graph("huge")
    x = g.input("x", (2**31, 2))
    with pytest.raises(RlxValueError, match="cannot reshape"):
        g.reshape(x, (2**33,))
    g.output(y=x @ g.input("w", (2, 2)))
    with pytest.raises(RlxValueError, match="32-bit BLAS limit"):
        rlx.compile(g)


def test_shapes_beyond_what_64_bit_offsets_address_are_build_errors() -> None:
    """An input of 2**80 elements, or an op whose result would have 2**61, is refused when it is
    declared (naming the input or the op), not compiled into kernels whose index arithmetic wraps."""
    g = Graph("beyond")
    with pytest.raises(RlxValueError, match=r"input 'x': shape .* has 1.21e\+24 elements, more than any array"):
        g.input("x", (2**40, 2**30, 2**10))
    column, row = g.input("column", (2**30, 1)), g.input("row", (1, 2**31))
    before = str(g)
    with pytest.raises(RlxValueError, match=r"add \(node \d+\): the result's shape \(1073741824, 2147483648\)"):
        column + row
    assert str(g) == before
    with pytest.raises(RlxValueError, match="more than any array can hold"):
        rlx.ir.parse('graph @g {\n  %x = input "x" : f32[1099511627776,1099511627776]\n  output y = %x\n}')
    g.input("wide", (2**30, 2**30))  # 2**60 elements: the most a value may have


def test_a_call_that_cannot_get_its_memory_is_a_clear_error() -> None:
    """Symbolic sizes only meet memory at call time: NumPy's MemoryError becomes an RlxMemoryError
    (also a MemoryError) naming the buffer, and the executable keeps working afterwards."""
    g = Graph("outer")
    x, y = g.input("x", ("N", 1)), g.input("y", (1, "N"))
    z = x * y
    g.output(z=z, s=g.sum(g.exp(z) @ z))
    exe = rlx.compile(g)
    big = 2**19  # (N, N) float32 buffers of 1 TiB
    with pytest.raises(rlx.RlxMemoryError, match=r"shape \(524288, 524288\) needs 1 TiB") as caught:
        exe(x=np.ones((big, 1), np.float32), y=np.ones((1, big), np.float32))
    assert isinstance(caught.value, MemoryError)
    column = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), (2**42, 1), (0, 0))
    dense_copy = r"input 'x': a dense copy of this \(4398046511104, 1\) view needs 16 TiB"
    with pytest.raises(rlx.RlxMemoryError, match=dense_copy):
        exe(x=column, y=column.T)
    got = exe(x=np.full((3, 1), 2, np.float32), y=np.ones((1, 3), np.float32))
    np.testing.assert_allclose(got["z"], np.full((3, 3), 2.0))


@pytest.mark.parametrize(("ids", "bad"), [([0, 1, 7], 7), ([-1, 0, 0], -1)])
def test_a_constant_holding_a_bad_id_is_refused_at_compile_time(ids: list[int], bad: int) -> None:
    """A constant's ids are known when the graph compiles: the executable is never made."""
    g = Graph("constant_ids")
    g.output(rows=g.embedding(g.input("table", (4, 3)), g.constant(np.array(ids, dtype=np.int64))))
    with pytest.raises(RlxValueError, match=rf"constant \(node \d+\): {bad} is out of range \[0, 4\)"):
        rlx.compile(g)


@pytest.mark.parametrize("dtype", ["float64", "float16"])
def test_an_input_compiled_code_cannot_hold_is_refused_at_compile_time(dtype: str) -> None:
    """The IR spells f64 and f16 (a printed graph may declare them, and the reference interprets
    them), but no kernel reads them: compiling such an input is a clear error naming it."""
    g = Graph("wide")
    wide = g.input("wide", (3,), dtype=dtype)
    g.output(total=g.sum(g.cast(wide, "float32")))
    assert rlx.reference.run(g, wide=np.ones(3, dtype))["total"] == 3.0
    with pytest.raises(RlxTypeError, match=rf"input 'wide' is {dtype}; compiled graphs hold float32"):
        rlx.compile(g)


def test_float16_and_float64_constants_become_float32() -> None:
    g = Graph("constants")
    for dtype in (np.float16, np.float64):
        assert g.constant(np.ones(2, dtype)).dtype == np.float32
    assert g.constant(np.ones(2, np.float16), dtype="float32").dtype == np.float32
