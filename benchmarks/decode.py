"""Decoding with a growing KV cache: one query token against Sk = 1..N keys, rlx.torch vs torch SDPA.

Every step has a new key length. ``rt.scaled_dot_product_attention`` declares the sequence
lengths as symbolic dimensions, so the whole loop should compile once (the first step) and then
run every length on the same machine code. The KV cache grows by concatenation (as in
transformers' ``DynamicCache``), so both libraries read contiguous tensors; a slice of a
preallocated cache is not contiguous, and rlx copies it before the call. The table gives the
compile count of the loop and the mean time per step of rlx and torch (interleaved: each step
runs both, same inputs, in alternating order), for the whole loop and for its first and last
hundred steps.

A second table times the step of a model's attention layer around the call (the QKV
projection, the cache's ``torch.cat``, attention, the output projection; E = H * D): there
the projections' weights pass through the caches before every attention call, as in a model,
and an attention call is as fast as its Python is when it starts cold. A third times
``flex_attention`` with a softcap score_mod (Gemma-2's) against the same attention written in
torch ops, as a model without a fused kernel for it runs it; a fourth SDPA with a padding mask,
as batched generation calls it.

    python benchmarks/decode.py [--steps 1000]

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
    parser.add_argument("--steps", type=int, default=1000, help="decode steps (Sk = 1..steps; default 1000)")
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "decode.json")
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F

    import rlx.torch as rt
    from rlx.codegen.executable import compile_count

    batch, heads, dim = 1, 8, 64
    gen = torch.Generator().manual_seed(0)
    new_keys = torch.randn(args.steps, batch, heads, 1, dim, generator=gen)
    new_values = torch.randn(args.steps, batch, heads, 1, dim, generator=gen)
    k = torch.empty(batch, heads, 0, dim)
    v = torch.empty(batch, heads, 0, dim)
    queries = torch.randn(args.steps, batch, heads, 1, dim, generator=gen)
    before = compile_count()
    timings: dict[str, list[float]] = {"rlx": [], "torch": []}
    worst = 0.0
    for step in range(args.steps):
        # The cache grows by concatenation, as in transformers' DynamicCache: contiguous tensors.
        k, v = torch.cat([k, new_keys[step]], dim=2), torch.cat([v, new_values[step]], dim=2)
        results = {}
        # Each step runs both, the one that goes first alternating (it finds the caches colder).
        for name in ("rlx", "torch") if step % 2 == 0 else ("torch", "rlx"):
            attend = rt.scaled_dot_product_attention if name == "rlx" else F.scaled_dot_product_attention
            start = time.perf_counter()
            results[name] = attend(queries[step], k, v)
            timings[name].append(time.perf_counter() - start)
        worst = max(worst, float((results["rlx"] - results["torch"]).abs().max()))
    compiles = compile_count() - before
    first_step = timings["rlx"][0]  # includes the one compilation
    steady = slice(1, None)
    hundred = min(100, args.steps - 1)

    def rows(times: dict[str, list[float]]) -> list[list[str]]:
        def row(label: str, part: slice) -> list[str]:
            ours, theirs = np.mean(times["rlx"][part]), np.mean(times["torch"][part])
            return [label, f"{ours * 1e3:.3f}", f"{theirs * 1e3:.3f}", f"{theirs / ours:.2f}x"]

        return [
            row(f"steps 2..{args.steps} (Sk = 2..{args.steps})", steady),
            row(f"first {hundred} after the compile", slice(1, 1 + hundred)),
            row(f"last {hundred}", slice(args.steps - hundred, None)),
        ]

    shape = f"B{batch} H{heads} D{dim}, one query, Sk = 1..{args.steps}"
    print(f"CPU: {h.cpu_model()}; {shape}; max |rlx - torch| {worst:.1e}")
    print(f"compilations in the loop: {compiles}; first step (compiling) {first_step * 1e3:.1f} ms")
    print(h.markdown_table(["steps", "rlx ms/step", "torch ms/step", "torch / rlx"], rows(timings)))
    layer = model_steps(args.steps, batch, heads, dim)
    print("\nThe step of a model's attention layer (projections, cache, attention), same lengths:")
    print(h.markdown_table(["steps", "rlx ms/step", "torch ms/step", "torch / rlx"], rows(layer)))
    softcap, softcap_diff = softcap_steps(args.steps, batch, heads, dim)
    print(
        f"\nflex_attention with a softcap score_mod (as Gemma-2 decodes; cap {SOFTCAP}) against the same "
        "attention in torch ops (matmul, tanh, softmax, matmul: torch's SDPA takes no score_mod, and its "
        f"flex_attention runs only under torch.compile), same lengths; max |rlx - torch| {softcap_diff:.1e}:"
    )
    print(h.markdown_table(["steps", "rlx ms/step", "torch ms/step", "torch / rlx"], rows(softcap)))
    before_masked = compile_count()
    masked, masked_diff = masked_steps(args.steps, heads, dim)
    masked_compilations = compile_count() - before_masked
    print(
        f"\nSDPA with a padding mask [B, 1, 1, Sk] (batched generation, B{MASKED_BATCH}: the second sequence's "
        f"first {PADDING} keys are padding), same lengths; max |rlx - torch| {masked_diff:.1e}; compilations "
        f"in the loop: {masked_compilations} (the first step's, in the first hundred's mean):"
    )
    print(h.markdown_table(["steps", "rlx ms/step", "torch ms/step", "torch / rlx"], rows(masked)))
    report = {
        "steps": args.steps,
        "compiles": compiles,
        "first_step_s": first_step,
        "mean_step_s": {name: float(np.mean(values[steady])) for name, values in timings.items()},
        "model_mean_step_s": {name: float(np.mean(values[steady])) for name, values in layer.items()},
        "softcap_mean_step_s": {name: float(np.mean(values[steady])) for name, values in softcap.items()},
        "masked_mean_step_s": {name: float(np.mean(values[steady])) for name, values in masked.items()},
        "masked_last_hundred_s": {name: float(np.mean(values[-hundred:])) for name, values in masked.items()},
        "masked_compilations": masked_compilations,
        "max_abs_diff": worst,
        "cpu": h.cpu_model(),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    return 0


def model_steps(steps: int, batch: int, heads: int, dim: int) -> dict[str, list[float]]:
    """Seconds per step of a model's attention layer with rlx's attention and with torch's, in
    alternating order each step (each with its own KV cache; the same weights and inputs)."""
    import torch
    import torch.nn.functional as F

    import rlx.torch as rt

    embed = heads * dim
    gen = torch.Generator().manual_seed(1)
    w_qkv = torch.randn(embed, 3 * embed, generator=gen) / embed**0.5
    w_out = torch.randn(embed, embed, generator=gen) / embed**0.5
    xs = torch.randn(steps, batch, 1, embed, generator=gen)
    attend = {"rlx": rt.scaled_dot_product_attention, "torch": F.scaled_dot_product_attention}
    caches = {name: (torch.empty(batch, heads, 0, dim), torch.empty(batch, heads, 0, dim)) for name in attend}
    timings: dict[str, list[float]] = {name: [] for name in attend}
    with torch.no_grad():
        for step in range(steps):
            for name in ("rlx", "torch") if step % 2 == 0 else ("torch", "rlx"):
                start = time.perf_counter()
                qkv = (xs[step] @ w_qkv).view(batch, 1, 3, heads, dim).permute(2, 0, 3, 1, 4)
                k, v = caches[name]
                k, v = torch.cat([k, qkv[1]], dim=2), torch.cat([v, qkv[2]], dim=2)
                out = attend[name](qkv[0].contiguous(), k, v)
                out.transpose(1, 2).reshape(batch, 1, embed) @ w_out
                timings[name].append(time.perf_counter() - start)
                caches[name] = (k, v)
    return timings


SOFTCAP = 50.0


def softcap_steps(steps: int, batch: int, heads: int, dim: int) -> tuple[dict[str, list[float]], float]:
    """Seconds per decode step of softcapped attention: rlx.torch's ``flex_attention`` with a
    score_mod, and torch's ops as a model without a fused kernel writes it (Gemma-2's eager
    attention), in alternating order; and the largest difference between the two."""
    import torch

    import rlx.torch as rt

    def softcap(score: torch.Tensor, b: object, h: object, q_idx: object, kv_idx: object) -> torch.Tensor:
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    def torch_softcap(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = (q @ k.transpose(-1, -2)) * dim**-0.5
        return torch.softmax(SOFTCAP * torch.tanh(scores / SOFTCAP), dim=-1) @ v

    gen = torch.Generator().manual_seed(2)
    queries = torch.randn(steps, batch, heads, 1, dim, generator=gen)
    new_keys = torch.randn(steps, batch, heads, 1, dim, generator=gen) * 4.0  # scores reaching the cap
    new_values = torch.randn(steps, batch, heads, 1, dim, generator=gen)
    attend = {"rlx": lambda q, k, v: rt.flex_attention(q, k, v, score_mod=softcap), "torch": torch_softcap}
    k, v = torch.empty(batch, heads, 0, dim), torch.empty(batch, heads, 0, dim)
    timings: dict[str, list[float]] = {name: [] for name in attend}
    worst = 0.0
    with torch.no_grad():
        for step in range(steps):
            k, v = torch.cat([k, new_keys[step]], dim=2), torch.cat([v, new_values[step]], dim=2)
            results = {}
            for name in ("rlx", "torch") if step % 2 == 0 else ("torch", "rlx"):
                start = time.perf_counter()
                results[name] = attend[name](queries[step], k, v)
                timings[name].append(time.perf_counter() - start)
            worst = max(worst, float((results["rlx"] - results["torch"]).abs().max()))
    return timings, worst


MASKED_BATCH, PADDING = 2, 3


def masked_steps(steps: int, heads: int, dim: int) -> tuple[dict[str, list[float]], float]:
    """Seconds per decode step of SDPA with a bool padding mask, as batched generation calls it
    (left padding on the second sequence), rlx.torch against torch, in alternating order; and
    the largest difference between the two."""
    import torch
    import torch.nn.functional as F

    import rlx.torch as rt

    gen = torch.Generator().manual_seed(3)
    shape = (steps, MASKED_BATCH, heads, 1, dim)
    queries, new_keys, new_values = (torch.randn(shape, generator=gen) for _ in range(3))
    attend = {"rlx": rt.scaled_dot_product_attention, "torch": F.scaled_dot_product_attention}
    k, v = torch.empty(MASKED_BATCH, heads, 0, dim), torch.empty(MASKED_BATCH, heads, 0, dim)
    timings: dict[str, list[float]] = {name: [] for name in attend}
    worst = 0.0
    with torch.no_grad():
        for step in range(steps):
            k, v = torch.cat([k, new_keys[step]], dim=2), torch.cat([v, new_values[step]], dim=2)
            mask = torch.ones(MASKED_BATCH, 1, 1, step + 1, dtype=torch.bool)
            mask[1, :, :, : min(PADDING, step)] = False  # the newest key is never padding
            results = {}
            for name in ("rlx", "torch") if step % 2 == 0 else ("torch", "rlx"):
                start = time.perf_counter()
                results[name] = attend[name](queries[step], k, v, attn_mask=mask)
                timings[name].append(time.perf_counter() - start)
            worst = max(worst, float((results["rlx"] - results["torch"]).abs().max()))
    return timings, worst


if __name__ == "__main__":
    sys.exit(main())
