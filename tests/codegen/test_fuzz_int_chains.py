"""Random chains of integer elementwise ops (int32 and int64, overflow, bitwise ops and shifts) compiled
against the reference, which computes as NumPy does: the loop nests compute ints in 64-bit
lanes, and must wrap int32 results and divide as NumPy does wherever the chain is fused."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rlx
from rlx import Graph, Value

BINARY = ["add", "sub", "mul", "maximum", "minimum", "floor_divide", "remainder", "fmod"]
BINARY += ["bitwise_and", "bitwise_or", "bitwise_xor", "left_shift", "right_shift"]
UNARY = ["neg", "abs", "bitwise_not"]


@st.composite
def chains(draw: st.DrawFn) -> tuple[Graph, dict[str, np.ndarray]]:
    dtype = draw(st.sampled_from(["int32", "int64"]))
    g = Graph("ints")
    shape = (draw(st.integers(1, 9)),)
    values: list[Value] = [g.input("a", shape, dtype=dtype), g.input("b", shape, dtype=dtype)]
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["binary", "unary", "constant", "compare", "cast"]))
        v = draw(st.sampled_from(values))
        if kind == "binary":
            values.append(getattr(g, draw(st.sampled_from(BINARY)))(v, draw(st.sampled_from(values))))
        elif kind == "unary":
            values.append(getattr(g, draw(st.sampled_from(UNARY)))(v))
        elif kind == "constant":
            number = draw(st.sampled_from([3, -7, 65536, 40000, 2**31 - 1, -(2**31)]))
            op = draw(st.sampled_from(["add", "mul", "floor_divide", "remainder"]))
            values.append(getattr(g, op)(v, g.constant(np.array(number, dtype=dtype))))
        elif kind == "compare":
            w = draw(st.sampled_from(values))
            values.append(g.where(g.less(v, w), v, w * 3))
        else:  # through the other width and back
            other = "int64" if dtype == "int32" else "int32"
            values.append(g.cast(g.cast(v, other), dtype))
    g.output(*draw(st.lists(st.sampled_from(values[2:] or values), min_size=1, max_size=3, unique=True)))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    info = np.iinfo(dtype)
    big = draw(st.booleans())
    low, high = (int(info.min), int(info.max)) if big else (-50, 50)
    arrays = {name: rng.integers(low, high, shape, dtype=dtype, endpoint=True) for name in ("a", "b")}
    return g, arrays


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains())
def test_integer_chains_compile_to_numpys_arithmetic(case: tuple[Graph, dict[str, np.ndarray]]) -> None:
    g, arrays = case
    want = rlx.reference.run(g, **arrays)
    for passes in (None, []):
        got = rlx.compile(g, passes=passes)(**arrays)
        for name, expected in want.items():
            assert got[name].dtype == expected.dtype
            np.testing.assert_array_equal(got[name], expected, err_msg=f"{name} (passes={passes})\n{g}")
