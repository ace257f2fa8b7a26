"""A Llama-style language model written in torch, one training step: torch.compile with rlx's
backend against torch eager and torch.compile's default (inductor).

The model is plain torch (RMSNorm, rotary embeddings computed in the graph, grouped-query SDPA,
SwiGLU, tied-free LM head, cross-entropy); the only change for rlx is
``torch.compile(model, backend="rlx")``. Each step is forward, loss and ``backward()`` into the
parameters' ``.grad`` (the optimizer is left out: it is the same torch code for all three).
Calls are interleaved after a short sleep (``_harness.time_bursts``), medians compared in one run,
and the gradients of the three compared first.

    python benchmarks/torch_backend.py            # writes benchmarks/results/torch_backend.json
    python benchmarks/torch_backend.py --quick    # the small shape only, no inductor

Needs torch; inductor's first compile takes tens of seconds a shape.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import _harness as h  # noqa: E402

# (batch, length, width, heads, kv heads, layers, vocab)
SHAPES = [(8, 128, 256, 4, 2, 2, 512), (4, 512, 512, 8, 4, 2, 2048)]
DEFAULT_JSON = REPO / "benchmarks" / "results" / "torch_backend.json"


def build_model(torch: Any, width: int, heads: int, kv_heads: int, layers: int, vocab: int) -> Any:
    F = torch.nn.functional

    def rotate(x: Any, cos: Any, sin: Any) -> Any:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head_dim = width // heads
            self.attn_norm = torch.nn.RMSNorm(width, eps=1e-6)
            self.q = torch.nn.Linear(width, width, bias=False)
            self.kv = torch.nn.Linear(width, 2 * kv_heads * self.head_dim, bias=False)
            self.o = torch.nn.Linear(width, width, bias=False)
            self.mlp_norm = torch.nn.RMSNorm(width, eps=1e-6)
            hidden = 64 * -(-8 * width // 3 // 64)
            self.gate = torch.nn.Linear(width, hidden, bias=False)
            self.up = torch.nn.Linear(width, hidden, bias=False)
            self.down = torch.nn.Linear(hidden, width, bias=False)

        def forward(self, x: Any, cos: Any, sin: Any) -> Any:
            b, s, _ = x.shape
            h = self.attn_norm(x)
            q = self.q(h).view(b, s, heads, self.head_dim).transpose(1, 2)
            k, v = self.kv(h).view(b, s, 2, kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.o(att.transpose(1, 2).reshape(b, s, width))
            h = self.mlp_norm(x)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, width)
            self.layers = torch.nn.ModuleList(Layer() for _ in range(layers))
            self.norm = torch.nn.RMSNorm(width, eps=1e-6)
            self.head = torch.nn.Linear(width, vocab, bias=False)
            head_dim = width // heads
            self.register_buffer("inv_freq", 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))

        def forward(self, ids: Any, targets: Any) -> Any:
            positions = torch.arange(ids.shape[1]).float()
            angles = positions[:, None] * self.inv_freq[None, :]
            angles = torch.cat((angles, angles), dim=-1)
            cos, sin = angles.cos(), angles.sin()
            x = self.embed(ids)
            for layer in self.layers:
                x = layer(x, cos, sin)
            logits = self.head(self.norm(x))
            return F.cross_entropy(logits.view(-1, vocab), targets.reshape(-1))

    return Model()


class Step:
    """One training step of ``model`` (forward, loss, backward) with gradients cleared untimed."""

    def __init__(self, model: Any, module: Any, *inputs: Any) -> None:
        self.model, self.module, self.inputs = model, module, inputs

    def setup(self) -> None:
        for p in self.module.parameters():
            p.grad = None

    def run(self) -> object:
        loss = self.model(*self.inputs)
        loss.backward()
        return loss


def run_shape(torch: Any, shape: tuple[int, ...], args: argparse.Namespace) -> dict[str, Any]:
    batch, length, width, heads, kv_heads, layers, vocab = shape
    torch.manual_seed(0)
    base = build_model(torch, width, heads, kv_heads, layers, vocab)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, length), generator=gen)
    targets = torch.randint(0, vocab, (batch, length), generator=gen)
    result = compare_steps(torch, base, (ids, targets), args, str(shape))
    return {"shape": dict(zip(("B", "S", "E", "H", "Hkv", "layers", "vocab"), shape, strict=True)), **result}


def compare_steps(
    torch: Any, base: Any, inputs: tuple[Any, ...], args: argparse.Namespace, what: str
) -> dict[str, Any]:
    """A training step of ``base`` on ``inputs`` in torch eager, through rlx's backend and (unless
    ``--no-inductor``) through inductor: the gradients compared with eager's first (an error if
    any part of the model fell back to eager torch, or if a gradient differs from eager's by more
    than 1e-3 of its largest entry), then timed interleaved."""
    import copy

    import rlx.torch.dynamo as rlx_dynamo

    modules = {"torch eager": base, "rlx backend": copy.deepcopy(base)}
    models = {"torch eager": base, "rlx backend": torch.compile(modules["rlx backend"], backend="rlx", dynamic=False)}
    if not args.no_inductor:
        modules["torch.compile"] = copy.deepcopy(base)
        models["torch.compile"] = torch.compile(modules["torch.compile"], dynamic=False)
    steps = {name: Step(models[name], modules[name], *inputs) for name in models}
    first = {}
    eager_before = rlx_dynamo.stats["eager"]
    for name, step in steps.items():
        step.setup()
        start = time.perf_counter()
        step.run()
        first[name] = time.perf_counter() - start
    if rlx_dynamo.stats["eager"] != eager_before:
        raise RuntimeError(f"the rlx backend left part of the model to eager torch: {rlx_dynamo.fallbacks}")
    reference = {n: p.grad.clone() for n, p in base.named_parameters()}
    errors = {}
    for name in steps:
        if name == "torch eager":
            continue
        worst = 0.0
        for p, want in zip(modules[name].parameters(), reference.values(), strict=True):
            scale = max(float(want.abs().max()), 1e-30)
            worst = max(worst, float((p.grad - want).abs().max()) / scale)
        errors[name] = worst
        if worst > 1e-3:
            raise RuntimeError(f"{name} disagrees with torch eager on {what}: relative error {worst:.2e}")
    bursts = h.time_bursts(steps, args.repeat, args.gap, args.warm)
    cold = {name: float(np.median(s)) for name, s in bursts.cold.items()}
    warm = {name: float(np.median(s)) for name, s in bursts.warm.items() if s}
    return {
        "median_s": cold,
        "warm_median_s": warm,
        "samples_s": bursts.cold,
        "first_step_s": first,
        "max_rel_grad_error_vs_eager": errors,
    }


def main() -> int:
    return run_benchmark(__doc__, SHAPES, run_shape, "B,S,E,H/Hkv,layers,V", _label, DEFAULT_JSON)


def _label(shape: dict[str, int]) -> str:
    return f"{shape['B']},{shape['S']},{shape['E']},{shape['H']}/{shape['Hkv']},{shape['layers']},{shape['vocab']}"


def run_benchmark(
    doc: str | None,
    shapes: list[tuple[int, ...]],
    run_shape: Callable[[Any, tuple[int, ...], argparse.Namespace], dict[str, Any]],
    shape_header: str,
    label: Callable[[dict[str, int]], str],
    default_json: Path,
) -> int:
    """The command line of a training-step benchmark (this one, ``convnet.py``): ``run_shape``
    for each of ``shapes`` (the first alone with ``--quick``), its table of first calls after a
    gap and of warm calls, the geometric means against torch eager, and the JSON."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the small shape, 3 repetitions, no inductor")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gap", type=float, default=0.05)
    parser.add_argument("--no-inductor", action="store_true", help="skip torch.compile's default backend")
    h.add_warm_option(parser)
    parser.add_argument("--json", type=Path, default=default_json)
    args = parser.parse_args()
    if args.quick:
        args.repeat, args.no_inductor = 3, True
    import torch

    torch.set_num_threads(args.threads)
    print(f"CPU: {h.cpu_model()}, {h.core_count()} cores; threads {args.threads}; torch {torch.__version__}")
    results = [run_shape(torch, shape, args) for shape in (shapes[:1] if args.quick else shapes)]
    names = list(results[0]["median_s"])
    header = [shape_header, *(f"{n} ms" for n in names), *(f"eager/{n}" for n in names[1:])]
    header += [f"first step {n} s" for n in names]
    rows = []
    for r in results:
        med = r["median_s"]
        rows.append(
            [label(r["shape"])]
            + [f"{med[n] * 1e3:.1f}" for n in names]
            + [f"{med['torch eager'] / med[n]:.2f}x" for n in names[1:]]
            + [f"{r['first_step_s'][n]:.2f}" for n in names]
        )
    print("\nOne training step (forward, cross-entropy, backward), first call after a gap, median:")
    print(h.markdown_table(header, rows))
    for n in names[1:]:
        ratio = h.geomean(r["median_s"]["torch eager"] / r["median_s"][n] for r in results)
        print(f"geometric mean, torch eager / {n}: {ratio:.2f}x")
    if args.warm:
        print(f"\n{h.warm_heading(args.warm)}:")
        warm_rows = [
            [label(r["shape"])]
            + [f"{r['warm_median_s'][n] * 1e3:.1f}" for n in names]
            + [f"{r['warm_median_s']['torch eager'] / r['warm_median_s'][n]:.2f}x" for n in names[1:]]
            for r in results
        ]
        warm_header = [shape_header, *(f"{n} ms" for n in names), *(f"eager/{n}" for n in names[1:])]
        print(h.markdown_table(warm_header, warm_rows))
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
