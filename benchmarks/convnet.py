"""A small ResNet written in torch, one training step: torch.compile with rlx's backend against
torch eager and torch.compile's default (inductor).

The network is plain torch: a 7x7 stride-2 stem, batch norm in training mode, SiLU (as
EfficientNet and RegNet use), a 3x3 max pool, three basic residual blocks (the second and
third downsample by a strided convolution and a 1x1 projection), global average pooling, a
linear classifier and cross-entropy. Each step is
forward, loss and ``backward()`` into the parameters' ``.grad``, interleaved with the others
after a short sleep, medians compared in one run (see ``torch_backend.py``, whose comparison
this shares). torch runs its convolutions directly (oneDNN); rlx as im2col and a BLAS product.

The gradients are compared with eager's first. The activation is smooth on purpose: with
ReLU, an entry that batch norm puts within rounding of 0 lands on either side of the kink in
two float32 computations, and batch norm in training spreads the moved gradient over the batch,
so the gradients of eager torch, of rlx and of a float64 run differ by up to 1e-1 of their
largest entries (eager or rlx the farther from float64, depending on the inputs); with SiLU all
three agree to 1e-5.

    python benchmarks/convnet.py            # writes benchmarks/results/convnet.json
    python benchmarks/convnet.py --quick    # the small shape only, no inductor

Needs torch; inductor's first compile takes tens of seconds a shape.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import _harness as h  # noqa: E402
from torch_backend import compare_steps  # noqa: E402

# (batch, image side, stem width, classes)
SHAPES = [(16, 96, 32, 10), (8, 160, 64, 100)]
DEFAULT_JSON = REPO / "benchmarks" / "results" / "convnet.json"


def build_model(torch: Any, width: int, classes: int) -> Any:
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self, inputs: int, outputs: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(outputs)
            self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(outputs)
            self.project = None
            if stride != 1 or inputs != outputs:
                self.project = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))

        def forward(self, x: Any) -> Any:
            y = F.silu(self.bn1(self.conv1(x)))
            y = self.bn2(self.conv2(y))
            return F.silu(y + (x if self.project is None else self.project(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.SiLU())
            self.pool = nn.MaxPool2d(3, 2, 1)
            self.blocks = nn.Sequential(
                Block(width, width, 1), Block(width, 2 * width, 2), Block(2 * width, 4 * width, 2)
            )
            self.head = nn.Linear(4 * width, classes)

        def forward(self, images: Any, labels: Any) -> Any:
            x = self.blocks(self.pool(self.stem(images)))
            logits = self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
            return F.cross_entropy(logits, labels)

    return Net()


def run_shape(torch: Any, shape: tuple[int, ...], args: argparse.Namespace) -> dict[str, Any]:
    batch, side, width, classes = shape
    torch.manual_seed(0)
    base = build_model(torch, width, classes)
    gen = torch.Generator().manual_seed(1)
    images = torch.randn(batch, 3, side, side, generator=gen)
    labels = torch.randint(0, classes, (batch,), generator=gen)
    result = compare_steps(torch, base, (images, labels), args, str(shape))
    return {"shape": dict(zip(("B", "side", "width", "classes"), shape, strict=True)), **result}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the small shape, 3 repetitions, no inductor")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gap", type=float, default=0.05)
    parser.add_argument("--no-inductor", action="store_true", help="skip torch.compile's default backend")
    h.add_warm_option(parser)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    if args.quick:
        args.repeat, args.no_inductor = 3, True
    import torch

    torch.set_num_threads(args.threads)
    shapes = SHAPES[:1] if args.quick else SHAPES
    print(f"CPU: {h.cpu_model()}, {h.core_count()} cores; threads {args.threads}; torch {torch.__version__}")
    results = [run_shape(torch, shape, args) for shape in shapes]
    names = list(results[0]["median_s"])
    header = ["B,side,width,classes", *(f"{n} ms" for n in names), *(f"eager/{n}" for n in names[1:])]
    header += [f"first step {n} s" for n in names]
    rows = []
    for r in results:
        s, med = r["shape"], r["median_s"]
        rows.append(
            [f"{s['B']},{s['side']},{s['width']},{s['classes']}"]
            + [f"{med[n] * 1e3:.1f}" for n in names]
            + [f"{med['torch eager'] / med[n]:.2f}x" for n in names[1:]]
            + [f"{r['first_step_s'][n]:.2f}" for n in names]
        )
    print("\nOne training step (forward, cross-entropy, backward), first call after a gap, median:")
    print(h.markdown_table(header, rows))
    for n in names[1:]:
        ratio = h.geomean(r["median_s"]["torch eager"] / r["median_s"][n] for r in results)
        print(f"geometric mean, torch eager / {n}: {ratio:.2f}x")
    report = {
        "machine": {"cpu": h.cpu_model(), "cores": h.core_count(), "threads": args.threads, "torch": torch.__version__},
        "revision": h.git_revision(REPO),
        "results": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
