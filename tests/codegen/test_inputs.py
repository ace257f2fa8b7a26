"""Calling and compiling with bad arguments: named errors that are both RlxError and the builtin.

Also: non-contiguous, unaligned, read-only, byte-swapped and DLPack inputs give the same bits
as dense ones, and a call never writes into its inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from codegen_helpers import assert_outputs_close, case_inputs, multi_graph
from helpers import Case

import rlx
from rlx import Graph, Layout, MaskKind, RuntimeConfig, Wrt
from rlx.codegen import Executable, compile_graph

CASE = Case(5, 6, head_dim=4, batch=2, heads=2, mask=MaskKind.CUSTOM, layout=Layout.BSHD)


@pytest.fixture(scope="module")
def graph() -> Graph:
    return multi_graph(CASE, wrts=(Wrt.ALL,), name="inputs")


@pytest.fixture(scope="module")
def exe(graph: Graph) -> Executable:
    return rlx.compile(graph)


@pytest.fixture
def arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return case_inputs(CASE, rng)


def refused(call: Callable[[], object], error: type, builtin: type) -> str:
    """Run ``call``; it must raise ``error`` (an RlxError) that is also ``builtin``; return the message."""
    with pytest.raises(error) as info:
        call()
    assert isinstance(info.value, rlx.RlxError)
    assert isinstance(info.value, builtin)
    return str(info.value)


# ---------------------------------------------------------------------------- call-time errors


@pytest.mark.parametrize("name", ["q", "k", "v", "dy", "mask"])
def test_missing_input(name: str, exe: Executable, arrays: dict[str, np.ndarray]) -> None:
    """Leaving out any input is a KeyError naming it."""
    del arrays[name]
    assert repr(name) in refused(lambda: exe(**arrays), rlx.RlxKeyError, KeyError)


def test_unknown_input(exe: Executable, arrays: dict[str, np.ndarray]) -> None:
    """An extra, unknown name is a KeyError naming it (not silently ignored)."""
    arrays["qq"] = arrays["q"]
    assert "'qq'" in refused(lambda: exe(**arrays), rlx.RlxKeyError, KeyError)


@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int32, np.bool_])
@pytest.mark.parametrize("name", ["q", "v", "mask"])
def test_wrong_dtype_is_refused_not_converted(
    name: str, dtype: type, exe: Executable, arrays: dict[str, np.ndarray]
) -> None:
    """float64 (or any other dtype) is a TypeError naming the input and both dtypes."""
    arrays[name] = arrays[name].astype(dtype)
    message = refused(lambda: exe(**arrays), rlx.RlxTypeError, TypeError)
    assert repr(name) in message
    assert "float32" in message


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("q", (2, 5, 2, 5)),  # wrong head dim
        ("q", (2, 2, 5, 4)),  # the BHSD shape given to a BSHD graph
        ("k", (2, 5, 2, 4)),  # Sq keys instead of Sk
        ("q", (2, 5, 8)),  # wrong rank
        ("q", (1, 2, 5, 2, 4)),
        ("mask", (2, 5)),  # key-padding mask of the wrong length
        ("mask", (2, 1, 6)),
    ],
)
def test_wrong_shape_or_rank(
    name: str, shape: tuple[int, ...], exe: Executable, arrays: dict[str, np.ndarray], rng: np.random.Generator
) -> None:
    """A wrong shape or rank is a ValueError naming the input and the expected shape."""
    arrays[name] = rng.standard_normal(shape).astype(np.float32)
    message = refused(lambda: exe(**arrays), rlx.RlxValueError, ValueError)
    assert repr(name) in message
    assert str(CASE.q_shape if name == "q" else CASE.kv_shape if name == "k" else CASE.mask_shape) in message


@pytest.mark.parametrize("obj", [None, "q", object(), {"a": 1}, [[1, 2], [3]]], ids=repr)
def test_not_an_array(obj: object, exe: Executable, arrays: dict[str, np.ndarray]) -> None:
    """Objects that are not arrays are a TypeError naming the input."""
    arrays["q"] = obj  # type: ignore[assignment]
    assert "'q'" in refused(lambda: exe(**arrays), rlx.RlxTypeError, TypeError)


def test_scalar_is_a_wrong_rank(exe: Executable, arrays: dict[str, np.ndarray]) -> None:
    arrays["dy"] = np.float32(1.0)  # type: ignore[assignment]
    refused(lambda: exe(**arrays), rlx.RlxValueError, ValueError)


def test_python_lists_are_float64_so_refused(exe: Executable, arrays: dict[str, np.ndarray]) -> None:
    """A nested list converts to float64: refused like any float64 array (no silent conversion)."""
    arrays["v"] = arrays["v"].tolist()  # type: ignore[assignment]
    refused(lambda: exe(**arrays), rlx.RlxTypeError, TypeError)


def test_an_error_leaves_the_executable_usable(exe: Executable, graph: Graph, arrays: dict[str, np.ndarray]) -> None:
    """After refused calls the same executable still computes the right answer."""
    bad = dict(arrays, q=arrays["q"].astype(np.float64))
    for _ in range(3):
        with pytest.raises(TypeError):
            exe(**bad)
    assert_outputs_close(exe(**arrays), rlx.reference.run(graph, **arrays))


# ---------------------------------------------------------------------------- unusual but valid memory


def _views(base: np.ndarray) -> dict[str, np.ndarray]:
    """Arrays equal to ``base`` (rank 4 or 2) whose memory is not dense C order, or not aligned."""
    order = tuple(reversed(range(base.ndim)))
    padded = np.zeros((*base.shape[:-1], 2 * base.shape[-1]), np.float32)
    padded[..., ::2] = base
    raw = np.zeros(base.nbytes + 1, np.uint8)[1:].view(np.float32).reshape(base.shape)  # odd address
    raw[...] = base
    readonly = base.copy()
    readonly.flags.writeable = False
    return {
        "transposed": np.ascontiguousarray(base.transpose(order)).transpose(order),
        "strided": padded[..., ::2],
        "reversed": np.ascontiguousarray(base[::-1])[::-1],
        "fortran": np.asfortranarray(base),
        "unaligned": raw,
        "big_endian": base.astype(">f4"),
        "readonly": readonly,
    }


@pytest.mark.parametrize("kind", ["transposed", "strided", "reversed", "fortran", "unaligned", "big_endian",
                                  "readonly"])
def test_unusual_memory_gives_identical_results(kind: str, exe: Executable, arrays: dict[str, np.ndarray]) -> None:
    """Every input given as such a view: the same bits as dense inputs (the call makes dense copies)."""
    want = exe(**arrays)
    views = {name: _views(array)[kind] for name, array in arrays.items()}
    for name, view in views.items():
        np.testing.assert_array_equal(view, arrays[name])
        if kind not in ("big_endian", "readonly"):
            assert not (view.flags.c_contiguous and view.flags.aligned), name
    got = exe(**views)
    for name in want:
        assert np.array_equal(got[name], want[name]), name


def test_bhsd_views_of_a_bshd_array(rng: np.random.Generator) -> None:
    """A BHSD graph fed ``x.transpose(0, 2, 1, 3)`` views of BSHD data (the common real-world case)."""
    case = Case(6, 7, head_dim=4, batch=2, heads=3, mask=MaskKind.CAUSAL, layout=Layout.BHSD)
    g = multi_graph(case, wrts=(Wrt.ALL,))
    dense = case_inputs(case, rng)
    views = {name: np.ascontiguousarray(a.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for name, a in dense.items()}
    got = rlx.compile(g)(**views)
    assert_outputs_close(got, rlx.reference.run(g, **dense))


class DLPackOnly:
    """Exposes memory through DLPack only (no ``__array__``), like a tensor of another library."""

    def __init__(self, data: np.ndarray) -> None:
        self._data = data

    def __dlpack__(self, **kwargs: object) -> object:
        return self._data.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._data.__dlpack_device__()


@pytest.mark.skipif(not hasattr(np, "from_dlpack"), reason="numpy without DLPack support")
def test_dlpack_inputs(exe: Executable, arrays: dict[str, np.ndarray]) -> None:
    """DLPack-only objects are accepted (and still checked: a float64 one is a TypeError)."""
    want = exe(**arrays)
    got = exe(**{name: DLPackOnly(array) for name, array in arrays.items()})
    for name in want:
        assert np.array_equal(got[name], want[name]), name
    bad = dict(arrays, q=DLPackOnly(arrays["q"].astype(np.float64)))
    refused(lambda: exe(**bad), rlx.RlxTypeError, TypeError)


def test_inputs_are_never_written(exe: Executable, arrays: dict[str, np.ndarray]) -> None:
    """The kernels accumulate into dK/dV, never into q, k, v, dy or the mask."""
    saved = {name: array.copy() for name, array in arrays.items()}
    exe(**arrays)
    exe(**arrays)
    for name, array in arrays.items():
        assert np.array_equal(array, saved[name]), name


def test_odd_mask_values(exe: Executable, graph: Graph, arrays: dict[str, np.ndarray]) -> None:
    """Key-padding entries that are NaN, +-inf or exactly the threshold follow ``mask < threshold``."""
    arrays["mask"][0, :4] = [np.nan, np.inf, -np.inf, 0.5]
    got = exe(**arrays)
    assert_outputs_close(got, rlx.reference.run(graph, **arrays))


# ---------------------------------------------------------------------------- compile-time errors


def test_compile_rejects_non_graphs() -> None:
    for obj in (None, "graph", object()):
        refused(lambda obj=obj: rlx.compile(obj), rlx.RlxTypeError, TypeError)  # type: ignore[misc]


@pytest.mark.parametrize("passes", ["dce", [1], ["dce", None], [b"dce"]], ids=repr)
def test_passes_must_be_a_list_of_names(passes: object, graph: Graph) -> None:
    refused(lambda: rlx.compile(graph, passes=passes), rlx.RlxTypeError, TypeError)  # type: ignore[arg-type]


def test_unknown_pass_name(graph: Graph) -> None:
    message = refused(lambda: rlx.compile(graph, passes=["dce", "no-such-pass"]), rlx.RlxKeyError, KeyError)
    assert "no-such-pass" in message


@pytest.mark.parametrize("config", [{"num_threads": 1}, 1, "config", RuntimeConfig], ids=repr)
def test_config_must_be_a_runtime_config(config: object, graph: Graph) -> None:
    refused(lambda: rlx.compile(graph, config=config), rlx.RlxTypeError, TypeError)  # type: ignore[arg-type]


def test_options_must_be_codegen_options(graph: Graph) -> None:
    refused(lambda: compile_graph(graph, options={"block_q": 4}), rlx.RlxTypeError, TypeError)  # type: ignore[arg-type]


def test_compile_errors_leave_the_graph_unchanged(graph: Graph) -> None:
    """A failed compile (bad pass list) does not mutate or half-transform the user's graph."""
    before = str(graph)
    with pytest.raises(KeyError):
        rlx.compile(graph, passes=["fuse-attention-bwd", "no-such-pass"])
    assert str(graph) == before
