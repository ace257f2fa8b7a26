"""The fixed-mask kernels against the same MaskKinds run as mods through the programmable kernels.

``CodegenOptions(masks_as_mods=True)`` rewrites every ``attention`` / ``attention_bwd`` node into
``flex_attention`` / ``flex_attention_bwd`` (recomputing the row statistics) with the mask's mods
(``rlx.mods.from_mask_kind``). This measures what that costs, case by case, forward and fused
backward (dQ, dK, dV), calls interleaved, at the default ``neg`` (a causal mask is then the
score_mod ``where(hidden, -1e9, score)``, block-sparse like a mask). It is the number that decides
whether the default pipeline may drop the fixed kernels.

    python benchmarks/masks_as_mods.py            # writes benchmarks/results/masks_as_mods.json
    python benchmarks/masks_as_mods.py --quick
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import _harness as h  # noqa: E402

import rlx  # noqa: E402
from rlx import Graph, MaskKind, Wrt  # noqa: E402
from rlx.codegen import CodegenOptions, compile_graph  # noqa: E402

CASES = [  # (B, S, H, D, mask): the shapes of benchmarks/attention_bwd.py
    (8, 128, 12, 64, MaskKind.NONE),
    (4, 512, 8, 64, MaskKind.NONE),
    (4, 512, 8, 64, MaskKind.CAUSAL),
    (2, 1024, 8, 64, MaskKind.CAUSAL),
    (2, 768, 6, 128, MaskKind.NONE),
]
DEFAULT_JSON = REPO / "benchmarks" / "results" / "masks_as_mods.json"


@dataclass
class Call:
    executable: rlx.Executable
    arrays: dict[str, np.ndarray]

    def setup(self) -> None:
        pass

    def run(self) -> object:
        return self.executable(**self.arrays)


def graph(batch: int, seq: int, heads: int, dim: int, mask: MaskKind, backward: bool) -> Graph:
    g = Graph("attention")
    q, k, v = (g.input(name, (batch, seq, heads, dim)) for name in ("q", "k", "v"))
    if not backward:
        g.output(out=g.attention(q, k, v, mask=mask))
        return g
    dy = g.input("dy", (batch, seq, heads, dim))
    dq, dk, dv = g.attention_bwd(q, k, v, dy, wrt=Wrt.ALL, mask=mask)
    g.output(dq=dq, dk=dk, dv=dv)
    return g


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 repetitions")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--gap", type=float, default=0.02)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    repeat = 3 if args.quick else args.repeat
    rng = np.random.default_rng(0)
    rows, results = [], []
    for batch, seq, heads, dim, mask in CASES:
        for backward in (False, True):
            g = graph(batch, seq, heads, dim, mask, backward)
            arrays = {name: rng.standard_normal(v.shape, dtype=np.float32) for name, v in g.inputs.items()}
            calls = {
                "fixed": Call(compile_graph(g), arrays),
                "as mods": Call(compile_graph(g, options=CodegenOptions(masks_as_mods=True)), arrays),
            }
            got = {name: call.run() for name, call in calls.items()}  # warm-up, and the check
            error = max(
                float(np.max(np.abs(got["as mods"][n] - got["fixed"][n])) / max(1e-30, np.max(np.abs(got["fixed"][n]))))
                for n in got["fixed"]
            )
            samples = h.time_interleaved(calls, repeat, args.gap)
            medians = {name: float(np.median(values)) for name, values in samples.items()}
            label = f"B{batch} S{seq} H{heads} D{dim} {mask} {'bwd' if backward else 'fwd'}"
            ratio = medians["as mods"] / medians["fixed"]
            rows.append(
                [
                    label,
                    f"{medians['fixed'] * 1e3:.1f}",
                    f"{medians['as mods'] * 1e3:.1f}",
                    f"{ratio:.3f}",
                    f"{error:.1e}",
                ]
            )
            results.append({"case": label, "median_s": medians, "as_mods_over_fixed": ratio, "max_rel_diff": error})
            print(f"  {label}: {ratio:.3f}", flush=True)
    mean = h.geomean(r["as_mods_over_fixed"] for r in results)
    print(f"\nCPU: {h.cpu_model()}, {h.core_count()} cores; time as mods / time fixed, geometric mean {mean:.3f}\n")
    print(h.markdown_table(["case", "fixed ms", "as mods ms", "as mods / fixed", "max rel diff"], rows))
    report = {
        "machine": {"cpu": h.cpu_model(), "cores": h.core_count()},
        "git": h.git_revision(REPO),
        "results": results,
        "geomean_as_mods_over_fixed": mean,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
