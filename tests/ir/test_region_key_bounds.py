"""``Region.key_bounds``: the diagonals above which a mask_mod hides every key.

The programmable forward kernel skips the products above them (``tile_gemm.Band``), so a bound
must hold wherever the mask attends, for every length: checked by evaluating the region on a
grid, for the library's masks and for random conjunctions of linear comparisons.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, note, settings
from hypothesis import strategies as st

import rlx
from rlx.ir.region import KeyBound, Region


def traced(mask_mod: object, sq: int = 16, sk: int = 16) -> Region:
    g = rlx.Graph("bounds")
    q = g.input("q", (1, 1, sq, 4))
    k = g.input("k", (1, 1, sk, 4))
    doc = g.input("doc", (1, max(sq, sk)), dtype="int32")
    mods = {"document": rlx.mods.document(doc)}
    mask = mods.get(mask_mod, mask_mod) if isinstance(mask_mod, str) else mask_mod
    out = g.attention(q, k, k, mask_mod=mask)
    region = out.node.attrs.mask_mod
    assert isinstance(region, Region)
    return region


def attends(region: Region, sq: int, sk: int) -> np.ndarray:
    """The mask over every (query, key) of these lengths (a region reading no tensor)."""
    i, j = np.meshgrid(np.arange(sq), np.arange(sk), indexing="ij")
    symbols = {"b": np.zeros(1, np.int64), "h": np.zeros(1, np.int64), "q_idx": i, "kv_idx": j}
    symbols |= {"q_len": np.int64(sq), "kv_len": np.int64(sk), "score": np.float64(0.0)}
    return np.broadcast_to(region.evaluate(symbols, []), i.shape).astype(bool)


def holds(bound: KeyBound, region: Region, sq: int, sk: int) -> bool:
    """Whether every key the mask attends lies at or below the bound's diagonal."""
    lengths = {"q_len": np.int64(sq), "kv_len": np.int64(sk)}
    values = region.evaluate_all(lengths | {name: np.int64(0) for name in ("b", "h", "q_idx", "kv_idx", "score")}, [])
    diagonal = bound.constant + bound.q_len * sq + bound.kv_len * sk
    diagonal += sum(c * int(values[index]) for c, index in bound.steps)
    i, j = np.nonzero(attends(region, sq, sk))
    return bool(np.all(j - i <= diagonal))


def test_the_library_masks_bound_their_keys() -> None:
    assert traced(rlx.mods.causal).key_bounds() == (KeyBound(0),)
    assert traced(rlx.mods.causal_lower_right).key_bounds() == (KeyBound(0, q_len=-1, kv_len=1),)
    assert traced(rlx.mods.sliding_window(3, 2)).key_bounds() == (KeyBound(2),)
    assert traced(rlx.mods.and_(rlx.mods.causal, rlx.mods.sliding_window(8, 4))).key_bounds() == (
        KeyBound(0),
        KeyBound(4),
    )


def test_masks_without_a_diagonal_have_no_bound() -> None:
    assert traced(rlx.mods.prefix_lm(4)).key_bounds() == ()  # an or: the prefix is seen by all
    assert traced("document").key_bounds() == ()
    assert traced(lambda b, h, q, kv: kv <= 2 * q).key_bounds() == ()  # not a diagonal
    assert traced(lambda b, h, q, kv: q + kv >= 3).key_bounds() == ()


def test_steps_of_the_lengths_alone_are_constants_of_the_call() -> None:
    """The fixed causal mask as a mod (``rlx.mods.from_mask_kind``): ``q + max(Sk - Sq, 0) >= kv``."""
    region = Region.parse(
        "sub(%kv_len, %q_len); maximum(%t0, 0); add(%q_idx, %t1); greater(%kv_idx, %t2); logical_not(%t3)"
    )
    assert region.key_bounds() == (KeyBound(0, steps=((1, 1),)),)
    for sq, sk in ((5, 9), (9, 5), (7, 7)):
        assert holds(region.key_bounds()[0], region, sq, sk)


def test_negations_and_offsets_are_read() -> None:
    assert traced(lambda b, h, q, kv: ~(kv > q + 1)).key_bounds() == (KeyBound(1),)
    assert traced(lambda b, h, q, kv: q - kv >= -5).key_bounds() == (KeyBound(5),)
    assert traced(lambda b, h, q, kv: kv < q).key_bounds() == (KeyBound(-1),)
    assert traced(lambda b, h, q, kv: ~((kv > q) | (q > 9))).key_bounds() == (KeyBound(0),)  # De Morgan


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_random_linear_masks_hold_their_bounds(data: st.DataObject) -> None:
    """Conjunctions, disjunctions and negations of comparisons of random linear forms: every
    bound found holds on the grid, for several lengths (the lengths enter the forms)."""
    constants = ["%q_len", "%kv_len", "3", "-2", "1", "gap"]
    steps: list[str] = []

    def constant(term: str) -> str:
        """A literal, a length, or ``max(Sk - Sq, 0)``: a step of the lengths alone."""
        if term != "gap":
            return term
        steps.append("sub(%kv_len, %q_len)")
        steps.append(f"maximum(%t{len(steps) - 1}, 0)")
        return f"%t{len(steps) - 1}"

    def form(base: str) -> str:
        """``base`` plus or minus a few constant terms, times a small factor at times."""
        value = base
        for term in map(constant, data.draw(st.lists(st.sampled_from(constants), max_size=2))):
            op = data.draw(st.sampled_from(["add", "sub"]))
            first, second = (value, term) if data.draw(st.booleans()) or op == "sub" else (term, value)
            steps.append(f"{op}({first}, {second})")
            value = f"%t{len(steps) - 1}"
        if data.draw(st.integers(0, 3)) == 0:
            steps.append(f"mul({value}, {data.draw(st.sampled_from(['2', '-1']))})")
            value = f"%t{len(steps) - 1}"
        return value

    def comparison() -> str:
        """Mostly a key index against a query index (a diagonal, when the factors allow)."""
        bases = data.draw(st.sampled_from([("%kv_idx", "%q_idx"), ("%q_idx", "%kv_idx"), ("%q_idx", "%q_idx")]))
        a, b = form(bases[0]), form(bases[1])
        op = data.draw(st.sampled_from(["less", "less_equal", "greater", "greater_equal"]))
        steps.append(f"{op}({a}, {b})")
        return f"%t{len(steps) - 1}"

    def condition(depth: int) -> str:
        choice = data.draw(st.sampled_from(["cmp", "cmp", "and", "or", "not"] if depth < 3 else ["cmp"]))
        if choice == "cmp":
            return comparison()
        if choice == "not":
            inner = condition(depth + 1)
            steps.append(f"logical_not({inner})")
        else:
            a, b = condition(depth + 1), condition(depth + 1)
            steps.append(f"logical_{choice}({a}, {b})")
        return f"%t{len(steps) - 1}"

    condition(0)
    region = Region.parse("; ".join(steps))
    bounds = region.key_bounds()
    note(f"{region}: {bounds}")
    for bound in bounds:
        for sq, sk in ((7, 7), (5, 11), (12, 4)):
            assert holds(bound, region, sq, sk), (str(region), bound, sq, sk)
