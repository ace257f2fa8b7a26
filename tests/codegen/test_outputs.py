"""What a call returns: new, dense, writable float32 arrays, one per output name, never aliases.

Outputs that are graph inputs, the same value under two names, and intermediates that are both
outputs and operands of later nodes all come back as arrays of their own.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from codegen_helpers import assert_outputs_close, case_inputs, declare_inputs, multi_graph
from helpers import Case

import rlx
from rlx import Graph, Layout, MaskKind, RuntimeConfig, Wrt
from rlx.codegen import executable as executable_module

CASE = Case(6, 8, head_dim=4, batch=2, heads=2, mask=MaskKind.CAUSAL)


def assert_fresh(result: dict[str, np.ndarray], *others: np.ndarray) -> None:
    """Every array is dense float32 memory of its own, shared with nothing in ``others`` nor with
    each other (a view of a buffer only it uses: ``output_pool.aligned_empty``)."""
    arrays = list(result.values())
    for name, array in result.items():
        assert type(array) is np.ndarray, name
        assert array.dtype == np.float32, name
        assert array.flags.c_contiguous and array.flags.writeable, name
        for other in others:
            assert not np.shares_memory(array, other), f"{name} shares memory with an input"
    for i, a in enumerate(arrays):
        for b in arrays[i + 1 :]:
            assert not np.shares_memory(a, b), "two outputs share memory"


def test_input_as_output_is_a_copy(rng: np.random.Generator) -> None:
    """``g.output(x=q)`` returns an equal, separate array (mutating it leaves the input alone)."""
    g = Graph("passthrough")
    q, k, v, _, _ = declare_inputs(g, CASE)
    g.output(x=q, out=g.attention(q, k, v, mask=CASE.mask))
    arrays = case_inputs(CASE, rng)
    exe = rlx.compile(g)
    got = exe(**arrays)
    assert np.array_equal(got["x"], arrays["q"])
    assert got["x"] is not arrays["q"]
    assert_fresh(got, *arrays.values())
    got["x"][...] = 7.0
    assert not np.any(arrays["q"] == 7.0)
    assert_outputs_close(exe(**arrays), rlx.reference.run(g, **arrays))


def test_graph_without_compute_nodes(rng: np.random.Generator) -> None:
    """A graph that only forwards inputs compiles and returns copies (twice under two names)."""
    g = Graph("identity")
    q = g.input("q", CASE.q_shape)
    g.output(a=q, b=q)
    arrays = {"q": case_inputs(CASE, rng)["q"]}
    got = rlx.compile(g)(**arrays)
    assert list(got) == ["a", "b"]
    assert np.array_equal(got["a"], arrays["q"]) and np.array_equal(got["b"], arrays["q"])
    assert_fresh(got, arrays["q"])


def test_same_value_under_two_names(rng: np.random.Generator) -> None:
    """Two output names for one computed value: two distinct, equal arrays."""
    g = Graph("twice")
    q, k, v, dy, _ = declare_inputs(g, CASE)
    out = g.attention(q, k, v, mask=CASE.mask)
    dk = g.attention_bwd(q, k, v, dy, wrt=Wrt.KEY, mask=CASE.mask)
    g.output(first=out, second=out, dk=dk, dk_again=dk)
    arrays = case_inputs(CASE, rng)
    for passes in ([], None):
        got = rlx.compile(g, passes=passes)(**arrays)
        assert list(got) == ["first", "second", "dk", "dk_again"]
        assert np.array_equal(got["first"], got["second"])
        assert np.array_equal(got["dk"], got["dk_again"])
        assert_fresh(got, *arrays.values())
        assert_outputs_close(got, rlx.reference.run(g, **arrays))


def test_output_that_later_nodes_read(rng: np.random.Generator) -> None:
    """An intermediate that is also an output is written once and read back correctly."""
    g = Graph("reread")
    q, k, v, _dy, _ = declare_inputs(g, CASE)
    o1 = g.attention(q, k, v, mask=CASE.mask)
    o2 = g.attention(o1, k, v)
    d = g.attention_bwd(o1, k, v, o2, wrt=Wrt.QUERY | Wrt.VALUE)
    g.output(o1=o1, o2=o2, d_q=d[0], d_v=d[1], again=o1)
    arrays = case_inputs(CASE, rng)
    got = rlx.compile(g, passes=[])(**arrays)
    assert_fresh(got, *arrays.values())
    assert_outputs_close(got, rlx.reference.run(g, **arrays))


def test_calls_never_share_results(rng: np.random.Generator) -> None:
    """Each call returns new arrays: results of an earlier call survive later calls untouched."""
    g = Graph("calls")
    q, k, v, dy, _ = declare_inputs(g, CASE)
    dq, dk, dv = g.attention_bwd(q, k, v, dy, wrt=Wrt.ALL, mask=CASE.mask)
    g.output(out=g.attention(q, k, v, mask=CASE.mask), dq=dq, dk=dk, dv=dv, x=q)
    exe = rlx.compile(g)
    first_inputs = case_inputs(CASE, rng)
    second_inputs = case_inputs(CASE, rng)
    first = exe(**first_inputs)
    kept = {name: array.copy() for name, array in first.items()}
    second = exe(**second_inputs)
    for name in first:
        assert not np.shares_memory(first[name], second[name]), name
        assert np.array_equal(first[name], kept[name]), f"{name} of the first call was overwritten"
        assert not np.array_equal(first[name], second[name]), name
    first["dk"][...] = np.nan  # scribbling on a result does not leak into the next call
    third = exe(**first_inputs)
    for name in kept:
        assert np.array_equal(third[name], kept[name]), name
    assert_fresh(second, *second_inputs.values())


def test_output_order_and_shapes_follow_the_graph(rng: np.random.Generator) -> None:
    """Names come back in ``g.output`` order with each value's declared shape, also after fusion."""
    g = Graph("order")
    q, k, v, dy, _ = declare_inputs(g, CASE)
    dv = g.attention_bwd(q, k, v, dy, wrt=Wrt.VALUE, mask=CASE.mask)
    dq = g.attention_bwd(q, k, v, dy, wrt=Wrt.QUERY, mask=CASE.mask)
    g.output(z_dv=dv, a_dq=dq)
    got = rlx.compile(g)(**case_inputs(CASE, rng))
    assert list(got) == ["z_dv", "a_dq"]
    assert got["z_dv"].shape == CASE.kv_shape and got["a_dq"].shape == CASE.q_shape


class _PoisonedNumpy:
    """NumPy, except that ``empty`` returns memory filled with 0xFF bytes (NaN as float32)."""

    def __getattr__(self, name: str) -> object:
        return getattr(np, name)

    @staticmethod
    def empty(*args: object, **kwargs: object) -> np.ndarray:
        array = np.empty(*args, **kwargs)  # type: ignore[call-overload]
        array.view(np.uint8)[...] = 0xFF
        return array


@pytest.mark.parametrize(
    ("case", "config"),
    [
        (Case(5, 11, head_dim=4, mask=MaskKind.sliding_window(1), layout=Layout.BHSD), None),  # keys nobody sees
        (Case(9, 4, head_dim=3, mask=MaskKind.sliding_window(0)), RuntimeConfig(attn_mask_neg_inf=-math.inf)),
        (Case(6, 7, head_dim=4, mask=MaskKind.CUSTOM), RuntimeConfig(attn_mask_neg_inf=-math.inf)),
        (Case(7, 7, head_dim=5, heads=3, mask=MaskKind.CAUSAL), RuntimeConfig(num_threads=3)),
    ],
    ids=["unseen_keys", "dead_rows_neg_inf", "padded_batch_neg_inf", "threads"],
)
def test_every_output_and_arena_byte_is_written(
    case: Case, config: RuntimeConfig | None, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator
) -> None:
    """With output arrays and the arena poisoned with NaN, no NaN survives: the kernels write every
    element they return (zero dK/dV rows for keys no query sees, zero rows for dead queries) and
    never read an intermediate before writing it."""
    monkeypatch.setattr(executable_module, "np", _PoisonedNumpy())
    g = multi_graph(case, wrts=(Wrt.ALL, Wrt.VALUE, Wrt.QUERY | Wrt.KEY))
    arrays = case_inputs(case, rng)
    exe = rlx.compile(g, passes=[], config=config)
    assert np.isnan(executable_module.np.empty(3, np.float32)).all()  # the poison is in place
    got = exe(**arrays)
    for name, value in got.items():
        assert not np.isnan(value).any(), f"{name}: elements left unwritten"
    assert_outputs_close(got, rlx.reference.run(g, config=config, **arrays))

    # An intermediate read by later nodes lives in the (poisoned) arena.
    chain = Graph("poisoned_chain")
    q, k, v, dy, mask = declare_inputs(chain, case)
    o1 = chain.attention(q, k, v, mask=case.mask, layout=case.layout, mask_input=mask)
    o2 = chain.attention(o1, k, v, layout=case.layout)
    chain.output(o2=o2, dv=chain.attention_bwd(o1, k, v, dy, wrt=Wrt.VALUE, layout=case.layout))
    got = rlx.compile(chain, passes=[], config=config)(**arrays)
    assert_outputs_close(got, rlx.reference.run(chain, config=config, **arrays))


def test_one_array_passed_as_several_inputs(rng: np.random.Generator) -> None:
    """Self-attention from the caller's side: the same array object as q, k, v and dy."""
    case = Case(6, 6, head_dim=4, mask=MaskKind.CAUSAL)
    g = multi_graph(case, wrts=(Wrt.ALL,))
    x = case_inputs(case, rng)["q"]
    arrays = {"q": x, "k": x, "v": x, "dy": x}
    saved = x.copy()
    got = rlx.compile(g)(**arrays)
    assert np.array_equal(x, saved)
    assert_fresh(got, x)
    assert_outputs_close(got, rlx.reference.run(g, **arrays))


def test_output_named_like_an_input_never_writes_the_input() -> None:
    """Input and output names are separate namespaces: ``g.output(q=dq)`` beside input ``q`` gets its
    own fresh array, and the caller's ``q`` is left untouched (buffers are slots, not names)."""
    g = Graph("shadow")
    shape = (1, 5, 2, 3)
    q, k, v, dy = (g.input(name, shape) for name in ("q", "k", "v", "dy"))
    g.output(q=g.attention_bwd(q, k, v, dy, wrt=Wrt.QUERY), k=k)
    rng = np.random.default_rng(7)
    arrays = {name: rng.standard_normal(shape).astype(np.float32) for name in ("q", "k", "v", "dy")}
    before = {name: array.copy() for name, array in arrays.items()}
    got = rlx.compile(g)(**arrays)
    for name, array in arrays.items():
        assert np.array_equal(array, before[name]), f"input {name!r} was written"
    expected = rlx.reference.run(g, **arrays)
    np.testing.assert_allclose(got["q"], expected["q"], rtol=1e-4, atol=1e-5)
    assert np.array_equal(got["k"], arrays["k"]) and got["k"] is not arrays["k"]


# ---------------------------------------------------------------------------- recycled outputs


def _poisoned(result: dict[str, np.ndarray]) -> set[int]:
    """Fill a released result with NaN (the next call must overwrite every element); its addresses."""
    for array in result.values():
        array[...] = np.nan
    return {array.ctypes.data for array in result.values()}


def test_released_outputs_are_recycled_and_fully_rewritten(rng: np.random.Generator) -> None:
    """A result nobody holds is written into by the next call (no fresh pages), and every element
    is rewritten: poisoned with NaN, it comes back equal to the reference, forward and backward."""
    g = multi_graph(CASE)
    arrays = case_inputs(CASE, rng)
    exe = rlx.compile(g)
    want = rlx.reference.run(g, **arrays)
    result = exe(**arrays)
    addresses = _poisoned(result)
    del result
    again = exe(**arrays)
    assert {array.ctypes.data for array in again.values()} == addresses
    assert_outputs_close(again, want)
    assert_fresh(again, *arrays.values())


def test_held_outputs_are_never_written_again(rng: np.random.Generator) -> None:
    """Whatever still reaches an output (the array, a view of it, a memoryview, a weak
    reference) keeps it out of later calls: its values stay what that call returned."""
    import weakref

    g = multi_graph(CASE)
    arrays = case_inputs(CASE, rng)
    exe = rlx.compile(g)
    names = list(exe(**arrays))
    for hold in ("array", "view", "memoryview", "weakref"):
        result = exe(**arrays)
        name = names[0]
        kept = result[name].copy()
        holder: object = {
            "array": lambda a: a,
            "view": lambda a: a.reshape(-1)[1:],
            "memoryview": memoryview,
            "weakref": weakref.ref,
        }[hold](result[name])
        address = result[name].ctypes.data
        del result
        other = {key: value * 2.0 for key, value in arrays.items()}
        for _ in range(3):
            assert all(array.ctypes.data != address for array in exe(**other).values()), hold
        if hold == "weakref":
            alive = holder()  # type: ignore[operator]
            assert alive is None or np.array_equal(alive, kept)  # gone, or never written again
        elif hold == "memoryview":
            assert np.array_equal(np.asarray(holder).reshape(kept.shape), kept)
        elif hold == "view":
            assert np.array_equal(holder, kept.reshape(-1)[1:])
        else:
            assert np.array_equal(holder, kept)


def test_a_loop_keeping_the_last_result_alternates_two_arrays(rng: np.random.Generator) -> None:
    """``out = exe(...)`` in a loop holds the previous result while the next call runs: that one
    stays intact, and the calls alternate between two arrays per output."""
    g = multi_graph(CASE)
    base = case_inputs(CASE, rng)
    exe = rlx.compile(g)
    out, seen = None, set()
    for step in range(6):
        arrays = {key: value * (1.0 + 0.25 * step) for key, value in base.items()}
        previous = None if out is None else {key: value.copy() for key, value in out.items()}
        held = out
        out = exe(**arrays)
        if held is not None and previous is not None:
            for key in held:
                assert np.array_equal(held[key], previous[key], equal_nan=True), key
        del held
        assert_outputs_close(out, rlx.reference.run(g, **arrays))
        seen.add(out[next(iter(out))].ctypes.data)
    assert len(seen) == 2


def test_threads_calling_one_executable_get_their_own_outputs(rng: np.random.Generator) -> None:
    """Concurrent calls from Python threads never hand one array to two callers."""
    import threading

    g = multi_graph(CASE)
    exe = rlx.compile(g)
    inputs = [{key: value * (1 + i) for key, value in case_inputs(CASE, rng).items()} for i in range(4)]
    wants = [rlx.reference.run(g, **arrays) for arrays in inputs]
    failures: list[str] = []

    def work(index: int) -> None:
        for _ in range(20):
            got = exe(**inputs[index])
            try:
                assert_outputs_close(got, wants[index])
            except AssertionError as error:  # pragma: no cover - reported below
                failures.append(str(error))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[0]
