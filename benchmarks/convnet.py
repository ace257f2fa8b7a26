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
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from torch_backend import compare_steps, run_benchmark  # noqa: E402

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
    return run_benchmark(__doc__, SHAPES, run_shape, "B,side,width,classes", _label, DEFAULT_JSON)


def _label(shape: dict[str, int]) -> str:
    return f"{shape['B']},{shape['side']},{shape['width']},{shape['classes']}"


if __name__ == "__main__":
    raise SystemExit(main())
