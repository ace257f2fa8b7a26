"""Profiling builds: per-kernel times and the attention kernels' own split of their time."""

from __future__ import annotations

import numpy as np
import pytest

import rlx
from rlx.codegen.executable import compile_graph
from rlx.codegen.lower import CodegenOptions


def _graph(backward: bool, mods: bool = False) -> rlx.Graph:
    g = rlx.Graph()
    q, k, v = (g.input(name, (2, 96, 4, 32)) for name in "qkv")
    if mods:  # the programmable kernels: a score_mod and a mask_mod, tiles skipped and partial
        out = g.attention(q, k, v, score_mod=rlx.mods.softcap(20.0), mask_mod=rlx.mods.sliding_window(40))
    else:
        out = g.attention(q, k, v, mask=rlx.MaskKind.CAUSAL)
    if backward:
        dq, dk, dv = rlx.grad(g, out, [q, k, v], g.input("dy", out.shape))
        g.output(dq=dq, dk=dk, dv=dv)
    else:
        g.output(out=out)
    return g


def _arrays(g: rlx.Graph) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {name: rng.standard_normal(v.static_shape, dtype=np.float32) for name, v in g.inputs.items()}


@pytest.mark.parametrize("mods", [False, True])
@pytest.mark.parametrize("backward", [False, True])
def test_the_breakdown_accounts_for_the_kernels_time(backward: bool, mods: bool) -> None:
    g = _graph(backward, mods)
    arrays = _arrays(g)
    exe = compile_graph(g, options=CodegenOptions(profile=True))
    plain = rlx.compile(g)(**arrays)
    for _ in range(2):  # counters start from zero on every call
        split = exe.attention_breakdown(**arrays)
        assert split["blas"] > 0 and split["softmax"] > 0
        assert (split["softmax_backward"] > 0) == backward
        parts = split["blas"] + split["softmax"] + split["softmax_backward"]
        assert parts <= split["kernel"] * 1.01
        assert split["kernel"] < 10.0  # seconds: a sum of nanosecond counters, not garbage
    profiled = exe(**arrays)
    for name in plain:  # timing changes nothing computed
        np.testing.assert_array_equal(profiled[name], plain[name])
    kernels = exe.profile(**arrays)
    attention = [info.name for info, _ in kernels if "attention" in info.name]
    if mods:
        assert attention == (["flex_attention", "flex_attention_bwd"] if backward else ["flex_attention"])
    else:
        assert attention == ["attention_bwd" if backward else "attention"]
    assert all(seconds > 0 for _, seconds in kernels)


def test_breakdown_needs_a_profiling_build() -> None:
    g = _graph(False)
    with pytest.raises(rlx.RlxValueError, match="profil"):
        rlx.compile(g).attention_breakdown(**_arrays(g))
