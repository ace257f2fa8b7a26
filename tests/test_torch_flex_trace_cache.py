"""rlx.torch flex_attention reuses a call's trace when the next call's mods read the same things.

The key (rlx/torch/_fingerprint.py) is the mods' code with their closure cells, defaults and
the globals they name: numbers and 0-dim tensors by value (a trace bakes them in), tensors
indexed by the symbols by identity (a trace reads them per call). Every case checks the result
against a float64 formula, so a stale trace fails it, and counts the traces.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

import rlx

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch
rt = pytest.importorskip("rlx.torch")
flex = pytest.importorskip("rlx.torch.flex")
fingerprint = pytest.importorskip("rlx.torch._fingerprint")

B, H, S, D = 2, 2, 24, 8
DOC = torch.zeros(B, S, dtype=torch.int64)  # rebound by a test: read through the module's globals


def _formula(q: Any, k: Any, v: Any, score_mod: Any, mask_mod: Any) -> Any:
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(D)
    b, h, i, j = torch.meshgrid(*(torch.arange(n) for n in scores.shape), indexing="ij")
    if score_mod is not None:
        scores = score_mod(scores, b, h, i, j)
    if mask_mod is not None:
        scores = scores.masked_fill(~mask_mod(b, h, i, j), -math.inf)
    return torch.softmax(scores, -1) @ v.double()


@pytest.fixture()
def traces(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the traces flex_attention makes, from an empty cache."""
    monkeypatch.setattr(flex, "_traces", type(flex._traces)())
    count: list[int] = []
    traced = flex._flex_graph

    def counting(*args: Any, **kwargs: Any) -> Any:
        count.append(1)
        return traced(*args, **kwargs)

    monkeypatch.setattr(flex, "_flex_graph", counting)
    return count


def _check(score_mod: Any = None, mask_mod: Any = None, formula: tuple[Any, Any] | None = None) -> None:
    torch.manual_seed(len(str(score_mod)) + len(str(mask_mod)))
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    out = rt.flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    want = _formula(q, k, v, *(formula or (score_mod, mask_mod)))
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=2e-6)


def _window(width: int) -> Callable[..., Any]:
    return lambda b, h, q, kv: (q >= kv) & (kv > q - width)


def test_the_same_mods_trace_once(traces: list[int]) -> None:
    for _ in range(3):
        _check(mask_mod=_window(5))  # a new closure each call, of the same code and cell values
    assert len(traces) == 1


def test_a_changed_closure_number_traces_again(traces: list[int]) -> None:
    for width in (3, 7, 3):
        _check(mask_mod=_window(width))
    assert len(traces) == 2  # the third call reuses the first's trace


def test_a_rebound_global_tensor_is_read_anew(traces: list[int]) -> None:
    global DOC

    def document(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return DOC[b, q] == DOC[b, kv]

    for split in (8, 16):
        DOC = (torch.arange(S) >= split).long().expand(B, S).contiguous()
        _check(mask_mod=document)
    assert len(traces) == 2


def test_writes_into_a_captured_tensor_are_seen_without_a_trace(traces: list[int]) -> None:
    bias = torch.zeros(B, H, S, S)

    def add_bias(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return score + bias[b, h, q, kv]

    for value in (0.0, 2.0):
        bias.normal_(value)
        _check(score_mod=add_bias)
    assert len(traces) == 1


def test_a_zero_dim_tensor_is_a_value(traces: list[int]) -> None:
    factor = torch.tensor(0.5)

    def scaled(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return score * factor

    _check(score_mod=scaled)
    factor.fill_(2.0)  # baked into the trace as a constant: the changed value needs a new trace
    _check(score_mod=scaled)
    assert len(traces) == 2


def test_mods_without_a_key_are_traced_every_call(traces: list[int]) -> None:
    class Window:
        width = 4

        def __call__(self, b: Any, h: Any, q: Any, kv: Any) -> Any:
            return (q >= kv) & (kv > q - self.width)

    mask = Window()
    assert fingerprint.mod_key(mask) is None
    _check(mask_mod=mask)
    mask.width = 9
    _check(mask_mod=mask)
    assert len(traces) == 2


def test_the_kept_traces_are_bounded(traces: list[int]) -> None:
    for width in range(flex.TRACES_KEPT + 5):
        rt.flex_attention(*(torch.randn(1, 1, 4, 8) for _ in range(3)), mask_mod=_window(width))
    assert len(flex._traces) == flex.TRACES_KEPT


def test_keys_of_what_mods_read() -> None:
    """Numbers by value, tensors by identity, functions by their code and what they read."""
    key = fingerprint.mod_key

    def reader(tensor: Any) -> Callable[..., Any]:
        return lambda b, h, q, kv: tensor[b, q] > 0

    t = torch.zeros(3, 3)
    assert key(_window(2)) == key(_window(2)) != key(_window(3))
    assert key(reader(t)) == key(reader(t)) != key(reader(torch.zeros(3, 3)))
    assert key(None) is not None
    assert key(lambda b, h, q, kv: torch.where(q > kv, q, kv)) is not None  # torch functions have keys
    state = {"width": 3}

    def within(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return q - kv < state["width"]

    before = key(within)
    state["width"] = 4
    assert before is not None and key(within) != before


class _Settings:
    width = 4


LIMIT = 3  # read by a function defined inside a mod


def test_attributes_of_the_programs_classes_and_modules_and_nested_functions_stay_current(
    traces: list[int],
) -> None:
    """A class's or a module's attribute may change between calls: such mods have no key (traced
    every call); a function defined inside a mod reads the mod's globals, which are keyed."""
    import types

    settings = types.ModuleType("settings")  # a module of the program's own
    settings.width = 2  # type: ignore[attr-defined]

    def by_module(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (q >= kv) & (kv > q - settings.width)  # type: ignore[attr-defined]

    def by_class(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (q >= kv) & (kv > q - _Settings.width)

    assert fingerprint.mod_key(by_module) is None and fingerprint.mod_key(by_class) is None
    for width in (2, 6):
        settings.width = width  # type: ignore[attr-defined]
        _Settings.width = width
        _check(mask_mod=by_module, formula=(None, _window(width)))
        _check(mask_mod=by_class, formula=(None, _window(width)))

    def nested(b: Any, h: Any, q: Any, kv: Any) -> Any:
        def near(distance: Any) -> Any:
            return distance < LIMIT

        return (q >= kv) & near(q - kv)

    global LIMIT
    before = len(traces)
    for limit in (3, 5, 3):
        LIMIT = limit
        _check(mask_mod=nested, formula=(None, _window(limit)))
    assert len(traces) - before == 2


def test_kept_traces_keep_no_tensor_alive(traces: list[int]) -> None:
    """A mod indexing a new tensor on every call (a bias computed per step): the kept traces hold
    them weakly, so their memory goes when the caller drops them, and a later tensor that takes
    a dead one's id matches nothing."""
    import gc
    import weakref

    def biased(bias: Any) -> Callable[..., Any]:
        return lambda score, b, h, q, kv: score + bias[b, h, q, kv]

    refs = []
    for _ in range(5):
        bias = torch.randn(B, H, S, S)
        refs.append(weakref.ref(bias))
        with torch.no_grad():
            _check(score_mod=biased(bias))
        del bias
    gc.collect()
    assert all(ref() is None for ref in refs)
    assert len(traces) == 5


def _shaped_check(batch: int, seq_q: int, seq_k: int, score_mod: Any = None, mask_mod: Any = None) -> None:
    """One call at these sizes (heads and head dims as everywhere here), against the formula."""
    torch.manual_seed(batch * 1000 + seq_q * 37 + seq_k)
    q = torch.randn(batch, H, seq_q, D)
    k, v = torch.randn(batch, H, seq_k, D), torch.randn(batch, H, seq_k, D)
    out = rt.flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    torch.testing.assert_close(out.double(), _formula(q, k, v, score_mod, mask_mod), rtol=1e-5, atol=2e-6)


def _softcap(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
    return 5.0 * torch.tanh(score / 5.0)


def _sees_key_zero(b: Any, h: Any, q: Any, kv: Any) -> Any:
    return (kv <= q) | (kv == 0)  # every row sees a key, whatever the lengths


def test_one_trace_serves_every_batch_and_length(traces: list[int]) -> None:
    """A symbolic trace is kept under the heads and head dims: a decode loop (Sk growing by one
    each call), a new batch, a prefill, all on one trace, each result right."""
    for seq_k in range(1, 12):
        _shaped_check(1, 1, seq_k, score_mod=_softcap, mask_mod=_sees_key_zero)
    for batch, seq_q, seq_k in ((3, 1, 5), (2, 9, 9), (1, 20, 4)):
        _shaped_check(batch, seq_q, seq_k, score_mod=_softcap, mask_mod=_sees_key_zero)
    assert len(traces) == 1
    _shaped_check(1, 1, 5, score_mod=_softcap)  # other mods: another trace
    assert len(traces) == 2


def test_a_trace_made_for_one_calls_sizes_serves_those_sizes_only(
    traces: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the symbolic trace fails (mods that need the lengths), the graph has the call's
    sizes, and its trace is kept under them: another length traces again, the same one not."""
    traced = flex._flex_graph

    def static_only(
        q: Any, k: Any, v: Any, score_mod: Any, mask_mod: Any, scale: Any, symbolic: bool, *rest: Any
    ) -> Any:
        if symbolic:
            raise rlx.RlxValueError("needs static lengths (forced by the test)")
        return traced(q, k, v, score_mod, mask_mod, scale, symbolic, *rest)

    monkeypatch.setattr(flex, "_flex_graph", static_only)
    for seq_k in (6, 9, 6, 9, 6):
        _shaped_check(1, 1, seq_k, score_mod=_softcap)
    assert len(traces) == 2
    _shaped_check(2, 1, 6, score_mod=_softcap)  # a new batch: new sizes
    assert len(traces) == 3


def test_a_captured_tensor_resized_in_place_is_traced_again(traces: list[int]) -> None:
    """A trace declares its captured tensors' shapes; the same tensor with another shape (resized
    in place) needs the graph traced for that shape (the mods' key holds the shapes)."""
    bias = torch.randn(H, S, S)

    def add_bias(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return score + bias[h, q, kv]

    _shaped_check(1, S, S, score_mod=add_bias)
    bias.resize_(H, S + 4, S + 4).normal_()
    _shaped_check(1, S, S, score_mod=add_bias)  # the same lengths as before: the shape tells
    _shaped_check(1, S + 4, S + 4, score_mod=add_bias)
    assert len(traces) == 2
