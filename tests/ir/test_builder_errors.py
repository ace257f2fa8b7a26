"""Every bad graph-building call SPEC section 2 names raises an RlxError that is also the right
builtin, with a message naming the node or operand and what was expected."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

import rlx
from rlx import Graph, Layout, MaskKind, OpKind, TensorType, Value, Wrt
from rlx.ir import AttentionAttrs, AttentionBwdAttrs, InputAttrs

B, SQ, SK, H, D = 2, 5, 3, 2, 4


@dataclass
class Env:
    """A graph with well-formed operands, plus a few broken ones, for one bad call each."""

    g: Graph
    q: Value
    k: Value
    v: Value
    dy: Value
    pad: Value
    bias: Value


@pytest.fixture
def env() -> Env:
    g = Graph("build")
    q = g.input("q", (B, SQ, H, D))
    k = g.input("k", (B, SK, H, D))
    v = g.input("v", (B, SK, H, D))
    dy = g.input("dy", (B, SQ, H, D))
    pad = g.input("pad", (B, SK))
    bias = g.input("bias", (B, H, SQ, SK))
    return Env(g, q, k, v, dy, pad, bias)


def _in(e: Env, shape: tuple[int, ...], dtype: str = "float32") -> Value:
    """A fresh input of the given shape, for an operand that is wrong on purpose."""
    return e.g.input(f"bad{len(e.g)}", shape, dtype=dtype)


def _other_graph_value() -> Value:
    other = Graph("other")
    return other.input("q", (B, SQ, H, D))


Case = Callable[[Env], object]
NODE = r"\(node \d+\)"  # messages name the node being built

CASES: list[tuple[str, Case, type[Exception], str]] = [
    # --- wrong rank of q / k / v / dy
    (
        "q rank 3",
        lambda e: e.g.attention(_in(e, (B, SQ, H)), e.k, e.v),
        ValueError,
        rf"attention {NODE}: q must have rank 4 \(\[B, S, H, D\]\), got f32\[2,5,2\]",
    ),
    (
        "k rank 5",
        lambda e: e.g.attention(e.q, _in(e, (B, SK, H, D, 1)), e.v),
        ValueError,
        rf"attention {NODE}: k must have rank 4",
    ),
    ("v rank 2", lambda e: e.g.attention(e.q, e.k, _in(e, (B, SK))), ValueError, "v must have rank 4"),
    (
        "dy rank 3",
        lambda e: e.g.attention_bwd(e.q, e.k, e.v, _in(e, (B, SQ, H)), wrt=Wrt.QUERY),
        ValueError,
        rf"attention_bwd {NODE}: dy must have rank 4",
    ),
    # --- wrong sizes; k/v mismatch
    (
        "k heads",
        lambda e: e.g.attention(e.q, _in(e, (B, SK, H + 1, D)), e.v),
        ValueError,
        r"k must have batch 2, heads 2 and head_dim 4 like q f32\[2,5,2,4\]",
    ),
    ("k batch", lambda e: e.g.attention(e.q, _in(e, (B + 1, SK, H, D)), e.v), ValueError, "k must have batch 2"),
    ("k head_dim", lambda e: e.g.attention(e.q, _in(e, (B, SK, H, D + 1)), e.v), ValueError, "head_dim 4"),
    (
        "k/v seq mismatch",
        lambda e: e.g.attention(e.q, e.k, _in(e, (B, SK + 1, H, D))),
        ValueError,
        r"v must be f32\[2, 3, 2, 4\] to match q",
    ),
    (
        "dy size",
        lambda e: e.g.attention_bwd(e.q, e.k, e.v, e.k, wrt=Wrt.KEY),
        ValueError,
        r"dy must be f32\[2, 5, 2, 4\] \(the shape of the output\)",
    ),
    (
        "BSHD operands read as BHSD",
        lambda e: e.g.attention(e.q, e.k, e.v, layout=Layout.BHSD),
        ValueError,
        r"k must have batch 2, heads 5 .*layout bhsd",
    ),
    # --- mask tensors
    (
        "custom mask_input shape",
        lambda e: e.g.attention(e.q, e.k, e.v, mask=MaskKind.CUSTOM, mask_input=_in(e, (B, SQ))),
        ValueError,
        r"mask_input for mask custom must be f32\[2, 3\] \(\[B, Sk\] key padding\), got f32\[2,5\]",
    ),
    (
        "bias mask_input shape",
        lambda e: e.g.attention(e.q, e.k, e.v, mask=MaskKind.BIAS, mask_input=e.pad),
        ValueError,
        r"mask_input for mask bias must be f32\[2, 2, 5, 3\]",
    ),
    (
        "bwd custom mask_input shape",
        lambda e: e.g.attention_bwd(e.q, e.k, e.v, e.dy, mask=MaskKind.CUSTOM, mask_input=e.bias),
        ValueError,
        r"attention_bwd \(node \d+\): mask_input for mask custom must be",
    ),
    (
        "missing custom mask_input",
        lambda e: e.g.attention(e.q, e.k, e.v, mask=MaskKind.CUSTOM),
        ValueError,
        rf"attention {NODE}: mask custom needs a mask_input tensor",
    ),
    (
        "missing bias mask_input",
        lambda e: e.g.attention_bwd(e.q, e.k, e.v, e.dy, mask=MaskKind.BIAS),
        ValueError,
        rf"attention_bwd {NODE}: mask bias needs a mask_input tensor",
    ),
    (
        "extra mask_input with none",
        lambda e: e.g.attention(e.q, e.k, e.v, mask_input=e.pad),
        ValueError,
        r"mask none takes no mask_input tensor \(only custom and bias do\)",
    ),
    (
        "extra mask_input with causal",
        lambda e: e.g.attention_bwd(e.q, e.k, e.v, e.dy, mask=MaskKind.CAUSAL, mask_input=e.bias),
        ValueError,
        "mask causal takes no mask_input",
    ),
    (
        "extra mask_input with window",
        lambda e: e.g.attention(e.q, e.k, e.v, mask=MaskKind.sliding_window(2), mask_input=e.pad),
        ValueError,
        r"mask sliding_window\(2\) takes no mask_input",
    ),
    # --- sliding windows
    ("negative window", lambda e: MaskKind.sliding_window(-1), ValueError, "window must be >= 0, got -1"),
    ("float window", lambda e: MaskKind.sliding_window(2.0), TypeError, "window must be an int, got float"),
    ("str window", lambda e: MaskKind.sliding_window("2"), TypeError, "window must be an int, got str"),
    ("bool window", lambda e: MaskKind.sliding_window(True), TypeError, "window must be an int, got bool"),
    # the constructor validates too: a bad mask never gets as far as printing or verify
    ("ctor negative window", lambda e: MaskKind("sliding_window", -1), ValueError, "window must be >= 0, got -1"),
    ("ctor float window", lambda e: MaskKind("sliding_window", 1.5), TypeError, "window must be an int, got float"),
    ("ctor bool window", lambda e: MaskKind("sliding_window", False), TypeError, "window must be an int, got bool"),
    ("ctor missing window", lambda e: MaskKind("sliding_window"), ValueError, "sliding_window mask needs a window"),
    ("ctor window on causal", lambda e: MaskKind("causal", 2), ValueError, "only a sliding_window mask carries"),
    ("ctor unknown kind", lambda e: MaskKind("diagonal"), ValueError, "unknown mask kind 'diagonal'; expected one"),
    ("ctor kind not a str", lambda e: MaskKind(3), TypeError, "MaskKind: kind must be a str, got int"),
    # TensorType: shape entries are ints >= 1, dtype one of the supported ones
    ("type zero dim", lambda e: TensorType((2, 0)), ValueError, r"TensorType: every dimension must be >= 1"),
    ("type negative dim", lambda e: TensorType((-1,)), ValueError, r"got shape \(-1,\)"),
    ("type float dim", lambda e: TensorType((2, 3.0)), TypeError, "TensorType: shape entries must be ints, got 3.0"),
    ("type bool dim", lambda e: TensorType((True,)), TypeError, "TensorType: shape entries must be ints"),
    ("type str dim not a name", lambda e: TensorType((2, "a b")), ValueError, "must be an identifier like 'Sk'"),
    ("type shape an int", lambda e: TensorType(3), TypeError, "TensorType: shape must be a tuple of ints, got int"),
    ("type unknown dtype", lambda e: TensorType((1,), "float31"), TypeError, "not a dtype: 'float31'"),
    ("type unsupported dtype", lambda e: TensorType((1,), "complex64"), TypeError, "unsupported dtype complex64"),
    ("type dtype None", lambda e: TensorType((1,), None), TypeError, "not a dtype: None"),
    # --- argument types
    (
        "wrt an int",
        lambda e: e.g.attention_bwd(e.q, e.k, e.v, e.dy, wrt=1),
        TypeError,
        "attention_bwd: wrt must be an rlx.Wrt flag, got int",
    ),
    (
        "wrt a str",
        lambda e: e.g.attention_bwd(e.q, e.k, e.v, e.dy, wrt="q"),
        TypeError,
        "wrt must be an rlx.Wrt flag, got str",
    ),
    (
        "empty wrt",
        lambda e: e.g.attention_bwd(e.q, e.k, e.v, e.dy, wrt=Wrt(0)),
        ValueError,
        "wrt must name at least one of Wrt.QUERY, Wrt.KEY, Wrt.VALUE",
    ),
    (
        "mask a str",
        lambda e: e.g.attention(e.q, e.k, e.v, mask="causal"),
        TypeError,
        "attention: mask must be an rlx.MaskKind, got str",
    ),
    (
        "mask tensor passed as mask",
        lambda e: e.g.attention(e.q, e.k, e.v, e.pad),
        TypeError,
        "mask must be an rlx.MaskKind, got Value",
    ),
    (
        "bwd mask a str",
        lambda e: e.g.attention_bwd(e.q, e.k, e.v, e.dy, mask="none"),
        TypeError,
        "attention_bwd: mask must be an rlx.MaskKind",
    ),
    (
        "layout a str",
        lambda e: e.g.attention(e.q, e.k, e.v, layout="bshd"),
        TypeError,
        "attention: layout must be an rlx.Layout, got str",
    ),
    (
        "bwd layout a str",
        lambda e: e.g.attention_bwd(e.q, e.k, e.v, e.dy, layout="bhsd"),
        TypeError,
        "attention_bwd: layout must be an rlx.Layout",
    ),
    (
        "q an array",
        lambda e: e.g.attention(np.zeros((B, SQ, H, D), np.float32), e.k, e.v),
        TypeError,
        rf"attention {NODE} operand 0 must be an rlx Value .*got ndarray",
    ),
    (
        "v a Node",
        lambda e: e.g.attention(e.q, e.k, e.v.node),
        TypeError,
        rf"attention {NODE} operand 2 must be an rlx Value .*got Node",
    ),
    (
        "dy None",
        lambda e: e.g.attention_bwd(e.q, e.k, e.v, None),
        TypeError,
        rf"attention_bwd {NODE} operand 3 must be an rlx Value",
    ),
    (
        "mask_input a str",
        lambda e: e.g.attention(e.q, e.k, e.v, mask=MaskKind.CUSTOM, mask_input="pad"),
        TypeError,
        rf"attention {NODE} operand 3 must be an rlx Value",
    ),
    # --- dtypes
    (
        "f64 q",
        lambda e: e.g.attention(_in(e, (B, SQ, H, D), "float64"), e.k, e.v),
        TypeError,
        rf"attention {NODE}: q must be f32, got f64",
    ),
    (
        "i32 k",
        lambda e: e.g.attention(e.q, _in(e, (B, SK, H, D), "int32"), e.v),
        TypeError,
        "k must be f32, got i32",
    ),
    (
        "f16 dy",
        lambda e: e.g.attention_bwd(e.q, e.k, e.v, _in(e, (B, SQ, H, D), "float16"), wrt=Wrt.VALUE),
        TypeError,
        rf"attention_bwd {NODE}: dy must be f32, got f16",
    ),
    (
        "f64 mask_input",
        lambda e: e.g.attention(e.q, e.k, e.v, mask=MaskKind.CUSTOM, mask_input=_in(e, (B, SK), "float64")),
        TypeError,
        "mask_input must be f32, got f64",
    ),
    # --- graph inputs
    ("duplicate input", lambda e: e.g.input("q", (1,)), ValueError, "graph 'build' already has an input named 'q'"),
    ("shape with a float", lambda e: e.g.input("x", (2, 3.0)), TypeError, r"input 'x': shape entries must be ints"),
    ("shape a str", lambda e: e.g.input("x", "23"), TypeError, "input 'x': shape must be a tuple of ints, got str"),
    ("shape None", lambda e: e.g.input("x", None), TypeError, "shape must be a tuple of ints, got NoneType"),
    ("shape with a bool", lambda e: e.g.input("x", (True, 2)), TypeError, "shape entries must be ints"),
    ("zero dim", lambda e: e.g.input("x", (2, 0)), ValueError, r"input 'x': every dimension must be >= 1"),
    (
        "negative dim",
        lambda e: e.g.input("x", (-1, 4)),
        ValueError,
        r"every dimension must be >= 1, got shape \(-1, 4\)",
    ),
    ("name not an identifier", lambda e: e.g.input("1x", (1,)), ValueError, "input name must be an identifier"),
    ("name a keyword", lambda e: e.g.input("lambda", (1,)), ValueError, "input name must be an identifier"),
    ("name not a str", lambda e: e.g.input(3, (1,)), TypeError, "input name must be a str, got int"),
    ("unknown dtype", lambda e: e.g.input("x", (1,), dtype="float31"), TypeError, "not a dtype: 'float31'"),
    ("unsupported dtype", lambda e: e.g.input("x", (1,), dtype="complex64"), TypeError, "unsupported dtype complex64"),
    ("dtype None", lambda e: e.g.input("x", (1,), dtype=None), TypeError, "not a dtype: None"),
    ("dtype not understood", lambda e: e.g.input("x", (1,), dtype="f4 junk"), TypeError, "not a dtype: .f4 junk."),
    ("shape a 0-d array", lambda e: e.g.input("x", np.array(3)), TypeError, "shape must be a tuple of ints"),
    ("graph name", lambda e: Graph("my graph"), ValueError, "graph name must be an identifier"),
    # --- values from elsewhere
    (
        "value of another graph",
        lambda e: e.g.attention(_other_graph_value(), e.k, e.v),
        ValueError,
        rf"attention {NODE} operand 0 belongs to graph 'other', not to graph 'build'",
    ),
    (
        "output of another graph",
        lambda e: e.g.output(o=_other_graph_value()),
        ValueError,
        "output 'o' belongs to graph 'other'",
    ),
    ("output not a Value", lambda e: e.g.output(o=3), TypeError, "output 'o' must be an rlx Value"),
    (
        "duplicate output",
        lambda e: (e.g.output(o=e.q), e.g.output(o=e.k)),
        ValueError,
        "graph 'build' already has an output named 'o'",
    ),
    ("unknown output removed", lambda e: e.g.remove_output("nope"), KeyError, "has no output named 'nope'"),
    ("output removed by a non-str", lambda e: e.g.remove_output(0), TypeError, "output name must be a str, got int"),
    ("unknown node id", lambda e: e.g.node(99), KeyError, "graph 'build' has no node 99"),
    ("node id not an int", lambda e: e.g.node([1]), TypeError, "graph 'build': a node id is an int, got list"),
    # --- the generic builder add_node (used by passes and the parser)
    (
        "add_node attrs of another op",
        lambda e: e.g.add_node(OpKind.ATTENTION, [e.q, e.k, e.v], AttentionBwdAttrs(Wrt.QUERY)),
        TypeError,
        r"add_node: attention \(node 6\): attrs must be AttentionAttrs, got AttentionBwdAttrs",
    ),
    (
        "add_node attrs None",
        lambda e: e.g.add_node(OpKind.ATTENTION_BWD, [e.q, e.k, e.v, e.dy], None),
        TypeError,
        r"add_node: attention_bwd \(node 6\): attrs must be AttentionBwdAttrs, got NoneType",
    ),
    (
        "add_node of an input",
        lambda e: e.g.add_node(OpKind.INPUT, [], InputAttrs("x")),
        ValueError,
        r"add_node: input \(node 6\): declare graph inputs with Graph.input",
    ),
    (
        "add_node op a str",
        lambda e: e.g.add_node("attention", [], AttentionAttrs()),
        TypeError,
        "op must be an rlx.OpKind",
    ),
    (
        "add_node one Value as inputs",
        lambda e: e.g.add_node(OpKind.ATTENTION, e.q, AttentionAttrs()),
        TypeError,
        r"attention \(node 6\): inputs must be a sequence of Values, got Value",
    ),
    (
        "add_node too few inputs",
        lambda e: e.g.add_node(OpKind.ATTENTION, (e.q, e.k), AttentionAttrs()),
        ValueError,
        r"attention \(node 6\): attention takes operands \(q, k, v, mask_input\?\), got 2",
    ),
    # --- hand-made Values and bad arguments of the query methods
    (
        "value with a str index",
        lambda e: e.g.attention(Value(e.q.node, "0"), e.k, e.v),
        TypeError,
        r"operand 0: a Value's index must be an int, got str",
    ),
    (
        "value past the last output",
        lambda e: e.g.attention(Value(e.q.node, 1), e.k, e.v),
        ValueError,
        r"operand 0: node 0 has no output 1",
    ),
    ("value of a non-node", lambda e: e.g.output(o=Value(3, 0)), TypeError, "output 'o' must be an rlx Value"),
    ("uses of a Node", lambda e: e.g.uses(e.q.node), TypeError, "uses: value must be an rlx Value"),
    ("users of a Value", lambda e: e.g.users(e.q), TypeError, "expected an rlx Node, got Value"),
    ("set_input of a Value", lambda e: e.g.set_input(e.q, 0, e.k), TypeError, "expected an rlx Node, got Value"),
    ("erase a Value", lambda e: e.g.erase(e.q), TypeError, "expected an rlx Node, got Value"),
    # --- text helpers and layouts
    ("MaskKind.parse of None", lambda e: MaskKind.parse(None), TypeError, "MaskKind.parse: expected a str, got None"),
    ("Wrt.parse of a flag", lambda e: Wrt.parse(Wrt.KEY), TypeError, "Wrt.parse: expected a str, got Wrt"),
    ("layout split rank 3", lambda e: Layout.BHSD.split((1, 2, 3)), ValueError, r"layout bhsd needs a rank-4 shape"),
]


@pytest.mark.parametrize(("label", "call", "builtin", "fragment"), CASES, ids=[c[0] for c in CASES])
def test_bad_build_call(env: Env, label: str, call: Case, builtin: type[Exception], fragment: str) -> None:
    before = str(env.g)
    with pytest.raises(rlx.RlxError, match=fragment) as info:
        call(env)
    assert isinstance(info.value, builtin), f"{label}: {type(info.value).__mro__}"
    env.g.verify()
    if label not in ("duplicate output",):
        assert str(env.g).count(" = attention") == before.count(" = attention"), "a failed call added a node"


def test_value_of_an_erased_node(env: Env) -> None:
    out = env.g.attention(env.q, env.k, env.v)
    env.g.erase(out.node)
    with pytest.raises(rlx.RlxValueError, match=r"operand 0 is an output of node \d+, which was erased"):
        env.g.attention(out, env.k, env.v)


def test_custom_mask_forward_accepts_key_padding(env: Env) -> None:
    """Regression: the rank-4 check once covered the [B, Sk] mask tensor of a forward node."""
    out = env.g.attention(env.q, env.k, env.v, mask=MaskKind.CUSTOM, mask_input=env.pad)
    assert out.shape == env.q.shape


def test_errors_are_catchable_as_plain_builtins(env: Env) -> None:
    """``except ValueError`` / ``except TypeError`` keep working for users who do not know rlx."""
    with pytest.raises(ValueError):
        env.g.attention(env.q, env.k, env.v, mask=MaskKind.CUSTOM)
    with pytest.raises(TypeError):
        env.g.attention(env.q, env.k, env.v, layout="bshd")
    with pytest.raises(KeyError):
        env.g.remove_output("missing")
