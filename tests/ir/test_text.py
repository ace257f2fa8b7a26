"""Textual IR: golden printouts, parser round trips and parser error messages."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence

import pytest

import rlx
from rlx import Graph, Layout, MaskKind, OpKind, TensorType, Wrt
from rlx.ir import parse
from rlx.ir.opdef import REGISTRY

from .graphs import HAND_WRITTEN, spec_graph

# ----------------------------------------------------------------------------- golden text

GOLDEN_SPEC = """\
graph @attn {
  %q = input "q" : f32[2,5,2,4]
  %k = input "k" : f32[2,3,2,4]
  %v = input "v" : f32[2,3,2,4]
  %dy = input "dy" : f32[2,5,2,4]
  %0 = attention %q, %k, %v {mask = causal, layout = bshd} : f32[2,5,2,4]
  %1, %2, %3 = attention_bwd %q, %k, %v, %dy {wrt = q|k|v, mask = causal, layout = bshd} \
: f32[2,5,2,4], f32[2,3,2,4], f32[2,3,2,4]
  output o = %0, dq = %1, dk = %2, dv = %3
}"""

GOLDEN_BHSD = """\
graph @bhsd.masks {
  %q = input "q" : f32[2,2,5,4]
  %k = input "k" : f32[2,2,3,4]
  %v = input "v" : f32[2,2,3,4]
  %dy = input "dy" : f32[2,2,5,4]
  %pad = input "pad" : f32[2,3]
  %bias = input "bias" : f32[2,2,5,3]
  %0 = attention %q, %k, %v, %pad {mask = custom, layout = bhsd} : f32[2,2,5,4]
  %1 = attention_bwd %q, %k, %v, %dy {wrt = q, mask = sliding_window(2), layout = bhsd} : f32[2,2,5,4]
  %2, %3 = attention_bwd %q, %k, %v, %0, %bias {wrt = k|v, mask = bias, layout = bhsd} : f32[2,2,3,4], f32[2,2,3,4]
  output out0 = %0, out1 = %1, dk = %2, dv = %3
}"""

GOLDEN_INPUTS = """\
graph @inputs_only {
  %scale = input "scale" : f32[]
  %ids.i32 = input "ids.i32" : i32[7]
  %w64 = input "w64" : f64[2,3]
  %keep = input "keep" : bool[1]
}"""


@pytest.mark.parametrize(
    ("builder", "expected"),
    [
        (HAND_WRITTEN["spec"], GOLDEN_SPEC),
        (HAND_WRITTEN["bhsd_masks"], GOLDEN_BHSD),
        (HAND_WRITTEN["odd_inputs"], GOLDEN_INPUTS),
        (HAND_WRITTEN["empty"], "graph @empty {\n}"),
    ],
    ids=["spec", "bhsd_masks", "odd_inputs", "empty"],
)
def test_golden_printout(builder: Callable[[], Graph], expected: str) -> None:
    assert str(builder()) == expected


def test_printed_numbers_follow_print_order_not_node_ids() -> None:
    """Erasing a node leaves a gap in node ids but none in the printed value numbers."""
    g = spec_graph()
    q, k, v = (g.inputs[name] for name in "qkv")
    unused = g.attention(q, k, v, mask=MaskKind.sliding_window(1))
    late = g.attention(q, k, v, mask=MaskKind.NONE)
    g.output(late=late)
    g.erase(unused.node)
    assert str(g).splitlines()[-3:] == [
        "  %4 = attention %q, %k, %v {mask = none, layout = bshd} : f32[2,5,2,4]",
        "  output o = %0, dq = %1, dk = %2, dv = %3, late = %4",
        "}",
    ]


# ----------------------------------------------------------------------------- round trips


def _structure(g: Graph) -> list[tuple[object, ...]]:
    """What a graph means, independent of node ids: ops, attrs, operand positions, types."""
    position = {node.id: i for i, node in enumerate(g.nodes)}
    rows: list[tuple[object, ...]] = [
        (node.op, node.attrs, tuple((position[v.node.id], v.index) for v in node.inputs), node.types)
        for node in g.nodes
    ]
    rows.append(tuple((name, position[v.node.id], v.index) for name, v in g.outputs.items()))
    return rows


@pytest.mark.parametrize("name", sorted(HAND_WRITTEN))
def test_round_trip_hand_written(name: str) -> None:
    g = HAND_WRITTEN[name]()
    parsed = parse(str(g))
    assert str(parsed) == str(g)
    assert parsed.name == g.name
    assert _structure(parsed) == _structure(g)
    assert list(parsed.inputs) == list(g.inputs)
    parsed.verify()


def test_round_trip_gives_a_usable_graph() -> None:
    """The parsed graph is an ordinary graph: the builder keeps working on it."""
    parsed = parse(GOLDEN_SPEC)
    q, k, v, dy = (parsed.inputs[name] for name in ("q", "k", "v", "dy"))
    dv = parsed.attention_bwd(q, k, v, dy, wrt=Wrt.VALUE, mask=MaskKind.CAUSAL)
    parsed.output(dv_again=dv)
    parsed.verify()
    assert parsed.outputs["dv_again"].shape == (2, 3, 2, 4)
    assert str(parse(str(parsed))) == str(parsed)


def test_parser_accepts_free_layout_and_normalises_it() -> None:
    """Spacing, blank lines, comments, own value names and flag order do not matter."""
    text = """
    // a hand-written graph
    graph   @attn{
      %q=input "q":f32[2, 5, 2, 4]
      %k = input "k" : f32[2,3,2,4]     // keys

      %v = input "v" : f32[2,3,2,4]
      %dy = input "dy" : f32[2,5,2,4]
      %fwd = attention %q,%k,%v {layout = bshd, mask = causal} : f32[2,5,2,4]
      %gq, %gk, %gv = attention_bwd %q, %k, %v, %dy {mask=causal, wrt=v|k|q} : f32[2,5,2,4], f32[2,3,2,4], f32[2,3,2,4]
      output o = %fwd, dq = %gq
      output dk = %gk, dv = %gv
    }
    """
    assert str(parse(text)) == GOLDEN_SPEC


def test_attrs_default_when_left_out() -> None:
    text = GOLDEN_SPEC.replace(" {mask = causal, layout = bshd}", "").replace(", mask = causal, layout = bshd", "")
    parsed = parse(text)
    attention, attention_bwd = (n for n in parsed.nodes if n.op is not OpKind.INPUT)
    assert attention.attrs == rlx.ir.AttentionAttrs(MaskKind.NONE, Layout.BSHD)
    assert attention_bwd.attrs.wrt == Wrt.ALL
    assert attention_bwd.attrs.mask == MaskKind.NONE


def test_round_trip_of_ops_from_mask_input_and_sliding_window_in_bwd() -> None:
    g = Graph("g")
    q = g.input("q", (1, 2, 1, 2))
    pad = g.input("pad", (1, 2))
    for mask in (MaskKind.NONE, MaskKind.CAUSAL, MaskKind.sliding_window(0), MaskKind.sliding_window(17)):
        g.attention_bwd(q, q, q, q, wrt=Wrt.KEY, mask=mask)
    g.attention_bwd(q, q, q, q, wrt=Wrt.QUERY | Wrt.VALUE, mask=MaskKind.CUSTOM, mask_input=pad)
    assert str(parse(str(g))) == str(g)


@dataclasses.dataclass(frozen=True)
class _RichAttrs:
    """Stand-in for the attrs class of a future op: one field of every kind the parser converts."""

    count: int
    scale: float
    label: str
    flag: bool
    wrt: Wrt
    mask: MaskKind = MaskKind.NONE
    layout: Layout = Layout.BSHD
    window: int | None = None


def _same_as_first(what: str, inputs: Sequence[TensorType], attrs: object) -> tuple[TensorType, ...]:
    return (inputs[0],)


def test_new_attrs_class_parses_without_parser_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Attribute values are read by the dataclass field's type, so new ops need no parser work."""
    monkeypatch.setitem(
        REGISTRY,
        "attention",
        dataclasses.replace(REGISTRY["attention"], attrs=_RichAttrs, infer=_same_as_first, operands=("x",)),
    )
    g = Graph("future")
    x = g.input("x", (3,))
    for attrs in (
        _RichAttrs(-3, 1e-09, "tag.x", True, Wrt.KEY | Wrt.VALUE, MaskKind.sliding_window(2), Layout.BHSD, 5),
        _RichAttrs(0, float("-inf"), "y", False, Wrt.ALL),
        _RichAttrs(12, 0.5, "z", True, Wrt.QUERY, MaskKind.BIAS, window=None),
    ):
        g.add_node(OpKind.ATTENTION, [x], attrs)
    text = str(g)
    assert 'count = -3, scale = 1e-09, label = "tag.x", flag = True, wrt = k|v' in text
    parsed = parse(text)
    assert [n.attrs for n in parsed.nodes[1:]] == [n.attrs for n in g.nodes[1:]]
    assert str(parsed) == text


@dataclasses.dataclass(frozen=True)
class _TextAttrs:
    """Stand-in for a future op with free-text attributes."""

    label: str
    note: str | None = None


TRICKY_STRINGS = [
    "two words",
    "a, b, c",
    'say "hi"',
    'back\\slash \\" mixed',
    "{braces} = [brackets] (parens) : colon | bar",
    "%not_a_value @not_a_symbol // not a comment",
    "line\nbreak\ttab\rreturn",
    "caf\u00e9 \u2192 \U0001f600",
    "",
    " ",
    "None",
    "True",
    "\x00\x1f\x7f",
]


@pytest.mark.parametrize("label", TRICKY_STRINGS, ids=range(len(TRICKY_STRINGS)))
def test_str_attrs_are_quoted_and_round_trip(monkeypatch: pytest.MonkeyPatch, label: str) -> None:
    """Regression: str attribute values were printed bare, so spaces, commas or quotes broke parsing."""
    monkeypatch.setitem(
        REGISTRY,
        "attention",
        dataclasses.replace(REGISTRY["attention"], attrs=_TextAttrs, infer=_same_as_first, operands=("x",)),
    )
    g = Graph("text")
    x = g.input("x", (3,))
    g.add_node(OpKind.ATTENTION, [x], _TextAttrs(label))
    g.add_node(OpKind.ATTENTION, [x], _TextAttrs("plain", note=label))
    text = str(g)
    assert len(text.splitlines()) == 5, "a string never spans lines"
    assert text.isascii()
    assert f"{{label = {json.dumps(label)}, note = None}}" in text
    assert f'{{label = "plain", note = {json.dumps(label)}}}' in text
    parsed = parse(text)
    assert [n.attrs for n in parsed.nodes[1:]] == [_TextAttrs(label), _TextAttrs("plain", note=label)]
    assert str(parsed) == text


def test_str_attrs_read_bare_names_and_json_escapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hand-written text may leave a simple name unquoted; quoted strings use JSON escapes."""
    monkeypatch.setitem(
        REGISTRY,
        "attention",
        dataclasses.replace(REGISTRY["attention"], attrs=_TextAttrs, infer=_same_as_first, operands=("x",)),
    )
    head = 'graph @g {\n  %x = input "x" : f32[3]\n'
    parsed = parse(head + '  %0 = attention %x {label = tag.x, note = "a\\tb \\"c\\" \\u00e9\\/"} : f32[3]\n}')
    assert parsed.nodes[1].attrs == _TextAttrs("tag.x", note='a\tb "c" \u00e9/')
    with pytest.raises(rlx.RlxValueError, match=r"^line 3, column 40: bad escape in string \"a\\qb\"; expected"):
        parse(head + '  %0 = attention %x {label = x, note = "a\\qb"} : f32[3]\n}')
    with pytest.raises(rlx.RlxValueError, match=r"attribute 'label' of attention must be a str, got '3'"):
        parse(head + "  %0 = attention %x {label = 3} : f32[3]\n}")


def test_new_attrs_class_reports_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        REGISTRY,
        "attention",
        dataclasses.replace(REGISTRY["attention"], attrs=_RichAttrs, infer=_same_as_first, operands=("x",)),
    )
    text = (
        'graph @g {\n  %x = input "x" : f32[3]\n'
        "  %0 = attention %x {count = 1.5, scale = 1.0, label = a, flag = True, wrt = q} : f32[3]\n}"
    )
    with pytest.raises(rlx.RlxValueError, match=r"line 3, column \d+: attribute 'count' of attention must be an int"):
        parse(text)
    with pytest.raises(rlx.RlxValueError, match=r"line 3, column \d+: attribute 'flag' of attention must be a bool"):
        parse(text.replace("count = 1.5", "count = 1").replace("True", "yes"))
    with pytest.raises(rlx.RlxValueError, match=r"line 3, column \d+: attention needs attribute\(s\) label"):
        parse(text.replace("count = 1.5", "count = 1").replace("label = a, ", ""))


# ----------------------------------------------------------------------------- parse errors

BASE = """\
graph @g {
  %q = input "q" : f32[1,4,2,8]
  %k = input "k" : f32[1,3,2,8]
  %v = input "v" : f32[1,3,2,8]
  %0 = attention %q, %k, %v {mask = causal, layout = bshd} : f32[1,4,2,8]
  output o = %0
}"""


def test_base_text_parses() -> None:
    """The error cases below edit this text; it must be valid to begin with."""
    assert str(parse(BASE)) == BASE


PARSE_ERRORS = [
    # (old, new, line, message fragment)
    ("graph @g {", "grph @g {", 1, "expected 'graph'"),
    ("graph @g {", "graph g {", 1, "expected the graph name as '@name'"),
    ("graph @g {", "graph @g", 1, "expected '{' after the graph name"),
    ("graph @g {", "graph @class {", 1, "graph name must be an identifier"),
    ("attention %q", "attentoin %q", 5, "unknown op 'attentoin'; expected one of input, attention, attention_bwd"),
    ("%k, %v {", "%k, %kk {", 5, "unknown value %kk"),
    ("output o = %0", "output o = %7", 6, "unknown value %7"),
    ("%0 = attention", "%k = attention", 5, "%k is already defined on line 3"),
    ('%v = input "v"', '%q = input "v"', 4, "%q is already defined on line 2"),
    ('%v = input "v"', '%v = input "k"', 4, "already has an input named 'k'"),
    ('input "q" : f32[1,4,2,8]', 'input "q" : f33[1,4,2,8]', 2, "expected a dtype (f32, f64"),
    ('input "q" : f32[1,4,2,8]', 'input "q" : f32[1,4,0,8]', 2, "expected a dimension (a positive int), got '0'"),
    ('input "q" : f32[1,4,2,8]', 'input "q" : f32[1,4,2.5,8]', 2, "expected a dimension (a positive int)"),
    ('input "q" : f32[1,4,2,8]', 'input "q" : f32[1,4,2,8', 2, "expected ']' closing the shape"),
    ('input "q" : f32[1,4,2,8]', 'input "q" f32[1,4,2,8]', 2, "expected ':' before the input's type"),
    ('input "q"', "input q", 2, "expected the input name as a quoted string"),
    ('input "q"', 'input "q', 2, "unterminated string"),
    ('input "q"', 'input "9q"', 2, "input name must be an identifier"),
    ('%q = input "q"', '%q, %r = input "q"', 2, "an input has one result, but the line names 2"),
    ("mask = causal", "mask = casual", 5, "attribute 'mask' of attention must be a MaskKind, got 'casual'"),
    ("mask = causal", "mask = sliding_window(-2)", 5, "window must be >= 0"),
    ("mask = causal", "mask = sliding_window", 5, "sliding_window mask needs a window"),
    ("mask = causal", "mask = sliding_window(2.5)", 5, "bad sliding_window mask"),
    ("layout = bshd", "layout = bsdh", 5, "attribute 'layout' of attention must be a Layout (bshd or bhsd)"),
    ("layout = bshd", "lay = bshd", 5, "attention has no attribute 'lay'; expected mask, layout"),
    ("layout = bshd}", "layout = bshd, wrt = q}", 5, "attention has no attribute 'wrt'"),
    ("layout = bshd}", "layout = bshd, layout = bhsd}", 5, "attribute 'layout' is given twice"),
    ("layout = bshd}", "layout = }", 5, "expected a value for attribute 'layout'"),
    ("layout = bshd}", "layout = bshd", 5, "attribute 'layout' to end with ',' or '}'"),
    ("%0 = attention", "%0 = attention_bwd", 5, "attention_bwd needs attribute(s) wrt"),
    ("mask = causal", "wrt = q, mask = causal", 5, "attention has no attribute 'wrt'"),
    # the builder's shape checks apply to parsed text, reported at the op
    ('%k = input "k" : f32[1,3,2,8]', '%k = input "k" : f32[1,3,4,8]', 5, "attention (node 3): k must have batch 1"),
    ('%v = input "v" : f32[1,3,2,8]', '%v = input "v" : f32[1,2,2,8]', 5, "v must be f32[1, 3, 2, 8]"),
    ('%v = input "v" : f32[1,3,2,8]', '%v = input "v" : f64[1,3,2,8]', 5, "v must be f32, got f64"),
    ("%v {mask = causal", "%v, %q {mask = causal", 5, "mask causal takes no mask_input tensor"),
    ("mask = causal", "mask = custom", 5, "mask custom needs a mask_input tensor"),
    ("mask = causal", "mask = bias", 5, "mask bias needs a mask_input tensor"),
    # result names and type annotations must match what the op gives
    ("} : f32[1,4,2,8]", "} : f32[1,4,2,9]", 5, "%0 is annotated f32[1,4,2,9], but attention gives f32[1,4,2,8]"),
    ("} : f32[1,4,2,8]", "} : f32[1,4,2,8], f32[1,4,2,8]", 5, "but the line annotates 2 type(s)"),
    ("%0 = attention", "%0, %1 = attention", 5, "attention gives 1 result(s) (f32[1,4,2,8]), but the line names 2"),
    ("%0 = attention", "%0, %0 = attention", 5, "%0 is already defined on line 5"),
    ("} : f32[1,4,2,8]", "}", 5, "expected ':' before the result types"),
    # outputs
    ("output o = %0", "output o = %0, o = %q", 6, "already has an output named 'o'"),
    ("output o = %0", "output o %0", 6, "expected '=' after output name 'o'"),
    ("output o = %0", "output = %0", 6, "expected an output name"),
    ("output o = %0", "output class = %0", 6, "output name must be an identifier"),
    ("output o = %0", "output o = %0 junk", 6, "expected end of line, got 'junk'"),
    # structure and characters
    ("  output o = %0", "  $output o = %0", 6, "unexpected character '$'"),
    ("  output o = %0", "  o = %0", 6, "expected a statement"),
    ("  output o = %0", "  % = %0", 6, "expected a name after '%'"),
    ("\n}", "\n}\n%x", 8, "expected nothing after the closing '}'"),
    ("\n}", "", 7, "expected '}' closing graph @g, got end of text"),
]


@pytest.mark.parametrize(("old", "new", "line", "fragment"), PARSE_ERRORS, ids=[c[3][:40] for c in PARSE_ERRORS])
def test_parse_error_names_line_and_expectation(old: str, new: str, line: int, fragment: str) -> None:
    assert old in BASE
    text = BASE.replace(old, new, 1)
    with pytest.raises(rlx.RlxValueError) as info:
        parse(text)
    message = str(info.value)
    assert isinstance(info.value, rlx.RlxError) and isinstance(info.value, ValueError)
    assert message.startswith(f"line {line}, column "), message
    assert fragment in message, message


def test_parse_error_points_at_the_column() -> None:
    with pytest.raises(rlx.RlxValueError, match=r"^line 5, column 26: unknown value %kk"):
        parse(BASE.replace("%k, %v {", "%k, %kk {"))


@pytest.mark.parametrize("text", ["", "\n\n  \n", "// only a comment"])
def test_empty_text_is_an_error(text: str) -> None:
    with pytest.raises(rlx.RlxValueError, match=r"^line 1, column 1: expected 'graph @name \{'"):
        parse(text)


def test_parse_rejects_non_str() -> None:
    with pytest.raises(rlx.RlxTypeError, match="expected the IR text as a str, got bytes"):
        parse(BASE.encode())  # type: ignore[arg-type]


def test_parse_is_reachable_as_rlx_parse_and_graph_parse() -> None:
    """The parser under the names a user tries first; all three read the same text the same way."""
    g = Graph("names")
    x = g.input("x", (2, "S"))
    g.output(y=g.softmax(x * 2.0, axis=-1))
    text = str(g)
    assert str(rlx.parse(text)) == str(Graph.parse(text)) == str(rlx.ir.parse(text)) == text
