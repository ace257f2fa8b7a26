"""Per-example gradients: ``rlx.vmap(rlx.grad(loss))`` against ``torch.func.vmap(torch.func.grad(loss))``.

The loss is a classifier's cross-entropy on one example: a two-layer MLP (GELU) with a bias,
the gradient taken w.r.t. all three parameters, for every example of a batch at once (what
differential privacy's clipping and influence functions need). rlx traces the per-example
function once and rebuilds it for the batch with each op's batching rule, then compiles the
graph (``rlx.jit``); torch.func batches the same function eagerly, op by op. Both return one
gradient per example and parameter, checked against each other first.

Each call is timed after a short sleep, interleaved, medians; then warm calls back to back.
2 threads each (torch's intra-op threads, rlx's config). No target is set for this benchmark.

    python benchmarks/per_example_grads.py            # writes benchmarks/results/per_example_grads.json
    python benchmarks/per_example_grads.py --quick    # the first shape only, fewer repetitions
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import _harness as harness  # noqa: E402

import rlx  # noqa: E402

# (examples, features, hidden, classes)
SHAPES = [(64, 256, 512, 10), (256, 128, 512, 10), (128, 784, 256, 10)]
DEFAULT_JSON = REPO / "benchmarks" / "results" / "per_example_grads.json"


def rlx_loss(params: Any, x: Any, y: Any) -> Any:
    hidden = rlx.gelu(x @ params["w1"] + params["b1"])
    return rlx.cross_entropy((hidden @ params["w2"])[None], y[None])


class Call:
    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def setup(self) -> None:
        pass

    def run(self) -> object:
        return self.fn(*self.args)


def run_shape(torch: Any, shape: tuple[int, int, int, int], repeat: int, gap: float, warm: int) -> dict[str, Any]:
    from torch.func import grad, vmap

    examples, features, hidden, classes = shape
    rng = np.random.default_rng(0)
    params = {
        "w1": (rng.standard_normal((features, hidden)) / np.sqrt(features)).astype(np.float32),
        "b1": np.zeros(hidden, dtype=np.float32),
        "w2": (rng.standard_normal((hidden, classes)) / np.sqrt(hidden)).astype(np.float32),
    }
    x = rng.standard_normal((examples, features)).astype(np.float32)
    y = rng.integers(0, classes, examples).astype(np.int64)

    per_example = rlx.jit(lambda p, x, y: rlx.vmap(rlx.grad(rlx_loss), in_axes=(None, 0, 0))(p, x, y))

    def torch_loss(p: Any, x: Any, y: Any) -> Any:
        h = torch.nn.functional.gelu(x @ p["w1"] + p["b1"])
        return torch.nn.functional.cross_entropy((h @ p["w2"])[None], y[None])

    torch_per_example = vmap(grad(torch_loss), in_dims=(None, 0, 0))
    tparams = {k: torch.from_numpy(v) for k, v in params.items()}
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)

    ours, compile_seconds = harness.timed(Call(per_example, params, x, y))
    theirs = torch_per_example(tparams, tx, ty)
    worst = max(float(np.max(np.abs(ours[k] - theirs[k].numpy()))) for k in params)  # type: ignore[index]
    scale = max(float(np.max(np.abs(theirs[k].numpy()))) for k in params)
    assert worst <= 1e-4 * max(scale, 1.0), f"per-example gradients differ from torch.func's by {worst}"

    calls = {"rlx": Call(per_example, params, x, y), "torch.func": Call(torch_per_example, tparams, tx, ty)}
    bursts = harness.time_bursts(calls, repeat, gap, warm)
    cold = {name: harness.Stats.of(samples).median for name, samples in bursts.cold.items()}
    hot = {name: harness.median_or_none(samples) for name, samples in bursts.warm.items()}
    graph = per_example.graph(params, x, y)
    return {
        "shape": {"examples": examples, "features": features, "hidden": hidden, "classes": classes},
        "rlx_ms": cold["rlx"] * 1e3,
        "torch_func_ms": cold["torch.func"] * 1e3,
        "torch_over_rlx": cold["torch.func"] / cold["rlx"],
        "warm_rlx_ms": None if hot["rlx"] is None else hot["rlx"] * 1e3,
        "warm_torch_func_ms": None if hot["torch.func"] is None else hot["torch.func"] * 1e3,
        "first_call_with_compile_s": compile_seconds,
        "max_abs_difference": worst,
        "graph_nodes": len(graph),
        "gradient_megabytes": sum(v.nbytes for v in ours.values()) / 2**20,  # type: ignore[union-attr]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the first shape only, fewer repetitions")
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument("--gap", type=float, default=0.05, help="seconds of sleep before each timed call")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    harness.add_warm_option(parser)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    repeat = args.repeat or (5 if args.quick else 15)
    shapes = SHAPES[:1] if args.quick else SHAPES
    rows = [run_shape(torch, shape, repeat, args.gap, args.warm) for shape in shapes]
    print(f"CPU: {harness.cpu_model()}, {harness.core_count()} cores; torch {torch.__version__}")
    print("Per-example gradients of an MLP classifier's cross-entropy (w1, b1, w2), first call after a gap:")
    table = [
        [
            "{examples}x{features}x{hidden}x{classes}".format(**row["shape"]),
            f"{row['rlx_ms']:.2f}",
            f"{row['torch_func_ms']:.2f}",
            f"{row['torch_over_rlx']:.2f}x",
            f"{row['warm_rlx_ms']:.2f}" if row["warm_rlx_ms"] is not None else "-",
            f"{row['warm_torch_func_ms']:.2f}" if row["warm_torch_func_ms"] is not None else "-",
            f"{row['gradient_megabytes']:.0f}",
            f"{row['first_call_with_compile_s']:.2f}",
        ]
        for row in rows
    ]
    header = [
        "B x D x H x C",
        "rlx ms",
        "torch.func ms",
        "torch.func/rlx",
        "warm rlx",
        "warm torch.func",
        "MiB out",
        "first call s",
    ]
    print(harness.markdown_table(header, table))
    ratio = harness.geomean(row["torch_over_rlx"] for row in rows)
    print(f"torch.func/rlx geomean: {ratio:.2f}x (no target set)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {"cpu": harness.cpu_model(), "cores": harness.core_count(), "torch": torch.__version__}
    args.json.write_text(json.dumps({"machine": meta, "rows": rows, "geomean_torch_over_rlx": ratio}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
