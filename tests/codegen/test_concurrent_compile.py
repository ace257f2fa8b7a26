"""Compiling from several threads at once in a fresh process: one LLVM JIT, correct results."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import threading
    import numpy as np
    import rlx
    from rlx import Graph

    errors = []

    def work(i):
        try:
            g = Graph(f"g{i}")
            shape = (1, 8 + i, 2, 4)
            q, k, v, dy = (g.input(n, shape) for n in ("q", "k", "v", "dy"))
            g.output(*g.attention_bwd(q, k, v, dy))
            rng = np.random.default_rng(i)
            arrays = {n: rng.standard_normal(shape).astype(np.float32) for n in ("q", "k", "v", "dy")}
            got, expected = rlx.compile(g)(**arrays), rlx.reference.run(g, **arrays)
            assert all(np.allclose(got[n], expected[n], atol=1e-5) for n in expected)
        except Exception as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    from rlx.codegen import jit
    print("errors", errors, "state", jit._state is not None)
    """
)


def test_first_compiles_from_many_threads() -> None:
    """The process-wide JIT is made once even when the first compiles race (a fresh process)."""
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "errors [] state True" in result.stdout, result.stdout + result.stderr
