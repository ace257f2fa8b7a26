"""Property tests: every graph the builder can make prints, parses back and prints the same."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rlx
from rlx import Graph, Layout, MaskKind, OpKind, TensorType, Value, Wrt
from rlx.ir import parse
from rlx.ir.opdef import REGISTRY

MASKS = st.one_of(
    st.sampled_from([MaskKind.NONE, MaskKind.CAUSAL, MaskKind.CUSTOM, MaskKind.BIAS]),
    st.integers(0, 6).map(MaskKind.sliding_window),
)
WRTS = st.integers(1, 7).map(Wrt)
NAME_STEMS = st.sampled_from(["q", "k", "v", "dy", "pad", "x.y", "_t", "input", "output", "graph"])
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class _Builder:
    """Draws a random valid graph: attention nodes read earlier values of the right shape."""

    def __init__(self, draw: st.DrawFn) -> None:
        self.draw = draw
        self.g = Graph(draw(st.sampled_from(["g", "attn", "block.0", "_x"])))
        self.batch, self.heads, self.head_dim = (draw(st.integers(1, 2)) for _ in range(3))
        self.seqs = draw(st.lists(st.integers(1, 4), min_size=1, max_size=2, unique=True))
        self.pool: list[Value] = []

    def value(self, shape: tuple[int, ...]) -> Value:
        """An existing f32 value of ``shape``, or a new input of it."""
        fits = [v for v in self.pool if v.shape == shape and v.dtype == np.float32]
        if fits and self.draw(st.booleans()):
            return self.draw(st.sampled_from(fits))
        stem = self.draw(NAME_STEMS)
        value = self.g.input(f"{stem}{len(self.g)}", shape)
        self.pool.append(value)
        return value

    def node(self) -> None:
        layout = self.draw(st.sampled_from(Layout))
        sq, sk = self.draw(st.sampled_from(self.seqs)), self.draw(st.sampled_from(self.seqs))
        b, h, d = self.batch, self.heads, self.head_dim
        q = self.value(layout.join(b, sq, h, d))
        k, v = self.value(layout.join(b, sk, h, d)), self.value(layout.join(b, sk, h, d))
        mask = self.draw(MASKS)
        mask_input = None
        if mask == MaskKind.CUSTOM:
            mask_input = self.value((b, sk))
        elif mask == MaskKind.BIAS:
            mask_input = self.value((b, h, sq, sk))
        if self.draw(st.booleans()):
            out = self.g.attention(q, k, v, mask=mask, layout=layout, mask_input=mask_input)
            self.pool.append(out)
        else:
            dy = self.value(layout.join(b, sq, h, d))
            wrt = self.draw(WRTS)
            grads = self.g.attention_bwd(q, k, v, dy, wrt=wrt, mask=mask, layout=layout, mask_input=mask_input)
            self.pool += [grads] if isinstance(grads, Value) else list(grads)

    def other_input(self) -> None:
        """An input attention cannot use: other dtypes and ranks must print and parse too."""
        shape = tuple(self.draw(st.lists(st.integers(1, 3), max_size=3)))
        dtype = self.draw(st.sampled_from(["float32", "float64", "float16", "int32", "int64", "bool"]))
        self.g.input(f"extra{len(self.g)}", shape, dtype=dtype)

    def outputs(self) -> None:
        chosen = self.draw(st.lists(st.sampled_from(self.pool), max_size=4)) if self.pool else []
        if chosen and self.draw(st.booleans()):
            self.g.output(*chosen)  # positional: out0, out1, ...
        else:
            self.g.output(**{f"y{i}": value for i, value in enumerate(chosen)})


@st.composite
def graphs(draw: st.DrawFn) -> Graph:
    builder = _Builder(draw)
    for _ in range(draw(st.integers(0, 6))):
        if draw(st.integers(0, 4)) == 0:
            builder.other_input()
        else:
            builder.node()
    builder.outputs()
    return builder.g


@SETTINGS
@given(graphs())
def test_print_parse_print_is_identity(g: Graph) -> None:
    g.verify()
    text = str(g)
    parsed = parse(text)
    assert str(parsed) == text
    parsed.verify()
    assert list(parsed.outputs) == list(g.outputs)
    assert [n.attrs for n in parsed.nodes] == [n.attrs for n in g.nodes]


@SETTINGS
@given(graphs())
def test_copy_and_dot_cover_every_node(g: Graph) -> None:
    clone = g.copy()
    assert str(clone) == str(g)
    clone.verify()
    dot = g.to_dot()
    for node in g.nodes:
        assert f"  n{node.id} [" in dot
    edges = sum(len(node.inputs) for node in g.nodes) + len(g.outputs)
    assert dot.count(" -> ") == edges


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_damaged_text_never_escapes_the_error_hierarchy(data: st.DataObject) -> None:
    """Any edit of valid text either still parses or raises RlxValueError; nothing else escapes."""
    text = str(data.draw(graphs()))
    start = data.draw(st.integers(0, len(text)))
    end = data.draw(st.integers(start, min(len(text), start + 4)))
    insert = data.draw(st.text(alphabet='%@{}[](),:=|"-._ qkv0123456789\n\\²é', max_size=3))
    damaged = text[:start] + insert + text[end:]
    try:
        parsed = parse(damaged)
    except rlx.RlxValueError as exc:
        assert str(exc).startswith("line ")
    else:
        parsed.verify()
        assert str(parse(str(parsed))) == str(parsed)


@dataclasses.dataclass(frozen=True)
class _LabelAttrs:
    """Stand-in for a future op with a free-text attribute."""

    label: str


def _same_as_first(what: str, inputs: Sequence[TensorType], attrs: object) -> tuple[TensorType, ...]:
    return (inputs[0],)


@SETTINGS
@given(st.lists(st.text(), min_size=1, max_size=3))
def test_any_str_attribute_round_trips(labels: list[str]) -> None:
    """Whatever a str attribute holds (quotes, commas, newlines, any code point) prints on one line and parses back."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(
            REGISTRY,
            "attention",
            dataclasses.replace(REGISTRY["attention"], attrs=_LabelAttrs, infer=_same_as_first, operands=("x",)),
        )
        g = Graph("labels")
        x = g.input("x", (2,))
        for label in labels:
            g.add_node(OpKind.ATTENTION, [x], _LabelAttrs(label))
        text = str(g)
        assert len(text.splitlines()) == 3 + len(labels)
        parsed = parse(text)
        assert [n.attrs.label for n in parsed.nodes[1:]] == labels
        assert str(parsed) == text
