"""Programmable attention on CPU: rlx against torch.compile(flex_attention) and torch SDPA with the mask materialised.

For each case (B, H=8, S, D=64; mods causal, sliding_window(256), document with 8 packed
documents, alibi + causal, softcap(30) + causal), in one process with calls interleaved:

* forward: rlx vs ``torch.compile(flex_attention)`` with a block mask (torch's fastest CPU path);
* forward + backward: rlx vs torch SDPA with the mask (bool) or ALiBi bias (float) materialised
  as ``[B|1, H|1, S, S]``, the CPU alternative that has a backward (softcap has no SDPA form: its
  row uses the eager math that a user would write, scores materialised);
* block sparsity: at S=4096, sliding_window(256) forward + backward against no mask, both rlx;
* what torch's CPU flex_attention does when asked for a gradient.

rlx reads the same ``[B, H, S, D]`` arrays (``Layout.BHSD``). Also reported: each rlx time as a
fraction of the sgemm rate measured in the same run (FLOPs of the visible scores only).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/flex_attention.py
    python benchmarks/flex_attention.py --quick     # S=1024 only, fewer repetitions

Writes ``benchmarks/results/flex_attention.json``. torch is needed; the first torch.compile of a
case takes ~15 s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import _harness as h  # noqa: E402

import rlx  # noqa: E402
from rlx import Graph, Layout  # noqa: E402
from rlx.codegen import CodegenOptions, compile_graph  # noqa: E402

DEFAULT_JSON = REPO / "benchmarks" / "results" / "flex_attention.json"
HEADS, HEAD_DIM, DOCUMENTS, WINDOW, CAP = 8, 64, 8, 256, 30.0
MODS = ("causal", "sliding_window", "document", "alibi+causal", "softcap+causal")
TARGET_FWD_OVER_FLEX = 1.5
TARGET_TRAIN_OVER_SDPA = 3.0
TARGET_SPARSITY = 6.0


@dataclass(frozen=True)
class Case:
    mod: str
    batch: int
    seq: int

    @property
    def label(self) -> str:
        return f"{self.mod} B{self.batch} S{self.seq}"


def slopes() -> np.ndarray:
    return np.array([2.0 ** (-8.0 * (i + 1) / HEADS) for i in range(HEADS)], dtype=np.float32)


def documents(batch: int, seq: int) -> np.ndarray:
    return np.repeat(np.arange(DOCUMENTS), -(-seq // DOCUMENTS))[None, :seq].repeat(batch, 0).astype(np.int64)


def visible(mod: str, seq: int, doc: np.ndarray) -> np.ndarray:
    """The mask as a bool [B|1, 1, S, S] (True attends)."""
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    if mod == "sliding_window":
        return ((j <= i) & (j >= i - WINDOW))[None, None]
    if mod == "document":
        return (doc[:, :, None] == doc[:, None, :])[:, None]
    if mod == "none":
        return np.ones((1, 1, seq, seq), bool)
    return (j <= i)[None, None]


# ----------------------------------------------------------------------------- rlx


def rlx_mods(mod: str, doc: rlx.Value | None) -> dict[str, Any]:
    m = rlx.mods
    return {
        "none": {},
        "causal": {"mask_mod": m.causal},
        "sliding_window": {"mask_mod": m.sliding_window(WINDOW)},
        "document": {"mask_mod": m.document(doc)},
        "alibi+causal": {"score_mod": m.alibi(slopes()), "mask_mod": m.causal},
        "softcap+causal": {"score_mod": m.softcap(CAP), "mask_mod": m.causal},
    }[mod]


def rlx_graph(case: Case, backward: bool) -> Graph:
    g = Graph("flex")
    shape = (case.batch, HEADS, case.seq, HEAD_DIM)
    q, k, v = (g.input(name, shape) for name in "qkv")
    doc = g.input("doc", (case.batch, case.seq), dtype="int64") if case.mod == "document" else None
    out = g.attention(q, k, v, layout=Layout.BHSD, **rlx_mods(case.mod, doc))
    g.output(out=out)
    if backward:
        dy = g.input("dy", shape)
        dq, dk, dv = rlx.grad(g, out, [q, k, v], dy)
        g.output(dq=dq, dk=dk, dv=dv)
    return g


class RlxCall:
    def __init__(self, case: Case, arrays: dict[str, np.ndarray], backward: bool) -> None:
        graph = rlx_graph(case, backward)
        start = time.perf_counter()
        self.exe = rlx.compile(graph)
        self.compile_s = time.perf_counter() - start
        self.arrays = {name: arrays[name] for name in graph.inputs}

    def setup(self) -> None:
        pass

    def run(self) -> dict[str, np.ndarray]:
        return self.exe(**self.arrays)


# ----------------------------------------------------------------------------- torch


class TorchFlexForward:
    def __init__(self, torch: Any, case: Case, arrays: dict[str, np.ndarray]) -> None:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        self.q, self.k, self.v = (torch.from_numpy(arrays[n]) for n in "qkv")
        doc = torch.from_numpy(arrays["doc"])
        table = torch.from_numpy(slopes())

        def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return q_idx >= kv_idx

        def window(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (q_idx >= kv_idx) & (kv_idx >= q_idx - WINDOW)

        def document(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return doc[b, q_idx] == doc[b, kv_idx]

        def alibi(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return score + table[h] * (kv_idx - q_idx)

        def softcap(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return CAP * torch.tanh(score / CAP)

        mask, self.score_mod = {
            "causal": (causal, None),
            "sliding_window": (window, None),
            "document": (document, None),
            "alibi+causal": (causal, alibi),
            "softcap+causal": (causal, softcap),
        }[case.mod]
        batch = case.batch if case.mod == "document" else None
        self.block_mask = create_block_mask(mask, batch, None, case.seq, case.seq, device="cpu")
        # A fresh dynamo state per case: every case's mods are new closures, and past the
        # recompile limit dynamo would silently run flex_attention's eager (math) path.
        torch._dynamo.reset()
        self.fn = torch.compile(flex_attention, fullgraph=True)
        start = time.perf_counter()
        self.run()
        self.compile_s = time.perf_counter() - start

    def setup(self) -> None:
        pass

    def run(self) -> Any:
        return self.fn(self.q, self.k, self.v, score_mod=self.score_mod, block_mask=self.block_mask)

    def backward_behaviour(self, torch: Any) -> dict[str, str]:
        """What a user meets asking torch's CPU flex_attention for a gradient, eager and compiled."""
        from torch.nn.attention.flex_attention import flex_attention

        found = {}
        for label, fn in (("eager", flex_attention), ("compiled", self.fn)):
            q = self.q.clone().requires_grad_(True)
            try:
                fn(q, self.k, self.v, score_mod=self.score_mod, block_mask=self.block_mask).sum().backward()
                found[label] = "ran"
            except Exception as exc:
                text = str(exc)
                inner = text[text.find("NotImplementedError") :].split("\n")[0] if "NotImplementedError" in text else ""
                found[label] = f"{type(exc).__name__}: {inner or text.splitlines()[0]}"
        return found


class TorchSdpaTraining:
    """Forward + backward with the mask or bias materialised (SDPA), or eager math for softcap."""

    def __init__(self, torch: Any, case: Case, arrays: dict[str, np.ndarray]) -> None:
        self.torch = torch
        self.case = case
        self.leaves = [torch.from_numpy(arrays[n]).requires_grad_(True) for n in "qkv"]
        self.dy = torch.from_numpy(arrays["dy"])
        base = case.mod.split("+")[-1] if "+" in case.mod else case.mod
        mask = torch.from_numpy(visible(base, case.seq, arrays["doc"]))
        if case.mod == "alibi+causal":
            i = torch.arange(case.seq)
            bias = torch.from_numpy(slopes())[:, None, None] * (i[None, :] - i[:, None])[None].float()
            self.attn_mask = torch.where(mask, bias[None], torch.tensor(float("-inf")))
        else:
            self.attn_mask = mask

    def setup(self) -> None:
        for leaf in self.leaves:
            leaf.grad = None

    def run(self) -> Any:
        torch = self.torch
        q, k, v = self.leaves
        if self.case.mod == "softcap+causal":
            scores = (q @ k.transpose(-1, -2)) / HEAD_DIM**0.5
            scores = CAP * torch.tanh(scores / CAP)
            scores = scores.masked_fill(~self.attn_mask, float("-inf"))
            out = torch.softmax(scores, dim=-1) @ v
        else:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.attn_mask)
        out.backward(self.dy)
        return out


# ----------------------------------------------------------------------------- run


def visible_flops(case: Case, arrays: dict[str, np.ndarray], mod: str | None = None) -> float:
    """2·D FLOPs per visible score per GEMM: the forward has 2 GEMMs, the backward 5 (counted apart)."""
    mask = visible(mod or case.mod.split("+")[-1], case.seq, arrays["doc"])
    count = float(np.broadcast_to(mask, (case.batch, 1, case.seq, case.seq)).sum()) * HEADS
    return 2.0 * HEAD_DIM * count


def inputs(case: Case) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shape = (case.batch, HEADS, case.seq, HEAD_DIM)
    arrays = {name: rng.standard_normal(shape, dtype=np.float32) for name in ("q", "k", "v", "dy")}
    arrays["doc"] = documents(case.batch, case.seq)
    return arrays


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def run_case(torch: Any, case: Case, repeat: int, gap: float) -> dict[str, Any]:
    arrays = inputs(case)
    calls: dict[str, h.Timeable] = {
        "rlx_fwd": RlxCall(case, arrays, backward=False),
        "rlx_train": RlxCall(case, arrays, backward=True),
    }
    flex = TorchFlexForward(torch, case, arrays)
    calls["flex_fwd"] = flex
    calls["sdpa_train"] = TorchSdpaTraining(torch, case, arrays)
    mine = calls["rlx_fwd"].run()["out"]  # type: ignore[index]
    error = relative_error(mine, flex.run().numpy())
    trained = calls["rlx_train"].run()
    sdpa = calls["sdpa_train"]
    sdpa.setup()
    sdpa.run()
    grad_error = max(
        relative_error(trained[name], leaf.grad.numpy())  # type: ignore[index]
        for name, leaf in zip(("dq", "dk", "dv"), sdpa.leaves, strict=True)  # type: ignore[attr-defined]
    )
    samples = h.time_interleaved(calls, repeat, gap)
    medians = {name: float(np.median(values)) for name, values in samples.items()}
    flops = visible_flops(case, arrays)
    breakdown = {}
    for name, backward in (("rlx_fwd", False), ("rlx_train", True)):
        graph = rlx_graph(case, backward)
        profiled = compile_graph(graph, options=CodegenOptions(profile=True))
        breakdown[name] = h.attention_breakdown(profiled, {n: arrays[n] for n in graph.inputs})
    return {
        "breakdown": breakdown,
        "case": case.label,
        "mod": case.mod,
        "batch": case.batch,
        "seq": case.seq,
        "samples_s": samples,
        "median_s": medians,
        "fwd_speedup_vs_flex": medians["flex_fwd"] / medians["rlx_fwd"],
        "train_speedup_vs_sdpa": medians["sdpa_train"] / medians["rlx_train"],
        "rlx_fwd_gflops": 2 * flops / medians["rlx_fwd"] / 1e9,
        "rlx_train_gflops": 7 * flops / medians["rlx_train"] / 1e9,
        "max_rel_error_out_vs_flex": error,
        "max_rel_error_grads_vs_sdpa": grad_error,
        "compile_s": {"rlx_fwd": calls["rlx_fwd"].compile_s, "flex_fwd": flex.compile_s},  # type: ignore[attr-defined]
        "torch_flex_backward": flex.backward_behaviour(torch),
    }


def run_sparsity(repeat: int, gap: float) -> dict[str, Any]:
    window, full = Case("sliding_window", 1, 4096), Case("none", 1, 4096)
    arrays = inputs(window)
    calls = {"window": RlxCall(window, arrays, True), "none": RlxCall(full, arrays, True)}
    samples = h.time_interleaved(calls, repeat, gap)
    medians = {name: float(np.median(values)) for name, values in samples.items()}
    return {"seq": 4096, "batch": 1, "median_s": medians, "speedup": medians["none"] / medians["window"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="S=1024 only, 3 repetitions")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--gap", type=float, default=0.02)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("torch is needed for this benchmark (pip install torch)", file=sys.stderr)
        return 1
    threads = rlx.RuntimeConfig().num_threads or h.core_count()
    torch.set_num_threads(threads)
    repeat = 3 if args.quick else args.repeat
    cases = [Case(mod, 4, 1024) for mod in MODS]
    if not args.quick:
        cases += [Case(mod, 2, 2048) for mod in MODS]
    sgemm = h.measure_sgemm(h.RlxOpenBlas(), 2048, threads, 5, args.gap)
    results = []
    for case in cases:
        result = run_case(torch, case, repeat, args.gap)
        results.append(result)
        print(
            f"  {case.label}: fwd {result['fwd_speedup_vs_flex']:.2f}x flex, "
            f"fwd+bwd {result['train_speedup_vs_sdpa']:.2f}x sdpa",
            flush=True,
        )
    sparsity = run_sparsity(repeat, args.gap)
    # The rate is measured before and after the cases; a shared host can slow either: take the better.
    again = h.measure_sgemm(h.RlxOpenBlas(), 2048, threads, 5, args.gap)
    rate = max(sgemm.gflops_multi, again.gflops_multi)
    rows = []
    for r in results:
        m = r["median_s"]
        rows.append(
            [
                r["case"],
                f"{m['rlx_fwd'] * 1e3:.1f}",
                f"{m['flex_fwd'] * 1e3:.1f}",
                f"{r['fwd_speedup_vs_flex']:.2f}x",
                f"{m['rlx_train'] * 1e3:.1f}",
                f"{m['sdpa_train'] * 1e3:.1f}",
                f"{r['train_speedup_vs_sdpa']:.2f}x",
                f"{r['rlx_fwd_gflops'] / rate:.0%}",
                f"{r['rlx_train_gflops'] / rate:.0%}",
                f"{max(r['max_rel_error_out_vs_flex'], r['max_rel_error_grads_vs_sdpa']):.1e}",
            ]
        )
    header = [
        "case (H8 D64)",
        "rlx fwd ms",
        "flex fwd ms",
        "fwd ×",
        "rlx fwd+bwd ms",
        "sdpa fwd+bwd ms",
        "fwd+bwd ×",
        "fwd % sgemm",
        "fwd+bwd % sgemm",
        "max rel err",
    ]
    print()
    print(f"CPU: {h.cpu_model()}, {threads} threads; sgemm {rate:.0f} GFLOP/s (2048³, rlx's OpenBLAS)")
    print(h.markdown_table(header, rows))
    fwd = h.geomean(r["fwd_speedup_vs_flex"] for r in results) or 0.0
    train = h.geomean(r["train_speedup_vs_sdpa"] for r in results) or 0.0
    print()
    print(
        f"forward vs torch.compile(flex_attention): geomean {fwd:.2f}x (target {TARGET_FWD_OVER_FLEX}x: "
        f"{'met' if fwd >= TARGET_FWD_OVER_FLEX else 'missed'})"
    )
    print(
        f"forward+backward vs SDPA with the mask materialised: geomean {train:.2f}x (target "
        f"{TARGET_TRAIN_OVER_SDPA}x: {'met' if train >= TARGET_TRAIN_OVER_SDPA else 'missed'})"
    )
    print(
        f"block sparsity, S=4096 B1 H8: no mask {sparsity['median_s']['none'] * 1e3:.0f} ms, sliding_window(256) "
        f"{sparsity['median_s']['window'] * 1e3:.0f} ms: {sparsity['speedup']:.1f}x (target {TARGET_SPARSITY}x: "
        f"{'met' if sparsity['speedup'] >= TARGET_SPARSITY else 'missed'})"
    )
    print(
        "\nWhere rlx's time goes: the programmable kernels' split of their CPU time (profiling build; "
        "softmax+mask includes the mods, dS the score_mod's derivative)"
    )
    split_rows = []
    for r in results:
        for name, label in (("rlx_fwd", "fwd"), ("rlx_train", "fwd+bwd")):
            split = r["breakdown"][name]
            split_rows.append(
                [r["case"], label, *(f"{split[k]:.0%}" for k in ("blas", "softmax", "softmax_backward", "other"))]
            )
    print(h.markdown_table(["case", "graph", "products", "softmax+mask", "dS", "other"], split_rows))
    for label, text in results[0]["torch_flex_backward"].items():
        print(f"torch's CPU flex_attention backward ({label}): {text}")
    report = {
        "benchmark": "flex_attention",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpu": h.cpu_model(),
        "threads": threads,
        "torch": torch.__version__,
        "git": h.git_revision(REPO),
        "sgemm_gflops": rate,
        "sgemm_gflops_before_after": [sgemm.gflops_multi, again.gflops_multi],
        "cases": results,
        "sparsity": sparsity,
        "geomean_fwd_vs_flex": fwd,
        "geomean_train_vs_sdpa": train,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1, default=float))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
