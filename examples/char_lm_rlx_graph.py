"""Train the same character-level transformer written as an rlx graph, driven from PyTorch.

    python examples/char_lm_rlx_graph.py [--data PATH] [--steps 50]

The model is ``rlx.models.char_lm_logits`` plus a cross-entropy loss: one rlx graph, compiled
once by ``rlx.torch.compile`` into a differentiable torch function (its backward graph comes
from ``rlx.grad``, compiled on the first backward). The parameters are torch ``nn.Parameter``s
and torch's AdamW updates them; the batches are those of ``char_lm_torch.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from char_lm_torch import REPO, Config, batches, load_text
from char_lm_torch import train as train_steps

import rlx.torch as rt
from rlx.models import LMConfig, char_lm_logits, init_params


def build(config: Config) -> tuple[rt.CompiledGraph, dict[str, torch.nn.Parameter]]:
    lm = LMConfig(vocab=config.vocab, seq=config.seq, batch=config.batch, embed=config.embed,
                  heads=config.heads, layers=config.layers)  # fmt: skip
    g, logits = char_lm_logits(lm)
    targets = g.input("targets", (config.batch, config.seq), "int32")
    g.output(loss=g.cross_entropy(logits, targets))
    params = [value for name, value in g.inputs.items() if name not in ("tokens", "targets")]
    weights = {name: torch.nn.Parameter(torch.from_numpy(array)) for name, array in init_params(g, params).items()}
    return rt.compile(g), weights


def train(data_path: Path, steps: int, seed: int = 0, config: Config | None = None) -> tuple[list[float], float]:
    """AdamW over the batches (``char_lm_torch.train``): the loss of every step and the tokens/s
    of the steps after the first (which compiles the graph and its gradient)."""
    ids, vocab = load_text(data_path)
    config = config or Config(vocab=vocab)
    f, weights = build(config)

    def loss_of(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return f(tokens=tokens.to(torch.int32), targets=targets.to(torch.int32), **weights)["loss"]

    losses, rate, _ = train_steps(loss_of, weights.values(), batches(ids, config, steps, seed), config, sys.stdout)
    return losses, rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=REPO / "README.md", help="text file (default: the README)")
    parser.add_argument("--steps", type=int, default=50, help="training steps (default 50)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = parser.parse_args()
    losses, rate = train(args.data, args.steps, args.seed)
    print(
        f"\nloss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps; {rate:,.0f} tokens/s after the first step"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
