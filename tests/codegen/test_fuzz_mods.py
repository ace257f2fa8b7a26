"""Property: random score_mod / mask_mod expressions compile to what the reference computes.

Each example draws expression trees over every operation a mod may use (arithmetic on the score
and on the integer indices, ``//``, ``%``, ``**``, comparisons, ``& | ~``, ``rlx.where`` and the
unary functions, reads of a learnable bias by the symbols, reads of int inputs and of a learnable
table at their entries: ``table[segq[b, i], segk[b, j]]``) and random shapes (GQA, ``Dv != D``,
``Sq != Sk``, long enough for several tiles so that block sparsity is exercised). The forward
(``out``, ``lse``) and every gradient (q, k, v and the bias) must equal the float64 reference.
Written after an integer negation inside a mod (``-(h + 1)``) emitted an LLVM ``fneg`` on an
``i64`` and failed to compile: no hand-written case had negated an index.

The float expressions stay well conditioned (division by ``1 + |x|``, ``exp(-|x|)``,
``log(1 + |x|)``, the score soft-capped at the end, float comparisons away from ties: see
``FCMP_OFFSETS``), so that float32 against float64 differs by rounding only and a mismatch is a
bug.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from codegen_helpers import assert_close
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rlx
from rlx import Graph, Layout

Tree = tuple[Any, ...]

INT_LEAVES = st.one_of(
    st.sampled_from([("b",), ("h",), ("i",), ("j",), ("seg_q",), ("seg_k",)]),  # seg_*: entries of int inputs
    st.integers(-3, 5).map(lambda n: ("int", n)),
)


def _int_node(children: st.SearchStrategy[Tree]) -> st.SearchStrategy[Tree]:
    ops = ["add", "sub", "mul", "floordiv", "mod", "minimum", "maximum"]
    binary = st.tuples(st.sampled_from(ops), children, children)
    unary = st.tuples(st.sampled_from(["neg", "abs", "square"]), children)
    return st.one_of(binary, unary)


INT_EXPR = st.recursive(INT_LEAVES, _int_node, max_leaves=5)

COMPARE = st.sampled_from(["lt", "le", "gt", "ge", "eq", "ne"])


def _bool_node(children: st.SearchStrategy[Tree]) -> st.SearchStrategy[Tree]:
    return st.one_of(
        st.tuples(st.sampled_from(["and", "or"]), children, children),
        st.tuples(st.just("not"), children),
    )


INT_BOOL = st.recursive(st.tuples(st.just("cmp"), COMPARE, INT_EXPR, INT_EXPR), _bool_node, max_leaves=3)

FLOAT_LEAVES = st.one_of(
    st.just(("score",)),
    st.just(("score",)),
    st.just(("bias",)),
    st.just(("entry_bias",)),  # a table read at the entries of two int inputs, checked per call
    st.floats(-2.0, 2.0, allow_nan=False, width=32).map(lambda x: ("float", x)),
    INT_EXPR.map(lambda tree: ("scaled", tree)),  # an index expression times 0.25: ints join floats
)


def _float_node(children: st.SearchStrategy[Tree]) -> st.SearchStrategy[Tree]:
    return st.one_of(
        st.tuples(st.sampled_from(["add", "sub", "mul", "minimum", "maximum", "safe_div"]), children, children),
        st.tuples(
            st.sampled_from(["neg", "abs", "tanh", "sigmoid", "exp_neg_abs", "log1p_abs", "hypot1", "square"]),
            children,
        ),
        st.tuples(st.just("where"), st.one_of(INT_BOOL, st.tuples(st.just("fcmp"), COMPARE, children, children,
                                                                  FCMP_OFFSETS)),
                  children, children),
    )


# A float comparison tests ``x OP y + offset``. Two sides that agree to float32 precision over a
# whole range (``score`` against ``tanh(score)``: equal in float32 for |score| < 4e-4, not in
# float64) would take different branches in the kernel and in the float64 reference, whose
# gradients then differ by design, not by a bug; an offset away from 0 makes such a tie a
# crossing, which random data does not hit.
FCMP_OFFSETS = st.sampled_from([-1.0, -0.5, 0.5, 1.0])
FLOAT_EXPR = st.recursive(FLOAT_LEAVES, _float_node, max_leaves=6)


def evaluate(tree: Tree, env: dict[str, Any]) -> Any:
    """Build ``tree`` with the Sym operators (the same code a user's mod runs)."""
    op, *args = tree
    if op in ("b", "h", "i", "j", "score"):
        return env[op]
    if op == "int":  # symbolic, so that a tree of constants is traced too, not folded by Python
        return env["b"] * 0 + args[0]
    if op == "float":
        return args[0]
    if op == "bias":
        return env["bias"][env["h"], env["i"], env["j"]]
    if op == "seg_q":
        return env["segq"][env["b"], env["i"]]
    if op == "seg_k":
        return env["segk"][env["b"], env["j"]]
    if op == "entry_bias":
        return env["table"][env["segq"][env["b"], env["i"]], env["segk"][env["b"], env["j"]]]
    if op == "scaled":
        return evaluate(args[0], env) * 0.25
    if op == "cmp" or op == "fcmp":
        kind, a, b, *offset = args
        x, y = evaluate(a, env), evaluate(b, env)
        if offset:
            y = y + offset[0]
        return {"lt": x < y, "le": x <= y, "gt": x > y, "ge": x >= y, "eq": x == y, "ne": x != y}[kind]
    if op == "where":
        return rlx.where(evaluate(args[0], env), evaluate(args[1], env), evaluate(args[2], env))
    values = [evaluate(a, env) for a in args]
    unary = {
        "neg": lambda x: -x,
        "abs": lambda x: abs(x),
        "square": lambda x: x**2,
        "not": lambda x: ~x,
        "tanh": rlx.tanh,
        "sigmoid": rlx.sigmoid,
        "exp_neg_abs": lambda x: rlx.exp(-rlx.abs(x)),
        "log1p_abs": lambda x: rlx.log(1.0 + rlx.abs(x)),
        "hypot1": lambda x: rlx.sqrt(1.0 + x * x),
    }
    if op in unary:
        return unary[op](*values)
    a, b = values
    binary = {
        "add": lambda: a + b,
        "sub": lambda: a - b,
        "mul": lambda: a * b,
        "floordiv": lambda: a // b,
        "mod": lambda: a % b,
        "minimum": lambda: rlx.minimum(a, b),
        "maximum": lambda: rlx.maximum(a, b),
        "safe_div": lambda: a / (1.0 + rlx.abs(b)),
        "and": lambda: a & b,
        "or": lambda: a | b,
    }
    return binary[op]()


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    score_tree=st.one_of(st.none(), FLOAT_EXPR),
    mask_tree=st.one_of(st.none(), INT_BOOL),
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 2),
    seq_q=st.integers(1, 80),
    seq_k=st.integers(1, 80),
    dim=st.integers(1, 8),
    value_dim=st.integers(1, 8),
    layout=st.sampled_from(list(Layout)),
    scale=st.one_of(st.none(), st.floats(0.05, 2.0)),
    symbolic=st.sets(st.sampled_from(["B", "Sq", "Sk"])),
    seed=st.integers(0, 2**16),
    second_order=st.booleans(),
)
def test_random_mods_compile_to_the_reference(
    score_tree: Tree | None,
    mask_tree: Tree | None,
    batch: int,
    kv_heads: int,
    group: int,
    seq_q: int,
    seq_k: int,
    dim: int,
    value_dim: int,
    layout: Layout,
    scale: float | None,
    symbolic: set[str],
    seed: int,
    second_order: bool,
) -> None:
    """Any of the batch and the lengths may be declared symbolic (the bias keeps static sizes).
    With ``second_order``, the gradients are differentiated again (a penalty on them and on the
    LSE): the backward nodes' second-order rules restate the mods over index grids."""
    heads = kv_heads * group
    sizes = {"B": batch, "Sq": seq_q, "Sk": seq_k}
    b, sq, sk = (name if name in symbolic else sizes[name] for name in ("B", "Sq", "Sk"))
    g = Graph("fuzz_mods")
    q = g.input("q", layout.join(b, sq, heads, dim))
    k = g.input("k", layout.join(b, sk, kv_heads, dim))
    v = g.input("v", layout.join(b, sk, kv_heads, value_dim))
    bias = g.input("bias", (heads, seq_q, seq_k))
    segq, segk = g.input("segq", (b, sq), dtype="int64"), g.input("segk", (b, sk), dtype="int64")
    table = g.input("table", (3, 3))
    tensors = {"bias": bias, "segq": segq, "segk": segk, "table": table}

    def score_mod(score: Any, b: Any, h: Any, i: Any, j: Any) -> Any:
        assert score_tree is not None
        env = {"score": score, "b": b, "h": h, "i": i, "j": j, **tensors}
        return 6.0 * rlx.tanh(evaluate(score_tree, env) / 6.0)  # soft cap: softmax stays well conditioned

    def mask_mod(b: Any, h: Any, i: Any, j: Any) -> Any:
        assert mask_tree is not None
        return evaluate(mask_tree, {"b": b, "h": h, "i": i, "j": j, **tensors})

    out, lse = g.attention(
        q,
        k,
        v,
        score_mod=score_mod if score_tree is not None else None,
        mask_mod=mask_mod if mask_tree is not None else None,
        return_lse=True,
        scale=scale,
        layout=layout,
    )
    dy = g.input("dy", out.shape)
    reads = [name for name, leaf in (("bias", "('bias',)"), ("table", "('entry_bias',)")) if leaf in repr(score_tree)]
    grads = rlx.grad(g, out, [q, k, v, *(tensors[name] for name in reads)], dy)
    names = ("q", "k", "v", *reads)
    g.output(out=out, lse=lse, **{f"d{name}": grad for name, grad in zip(names, grads, strict=True)})
    if second_order:
        penalty = g.sum(g.where(g.greater(lse, -1e30), lse, 0.0)) * 0.5
        for grad in grads:
            penalty = penalty + g.sum(grad * grad)
        seconds = rlx.grad(g, penalty, [q, k, v, *(tensors[name] for name in reads)])
        g.output(**{f"h{name}": h for name, h in zip(names, seconds, strict=True)})

    rng = np.random.default_rng(seed)
    shapes = {name: tuple(sizes.get(d, d) for d in value.shape) for name, value in g.inputs.items()}
    arrays = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    arrays.update(segq=rng.integers(0, 3, shapes["segq"]), segk=rng.integers(0, 3, shapes["segk"]))
    got = rlx.compile(g)(**arrays)
    expected = rlx.reference.run(g, **arrays)
    for name, value in expected.items():
        assert not np.isnan(got[name]).any(), name
        assert_close(got[name], value, f"{name}: {score_tree} / {mask_tree}", rtol=2e-4, atol=5e-5)
