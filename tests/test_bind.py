"""bind_inputs: every bad input is refused with a named error; every good one becomes safe memory."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import Case, build_graph, make_inputs
from hypothesis import given, settings
from hypothesis import strategies as st

import rlx
from rlx import Graph
from rlx.bind import InputBinder, bind_inputs, symbol_sizes
from rlx.reference import run

SHAPES = {"x": (2, 3, 4), "pad": (2, 5), "ids": (3,)}


def _graph() -> Graph:
    g = Graph("bind")
    g.input("x", SHAPES["x"])
    g.input("pad", SHAPES["pad"])
    g.input("ids", SHAPES["ids"], dtype="int64")
    return g


def _good(rng: np.random.Generator) -> dict[str, object]:
    return {
        "x": rng.standard_normal(SHAPES["x"]).astype(np.float32),
        "pad": rng.random(SHAPES["pad"]).astype(np.float32),
        "ids": np.arange(3, dtype=np.int64),
    }


def _refused(arrays: dict[str, object], error: type, builtin: type) -> str:
    with pytest.raises(error) as info:
        bind_inputs(_graph(), arrays)
    assert isinstance(info.value, rlx.RlxError)
    assert isinstance(info.value, builtin)
    return str(info.value)


def test_good_inputs_pass_through_without_copies(rng: np.random.Generator) -> None:
    arrays = _good(rng)
    bound = bind_inputs(_graph(), arrays)
    assert list(bound) == ["x", "pad", "ids"]  # declaration order, not call order
    for name, array in bound.items():
        assert array is arrays[name]  # already dense, aligned and typed: no work on the call path


def test_missing_input(rng: np.random.Generator) -> None:
    arrays = _good(rng)
    del arrays["pad"]
    message = _refused(arrays, rlx.RlxKeyError, KeyError)
    assert "missing input 'pad'" in message
    assert "'x', 'pad', 'ids'" in message


def test_several_missing_inputs_are_all_named(rng: np.random.Generator) -> None:
    message = _refused({"x": _good(rng)["x"]}, rlx.RlxKeyError, KeyError)
    assert "'pad'" in message
    assert "'ids'" in message


def test_unknown_input(rng: np.random.Generator) -> None:
    arrays = _good(rng)
    arrays["xx"] = arrays["x"]
    message = _refused(arrays, rlx.RlxKeyError, KeyError)
    assert "no input named 'xx'" in message
    assert "'x', 'pad', 'ids'" in message
    assert not message.startswith('"')  # readable, not KeyError's repr quoting


@pytest.mark.parametrize(
    ("name", "dtype"), [("x", np.float64), ("x", np.float16), ("x", np.int32), ("ids", np.int32), ("pad", np.bool_)]
)
def test_wrong_dtype_is_never_converted(name: str, dtype: type, rng: np.random.Generator) -> None:
    arrays = _good(rng)
    arrays[name] = np.asarray(arrays[name]).astype(dtype)
    message = _refused(arrays, rlx.RlxTypeError, TypeError)
    assert f"input {name!r}" in message
    assert f"got {np.dtype(dtype)}" in message
    assert f"expected dtype {np.dtype(np.int64 if name == 'ids' else np.float32)}" in message


def test_python_lists_are_float64_so_refused(rng: np.random.Generator) -> None:
    arrays = _good(rng)
    arrays["pad"] = np.asarray(arrays["pad"]).tolist()
    message = _refused(arrays, rlx.RlxTypeError, TypeError)
    assert "Python list" in message and "float64" in message


def test_other_byte_order_of_the_same_dtype_is_swapped_losslessly(rng: np.random.Generator) -> None:
    arrays = _good(rng)
    swapped = np.asarray(arrays["x"]).astype(">f4")
    arrays["x"] = swapped
    bound = bind_inputs(_graph(), arrays)
    assert bound["x"].dtype == np.dtype(np.float32)
    assert bound["x"].dtype.isnative
    np.testing.assert_array_equal(bound["x"], swapped)
    arrays["x"] = swapped.astype(">f8")
    _refused(arrays, rlx.RlxTypeError, TypeError)


@pytest.mark.parametrize(
    ("shape", "word"), [((2, 3), "rank"), ((2, 3, 4, 1), "rank"), ((2, 3, 5), "shape"), ((3, 2, 4), "shape")]
)
def test_wrong_shape(shape: tuple[int, ...], word: str, rng: np.random.Generator) -> None:
    arrays = _good(rng)
    arrays["x"] = np.zeros(shape, np.float32)
    message = _refused(arrays, rlx.RlxValueError, ValueError)
    assert f"input 'x': wrong {word}" in message
    assert "expected shape (2, 3, 4)" in message
    assert f"got {shape}" in message


def test_scalar_is_a_wrong_rank(rng: np.random.Generator) -> None:
    arrays = _good(rng)
    arrays["x"] = np.float32(1.0)
    assert "got ()" in _refused(arrays, rlx.RlxValueError, ValueError)


@pytest.mark.parametrize(
    "obj",
    [object(), None, [[1.0, 2.0], [3.0]], {"a": 1}, "text"],
    ids=["object", "none", "ragged-list", "dict", "str"],
)
def test_objects_that_are_not_arrays(obj: object, rng: np.random.Generator) -> None:
    arrays = _good(rng)
    arrays["x"] = obj
    assert "input 'x'" in _refused(arrays, rlx.RlxTypeError, TypeError)


def test_object_whose_array_conversion_raises(rng: np.random.Generator) -> None:
    class Broken:
        def __array__(self, dtype=None, copy=None):
            raise RuntimeError("no")

    arrays = _good(rng)
    arrays["x"] = Broken()
    assert "Broken" in _refused(arrays, rlx.RlxTypeError, TypeError)


def test_inputs_must_be_a_mapping(rng: np.random.Generator) -> None:
    with pytest.raises(rlx.RlxTypeError, match="mapping"):
        bind_inputs(_graph(), list(_good(rng).values()))  # type: ignore[arg-type]


def test_array_like_objects_convert(rng: np.random.Generator) -> None:
    class Wrapper:
        def __init__(self, data: np.ndarray) -> None:
            self.data = data

        def __array__(self, dtype=None, copy=None) -> np.ndarray:
            return self.data

    arrays = _good(rng)
    wrapped = Wrapper(np.asarray(arrays["x"]))
    arrays["x"] = wrapped
    np.testing.assert_array_equal(bind_inputs(_graph(), arrays)["x"], wrapped.data)


class DLPackOnly:
    """Exposes memory through DLPack only (no ``__array__``), like a tensor of another library."""

    def __init__(self, data: np.ndarray) -> None:
        self._data = data

    def __dlpack__(self, **kwargs: object) -> object:
        return self._data.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._data.__dlpack_device__()


@pytest.mark.skipif(not hasattr(np, "from_dlpack"), reason="numpy without DLPack support")
def test_dlpack_input_is_read_without_a_copy(rng: np.random.Generator) -> None:
    arrays = _good(rng)
    data = np.asarray(arrays["x"])
    arrays["x"] = DLPackOnly(data)
    bound = bind_inputs(_graph(), arrays)
    np.testing.assert_array_equal(bound["x"], data)
    assert np.shares_memory(bound["x"], data)


@pytest.mark.skipif(not hasattr(np, "from_dlpack"), reason="numpy without DLPack support")
def test_dlpack_input_is_still_checked(rng: np.random.Generator) -> None:
    arrays = _good(rng)
    arrays["x"] = DLPackOnly(np.asarray(arrays["x"], dtype=np.float64))
    _refused(arrays, rlx.RlxTypeError, TypeError)
    arrays["x"] = DLPackOnly(np.zeros((2, 3), np.float32))
    _refused(arrays, rlx.RlxValueError, ValueError)


def test_failing_dlpack_export_is_a_type_error(rng: np.random.Generator) -> None:
    class OnAnotherDevice:
        def __dlpack__(self, **kwargs: object) -> object:
            raise BufferError("tensor lives on a GPU")

        def __dlpack_device__(self) -> tuple[int, int]:
            return (2, 0)

    arrays = _good(rng)
    arrays["x"] = OnAnotherDevice()
    assert "GPU" in _refused(arrays, rlx.RlxTypeError, TypeError)


def _views(base: np.ndarray) -> dict[str, np.ndarray]:
    """Non-contiguous (or unaligned) float32 arrays of shape (2, 3, 4) with the values of ``base``."""
    raw = np.zeros(base.nbytes + 1, np.uint8)[1:].view(np.float32).reshape(base.shape)  # odd address
    raw[...] = base
    padded = np.zeros((2, 3, 8), np.float32)
    padded[:, :, ::2] = base
    return {
        "transposed": np.ascontiguousarray(base.transpose(2, 1, 0)).transpose(2, 1, 0),
        "strided": padded[:, :, ::2],
        "reversed": np.ascontiguousarray(base[::-1])[::-1],
        "fortran": np.asfortranarray(base),
        "unaligned": raw,
    }


@pytest.mark.parametrize("kind", ["transposed", "strided", "reversed", "fortran", "unaligned"])
def test_non_contiguous_inputs_become_dense_copies(kind: str, rng: np.random.Generator) -> None:
    arrays = _good(rng)
    view = _views(np.asarray(arrays["x"]))[kind]
    assert not (view.flags.c_contiguous and view.flags.aligned)
    arrays["x"] = view
    bound = bind_inputs(_graph(), arrays)["x"]
    assert bound.flags.c_contiguous and bound.flags.aligned
    np.testing.assert_array_equal(bound, view)


def test_broadcast_view_becomes_a_dense_copy() -> None:
    arrays = {"x": np.broadcast_to(np.float32(2.5), SHAPES["x"]), "pad": np.ones(SHAPES["pad"], np.float32)}
    arrays["ids"] = np.broadcast_to(np.int64(7), SHAPES["ids"])
    bound = bind_inputs(_graph(), arrays)
    assert all(a.flags.c_contiguous and a.strides[-1] == a.itemsize for a in bound.values())
    assert np.all(bound["x"] == 2.5)


def test_non_contiguous_inputs_give_the_same_attention(rng: np.random.Generator) -> None:
    case = Case(3, 4, 3)
    arrays = make_inputs(case, rng)
    g = build_graph(case)
    want = run(g, **arrays)
    views = {name: np.asfortranarray(array) for name, array in arrays.items()}
    views["k"] = np.ascontiguousarray(arrays["k"].transpose(3, 2, 1, 0)).transpose(3, 2, 1, 0)
    got = run(g, **views)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


# ----------------------------------------------------------------------------- InputBinder

_DECLARED = {"a": ("n", 3), "b": (2, "n", "m"), "c": (4,), "ids": ("m",)}


def _binder_graph() -> Graph:
    g = Graph("binder")
    for name, shape in _DECLARED.items():
        g.input(name, shape, dtype="int64" if name == "ids" else "float32")
    return g


@st.composite
def _calls(draw: st.DrawFn) -> dict[str, object]:
    """Mostly good calls, each with a chance of one thing wrong or unusual."""
    sizes = {"n": draw(st.integers(1, 4)), "m": draw(st.integers(1, 4))}
    arrays: dict[str, object] = {}
    for name, shape in _DECLARED.items():
        dims = tuple(sizes[d] if isinstance(d, str) else d for d in shape)
        dtype = np.int64 if name == "ids" else np.float32
        array = np.zeros(dims, dtype=dtype)
        twist = draw(
            st.sampled_from(["none"] * 6 + ["dtype", "shape", "strided", "readonly", "list", "swapped", "omit"])
        )
        if twist == "dtype":
            array = array.astype(np.float64)
        elif twist == "shape":
            array = np.zeros((*dims, 1), dtype=dtype)
        elif twist == "strided":
            array = np.zeros((*dims[:-1], 2 * dims[-1]), dtype=dtype)[..., ::2]
        elif twist == "readonly":
            array.setflags(write=False)
        elif twist == "swapped":
            array = array.astype(np.dtype(dtype).newbyteorder())
        if twist == "omit":
            continue
        arrays[name] = array.tolist() if twist == "list" else array
    if draw(st.booleans()) and draw(st.booleans()):
        arrays["extra"] = np.zeros(1, np.float32)
    return arrays


@settings(max_examples=300, deadline=None)
@given(_calls())
def test_input_binder_agrees_with_bind_inputs(arrays: dict[str, object]) -> None:
    """Whatever the call, InputBinder binds exactly what bind_inputs + symbol_sizes bind (the same
    array objects where no conversion is needed) or raises the same error."""
    graph = _binder_graph()
    try:
        want = bind_inputs(graph, arrays)
        want_sizes = symbol_sizes(graph, want)
    except rlx.RlxError as expected:
        with pytest.raises(type(expected)) as info:
            InputBinder(graph)(arrays)
        assert str(info.value) == str(expected)
        return
    got, sizes = InputBinder(graph)(arrays)
    assert sizes == want_sizes
    assert list(got) == list(want)
    for name, array in want.items():
        if array is arrays[name]:
            assert got[name] is array
        else:
            assert np.array_equal(got[name], array) and got[name].dtype == array.dtype
            assert got[name].flags.c_contiguous
