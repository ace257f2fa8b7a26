"""Decoding with a growing KV cache: one query token against Sk = 1..N keys, rlx.torch vs torch SDPA.

Every step has a new key length. Today rlx compiles each new shape (it has no symbolic
dimensions yet), so this benchmark reports the compile count and the per-step time including
those compiles, next to torch's per-step time: the number that dynamic sequence lengths must
bring down to one compile.

    python benchmarks/decode.py [--steps 200]

Writes ``benchmarks/results/decode.json``. Needs torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import _harness as h  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="decode steps (Sk = 1..steps; default 200)")
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "decode.json")
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F

    import rlx.torch as rt
    from rlx.codegen.executable import compile_count

    batch, heads, dim = 1, 8, 64
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(batch, heads, args.steps, dim, generator=gen)
    v_cache = torch.randn(batch, heads, args.steps, dim, generator=gen)
    queries = torch.randn(args.steps, batch, heads, 1, dim, generator=gen)
    before = compile_count()
    timings: dict[str, list[float]] = {"rlx": [], "torch": []}
    worst = 0.0
    for step in range(args.steps):
        k, v = k_cache[:, :, : step + 1], v_cache[:, :, : step + 1]
        start = time.perf_counter()
        got = rt.scaled_dot_product_attention(queries[step], k, v)
        timings["rlx"].append(time.perf_counter() - start)
        start = time.perf_counter()
        want = F.scaled_dot_product_attention(queries[step], k, v)
        timings["torch"].append(time.perf_counter() - start)
        worst = max(worst, float((got - want).abs().max()))
    compiles = compile_count() - before
    again = time.perf_counter()
    for step in range(args.steps):  # the same lengths again: everything is cached now
        rt.scaled_dot_product_attention(queries[step], k_cache[:, :, : step + 1], v_cache[:, :, : step + 1])
    cached_step = (time.perf_counter() - again) / args.steps
    rows = [
        ["rlx.torch (first pass, compiling)", f"{np.mean(timings['rlx']) * 1e3:.2f}", str(compiles)],
        ["rlx.torch (second pass, cached)", f"{cached_step * 1e3:.3f}", str(compile_count() - before - compiles)],
        ["torch SDPA", f"{np.mean(timings['torch']) * 1e3:.3f}", "-"],
    ]
    shape = f"B{batch} H{heads} D{dim}, one query, Sk = 1..{args.steps}"
    print(f"CPU: {h.cpu_model()}; {shape}; max |rlx - torch| {worst:.1e}")
    print(h.markdown_table(["implementation", "mean ms per step", "compiles"], rows))
    report = {
        "steps": args.steps,
        "compiles": compiles,
        "mean_step_s": {name: float(np.mean(values)) for name, values in timings.items()},
        "cached_step_s": cached_step,
        "max_abs_diff": worst,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
