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
