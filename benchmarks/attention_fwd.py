"""Attention forward: rlx (fixed mask, and the programmable kernel returning LSE) vs torch SDPA forward.

The cases of ``benchmarks/attention_bwd.py`` (B, H, S, D; no mask or causal), float32, 2 threads,
calls interleaved in one process, medians. Each rlx time is also given as a fraction of the sgemm
rate of rlx's OpenBLAS measured in the same run (FLOPs: 2 GEMMs of 2·S·S·D per head, halved for
causal), the figure that travels between machines.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/attention_fwd.py [--quick]

Writes ``benchmarks/results/attention_fwd.json``. torch is needed for its column.
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
from rlx import Graph, Layout, MaskKind  # noqa: E402
from rlx.codegen.executable import compile_graph  # noqa: E402
from rlx.codegen.lower import CodegenOptions  # noqa: E402

DEFAULT_JSON = REPO / "benchmarks" / "results" / "attention_fwd.json"
TARGET_TORCH = 2.0
TARGET_SGEMM = 0.70


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    seq: int
    dim: int
    causal: bool

    @property
    def label(self) -> str:
        return f"B{self.batch} H{self.heads} S{self.seq} D{self.dim} {'causal' if self.causal else 'none'}"

    @property
    def flops(self) -> float:
        full = 4.0 * self.batch * self.heads * self.seq * self.seq * self.dim
        return full / 2 if self.causal else full


CASES = (
    Case(8, 12, 128, 64, False),
    Case(4, 8, 512, 64, False),
    Case(4, 8, 512, 64, True),
    Case(2, 8, 1024, 64, True),
    Case(2, 6, 768, 128, False),
)


class Call:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def setup(self) -> None:
        pass

    def run(self) -> Any:
        return self.fn()


def fixed_graph(case: Case, arrays: dict[str, np.ndarray]) -> Graph:
    g = Graph("fwd")
    q, k, v = (g.input(n, arrays[n].shape) for n in "qkv")
    g.output(out=g.attention(q, k, v, mask=MaskKind.CAUSAL if case.causal else MaskKind.NONE, layout=Layout.BHSD))
    return g


def rlx_fixed(case: Case, arrays: dict[str, np.ndarray]) -> Call:
    exe = rlx.compile(fixed_graph(case, arrays))
    return Call(lambda: exe(**arrays))


def flex_graph(case: Case, arrays: dict[str, np.ndarray]) -> Graph:
    g = Graph("flex_fwd")
    q, k, v = (g.input(n, arrays[n].shape) for n in "qkv")
    mask_mod = rlx.mods.causal if case.causal else None
    out, lse = g.attention(q, k, v, mask_mod=mask_mod, layout=Layout.BHSD, return_lse=True)
    g.output(out=out, lse=lse)
    return g


def rlx_flex(case: Case, arrays: dict[str, np.ndarray]) -> Call:
    exe = rlx.compile(flex_graph(case, arrays))
    return Call(lambda: exe(**arrays))


def same_size_fraction(result: dict[str, Any], name: str, warm: bool = False) -> float:
    """Implementation ``name``'s rate over that of the sgemm of the case's size, both medians of
    the first calls after the gaps (``warm``: of the calls right after them; see
    :class:`_harness.SameSizeSgemm`)."""
    medians = result["warm_median_s" if warm else "median_s"]
    return (result["flops"] / medians[name]) / (result["same_size_sgemm_flops"] / medians["sgemm_same_size"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 repetitions")
    parser.add_argument("--repeat", type=int, default=11)
    parser.add_argument("--gap", type=float, default=0.05)
    h.add_warm_option(parser)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    threads = rlx.RuntimeConfig().num_threads or h.core_count()
    try:
        import torch

        torch.set_num_threads(threads)
    except ImportError:
        torch = None
    repeat = 3 if args.quick else args.repeat
    sgemm = h.measure_sgemm(h.RlxOpenBlas(), 2048, threads, 5, args.gap)
    bandwidth = h.measure_bandwidth()
    ramp = h.measure_wake_ramp(h.RlxOpenBlas(), args.gap)
    results = []
    for case in CASES:
        rng = np.random.default_rng(0)
        shape = (case.batch, case.heads, case.seq, case.dim)
        arrays = {n: rng.standard_normal(shape, dtype=np.float32) for n in "qkv"}
        same_size = h.SameSizeSgemm(h.RlxOpenBlas(), case.flops, threads)
        calls: dict[str, h.Timeable] = {"rlx": rlx_fixed(case, arrays), "rlx_flex_lse": rlx_flex(case, arrays),
                                        "sgemm_same_size": same_size}  # fmt: skip
        if torch is not None:
            tq, tk, tv = (torch.from_numpy(arrays[n]) for n in "qkv")
            sdpa = torch.nn.functional.scaled_dot_product_attention
            calls["torch"] = Call(lambda tq=tq, tk=tk, tv=tv, c=case.causal, f=sdpa: f(tq, tk, tv, is_causal=c))
            want = calls["torch"].run().numpy()
            for name in ("rlx", "rlx_flex_lse"):
                got = calls[name].run()["out"]
                error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
                if error > 1e-4:
                    raise RuntimeError(f"{case.label}: {name} differs from torch by {error:.1e}")
        bursts = h.time_bursts(calls, repeat, args.gap, args.warm)
        same_size.check()
        samples = bursts.cold
        medians = {name: float(np.median(values)) for name, values in samples.items()}
        warm = {name: float(np.median(values)) for name, values in bursts.warm.items() if values}
        profiled = compile_graph(fixed_graph(case, arrays), options=CodegenOptions(profile=True))
        breakdown = h.attention_breakdown(profiled, arrays)
        profiled_flex = compile_graph(flex_graph(case, arrays), options=CodegenOptions(profile=True))
        breakdown_flex = h.attention_breakdown(profiled_flex, arrays)
        blas = None
        if torch is not None:
            products = h.attention_products(case.batch, case.heads, case.seq, case.dim, case.causal, backward=False)
            blas = h.compare_blas(h.RlxOpenBlas(), products, burst=0.02, rounds=3, tiles=True).as_dict()
        nbytes = 4 * arrays["q"].nbytes  # q, k, v read and out written once
        results.append({"case": case.label, "flops": case.flops, "bytes": nbytes, "median_s": medians,
                        "samples_s": samples, "warm_median_s": warm, "warm_samples_s": bursts.warm,
                        "breakdown": breakdown, "breakdown_flex": breakdown_flex,
                        "blas_vs_torch": blas, "same_size_sgemm_flops": same_size.flops})  # fmt: skip
        print(f"  {case.label}: " + ", ".join(f"{n} {m * 1e3:.2f} ms" for n, m in medians.items()), flush=True)
    again = h.measure_sgemm(h.RlxOpenBlas(), 2048, threads, 5, args.gap)
    rate = max(sgemm.gflops_multi, again.gflops_multi)
    rows = []
    for r in results:
        m = r["median_s"]
        torch_s = m.get("torch")
        rows.append([
            r["case"],
            f"{m['rlx'] * 1e3:.2f}",
            f"{m['rlx_flex_lse'] * 1e3:.2f}",
            f"{torch_s * 1e3:.2f}" if torch_s else "-",
            f"{torch_s / m['rlx']:.2f}x" if torch_s else "-",
            f"{torch_s / m['rlx_flex_lse']:.2f}x" if torch_s else "-",
            f"{r['flops'] / m['rlx'] / 1e9 / rate:.0%}",
            f"{r['flops'] / m['rlx_flex_lse'] / 1e9 / rate:.0%}",
            f"{same_size_fraction(r, 'rlx'):.0%}",
            f"{same_size_fraction(r, 'rlx_flex_lse'):.0%}",
        ])  # fmt: skip
    print(f"\nCPU: {h.cpu_model()}, {threads} threads; sgemm {rate:.0f} GFLOP/s (2048³, rlx's OpenBLAS)")
    header = ["case", "rlx ms", "rlx flex+lse ms", "torch ms", "torch/rlx", "torch/flex", "rlx % sgemm", "flex % sgemm",
              "rlx % same-size sgemm", "flex % same-size sgemm"]  # fmt: skip
    print(h.markdown_table(header, rows))
    print(h.SAME_SIZE_NOTE)
    for r in results:
        r["roofline"] = h.roofline(r["flops"], r["bytes"], r["median_s"]["rlx"], rate, bandwidth)
        r["roofline_flex"] = h.roofline(r["flops"], r["bytes"], r["median_s"]["rlx_flex_lse"], rate, bandwidth)
    print(
        f"\nWhere the time goes (rlx fixed): roofline against sgemm {rate:.0f} GFLOP/s and copy bandwidth "
        f"{bandwidth:.1f} GB/s (bytes: q, k, v, out once); the kernel's split of its CPU time (profiling build)"
    )
    print(h.breakdown_table([(r["case"], r["roofline"], r["breakdown"]) for r in results]))
    print("\nThe same for the programmable kernel returning LSE (flex+lse; softmax+mask includes the mask_mod)")
    print(h.breakdown_table([(r["case"], r["roofline_flex"], r["breakdown_flex"]) for r in results]))
    if torch is not None:
        print(
            "\nThe kernel's matrix products (its strips' shapes), each timed on ONE thread in native loops through what"
            " the kernel calls (rlx's register tiles where it takes them, else OpenBLAS), through OpenBLAS alone and"
            " through torch's BLAS (MKL), each operand's rows as far apart as in the kernel, alternating bursts:"
        )
        print(h.blas_table([(r["case"], r["blas_vs_torch"], r["breakdown"]["blas"]) for r in results]))
        summary_blas = h.geomean(r["blas_vs_torch"]["torch_speedup"] for r in results)
        print(f"torch's BLAS runs these products {summary_blas:.2f}x as fast as what rlx's kernel calls (geomean)")
    if args.warm and torch is not None:
        print(f"\n{h.warm_heading(args.warm)}:")
        warm_rows = [[r["case"], f"{r['warm_median_s']['rlx'] * 1e3:.2f}", f"{r['warm_median_s']['torch'] * 1e3:.2f}",
                      f"{r['warm_median_s']['torch'] / r['warm_median_s']['rlx']:.2f}x",
                      f"{r['flops'] / r['warm_median_s']['rlx'] / 1e9 / rate:.0%}",
                      f"{same_size_fraction(r, 'rlx', warm=True):.0%}"] for r in results]  # fmt: skip
        header = ["case", "rlx ms", "torch ms", "torch/rlx", "rlx % sgemm", "rlx % same-size sgemm"]
        print(h.markdown_table(header, warm_rows))
        warm_ratio = h.geomean(r["warm_median_s"]["torch"] / r["warm_median_s"]["rlx"] for r in results)
        warm_fraction = float(np.median([r["flops"] / r["warm_median_s"]["rlx"] / 1e9 / rate for r in results]))
        summary_warm = f"warm: torch/rlx geomean {warm_ratio:.2f}x, rlx sgemm fraction median {warm_fraction:.0%}"
        print(summary_warm, h.WARM_NOT_TARGETS)
        print(f"why the first calls are slower, for every implementation: {ramp.summary()}")
    summary: dict[str, Any] = {}
    if torch is not None:
        summary["geomean_torch_over_rlx"] = h.geomean(r["median_s"]["torch"] / r["median_s"]["rlx"] for r in results)
        summary["geomean_torch_over_flex"] = h.geomean(
            r["median_s"]["torch"] / r["median_s"]["rlx_flex_lse"] for r in results
        )
    summary["median_sgemm_fraction"] = float(
        np.median([r["flops"] / r["median_s"]["rlx"] / 1e9 / rate for r in results])
    )
    summary["median_sgemm_fraction_flex"] = float(
        np.median([r["flops"] / r["median_s"]["rlx_flex_lse"] / 1e9 / rate for r in results])
    )
    for key, value in summary.items():
        target = TARGET_TORCH if "torch" in key else TARGET_SGEMM
        print(f"{key}: {value:.2f} (target {target}: {'met' if value >= target else 'missed'})")
    for name, key in (("rlx", "median_same_size_fraction"), ("rlx_flex_lse", "median_same_size_fraction_flex")):
        summary[key] = float(np.median([same_size_fraction(r, name) for r in results]))
        print(f"{key}: {summary[key]:.2f} (of an sgemm of the same FLOPs timed alike; no target)")
    if torch is not None:
        # What torch/rlx would read if rlx ran every FLOP at the measured sgemm rate: a ceiling
        # for any kernel that computes these products on this BLAS.
        ceilings = [r["median_s"]["torch"] / (r["flops"] / (rate * 1e9)) for r in results]
        best, lowest = h.geomean(ceilings), min(ceilings)
        print(
            "ceiling: torch / (FLOPs at the measured sgemm rate), what torch/rlx would read at 100% of it: "
            f"geomean {best:.2f}x, lowest {lowest:.2f}x"
        )
        summary.update(torch_over_sgemm_bound_geomean=best, torch_over_sgemm_bound_lowest=lowest)
    report = {
        "benchmark": "attention_fwd",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpu": h.cpu_model(),
        "threads": threads,
        "sgemm_gflops": rate,
        "bandwidth_gbs": bandwidth,
        "wake_ramp": ramp.as_dict(),
        "git": h.git_revision(REPO),
        "cases": results,
        **summary,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1, default=float))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
