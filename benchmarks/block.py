"""A pre-norm transformer block, forward and backward: rlx against torch eager and torch.compile.

The loss is ``mean(y * y)`` of the block's output; every implementation computes it and its
gradients w.r.t. x and all seven weights, in float32 on the same inputs, on the same threads.
Calls are interleaved (``_harness.time_interleaved``) and medians compared in one run. Also
measured: build + grad + cold compile of each rlx graph (the largest one in a fresh process), a
cached compile, peak extra memory of one call, kernels against nodes, where rlx's time goes
(a profiling build: BLAS, fused loops, attention) and the sgemm rate of rlx's OpenBLAS.

    python benchmarks/block.py            # all shapes; writes benchmarks/results/block.json
    python benchmarks/block.py --quick    # the smallest shape, few repetitions, no torch.compile

torch is needed (``pip install torch``); torch.compile's first compile takes ~25 s a shape.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import _harness as h  # noqa: E402

import rlx  # noqa: E402
from rlx.models import BLOCK_WEIGHTS, block_training_graph, block_weight_shapes, mlp_hidden  # noqa: E402

SHAPES = [(8, 128, 256, 4), (4, 512, 512, 8), (2, 1024, 768, 12)]  # (B, S, E, H)
DEFAULT_JSON = REPO / "benchmarks" / "results" / "block.json"
NAMES = ["x", *BLOCK_WEIGHTS]


build_block = block_training_graph


def block_arrays(batch: int, seq: int, embed: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {"x": rng.standard_normal((batch, seq, embed), dtype=np.float32)}
    for name, shape in block_weight_shapes(embed).items():
        if name.endswith("norm"):
            arrays[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            arrays[name] = (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
    return arrays


def torch_loss(torch: Any, t: dict[str, Any], heads: int) -> Any:
    """The same block in torch: RMSNorm, fused QKV, SDPA (causal), output projection, SwiGLU."""

    def rms(x: Any, weight: Any) -> Any:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    x = t["x"]
    batch, seq, embed = x.shape
    q, k, v = (rms(x, t["attn_norm"]) @ t["wqkv"]).split(embed, dim=-1)
    heads_view = [z.reshape(batch, seq, heads, embed // heads).transpose(1, 2) for z in (q, k, v)]
    att = torch.nn.functional.scaled_dot_product_attention(*heads_view, is_causal=True)
    h_ = x + att.transpose(1, 2).reshape(batch, seq, embed) @ t["wo"]
    n = rms(h_, t["mlp_norm"])
    y = h_ + (torch.nn.functional.silu(n @ t["w1"]) * (n @ t["w3"])) @ t["w2"]
    return (y * y).mean()


def block_flops(batch: int, seq: int, embed: int, heads: int) -> dict[str, float]:
    """FLOPs of the block's forward + backward: the matmuls (each 3x: forward, dX, dW) and causal
    attention (forward 2 and backward 5 products of S x S x D per head, half of them masked)."""
    tokens, hidden = batch * seq, mlp_hidden(embed)
    matmul = 3 * 2 * tokens * embed * (3 * embed + embed + 3 * hidden)
    attention = 7 * batch * heads * seq * seq * (embed // heads)
    return {"matmul": float(matmul), "attention": float(attention)}


class Call:
    """A ``_harness.Timeable``: ``run`` computes the loss and the eight gradients."""

    def __init__(self, run: Callable[[], object]) -> None:
        self.run = run

    def setup(self) -> None:
        pass


def cold_compile_in_fresh_process(shape: tuple[int, int, int, int]) -> dict[str, float]:
    """Build + grad + compile in a new interpreter (no in-process cache; disk cache off)."""
    bench_dir = str(REPO / "benchmarks")
    code = "\n".join(
        [
            f"import time, json, sys; sys.path.insert(0, {bench_dir!r})",
            "t0 = time.perf_counter(); import rlx; from block import build_block",
            f"t1 = time.perf_counter(); g = build_block(*{shape!r})",
            "t2 = time.perf_counter(); exe = rlx.compile(g); t3 = time.perf_counter()",
            "print(json.dumps({'import': t1 - t0, 'build_grad': t2 - t1, 'compile': t3 - t2, "
            "'phases': dict(exe.compile_times)}))",
        ]
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RLX_DISK_CACHE", "RLX_CACHE_DIR")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory_in_fresh_process(impl: str, shape: tuple[int, int, int, int], threads: int) -> int | None:
    """Extra peak RSS of the first call (loss and all gradients) in a new interpreter, in bytes.

    Fresh, so that neither side reuses memory a previous call left in the heap: rlx's count holds
    its arena and output arrays, torch's the activations it saves for backward and its gradients.
    """
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--probe-memory",
            impl,
            "--probe-shape",
            ",".join(map(str, shape)),
            "--threads",
            str(threads),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    value = json.loads(out.stdout.strip().splitlines()[-1])["peak_extra_bytes"]
    return None if value is None else int(value)


def run_memory_probe(impl: str, shape: tuple[int, int, int, int], threads: int) -> int:
    batch, seq, embed, heads = shape
    arrays = block_arrays(batch, seq, embed)
    if impl == "rlx":
        exe = rlx.compile(build_block(*shape), config=rlx.RuntimeConfig(num_threads=threads))
        peak, _ = h.extra_peak_bytes(lambda: exe(**arrays))
    else:
        import torch

        torch.set_num_threads(threads)
        tensors = {name: torch.from_numpy(a.copy()).requires_grad_(True) for name, a in arrays.items()}
        peak, _ = h.extra_peak_bytes(
            lambda: torch.autograd.grad(torch_loss(torch, tensors, heads), [tensors[n] for n in NAMES])
        )
    print(json.dumps({"peak_extra_bytes": peak}))
    return 0


def profile_breakdown(graph: rlx.Graph, arrays: dict[str, np.ndarray], threads: int) -> dict[str, float]:
    """Seconds per kernel kind (BLAS matmul, fused loops, attention) from a profiling build (best of 3)."""
    from rlx.codegen import CodegenOptions, compile_graph  # here: the cold-compile probe times its import

    exe = compile_graph(graph, config=rlx.RuntimeConfig(num_threads=threads), options=CodegenOptions(profile=True))
    runs = [exe.profile(**arrays) for _ in range(3)]
    kinds: dict[str, float] = {}
    for index, (info, _) in enumerate(runs[0]):
        seconds = min(run[index][1] for run in runs)
        kind = (
            "fused loops" if info.name.startswith("fused") else ("BLAS matmul" if info.name == "matmul" else info.name)
        )
        kinds[kind] = kinds.get(kind, 0.0) + seconds
    return kinds


def swaps_last_axes(value: rlx.Value) -> bool:
    """Whether ``value`` is a ``transpose`` of its last two axes (a matmul operand BLAS transposes)."""
    if value.node.op is not rlx.OpKind.TRANSPOSE:
        return False
    perm = tuple(value.node.attrs.perm)
    return perm[-2:] == (len(perm) - 1, len(perm) - 2)


def matmul_products(graph: rlx.Graph) -> list[h.Product]:
    """The matrix products of a compiled graph's ``matmul`` nodes, with the transposes BLAS is told
    of (an operand that is a ``transpose`` of its last two axes), equal ones counted together. A
    batch of rows times one matrix is one product of all the rows, as both libraries run it."""
    counts: dict[tuple[int, int, int, bool, bool], int] = {}
    for node in graph.nodes:
        if node.op is not rlx.OpKind.MATMUL:
            continue
        a, b = node.inputs
        out = node.outputs[0].static_shape
        m, k = a.static_shape[-2:]
        n = b.static_shape[-1]
        trans_a, trans_b = swaps_last_axes(a), swaps_last_axes(b)
        batch = int(np.prod(out[:-2], dtype=np.int64))
        if len(b.static_shape) == 2 and not trans_a:
            m, batch = m * batch, 1
        key = (m, n, k, trans_a, trans_b)
        counts[key] = counts.get(key, 0) + batch
    return [h.Product(m, n, k, ta, tb, count) for (m, n, k, ta, tb), count in counts.items()]


def run_shape(shape: tuple[int, int, int, int], args: argparse.Namespace, torch: Any) -> dict[str, Any]:
    batch, seq, embed, heads = shape
    start = time.perf_counter()
    graph = build_block(batch, seq, embed, heads)
    build_s = time.perf_counter() - start
    config = rlx.RuntimeConfig(num_threads=args.threads)
    start = time.perf_counter()
    exe = rlx.compile(graph, config=config)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    rlx.compile(graph, config=config)
    cached_s = time.perf_counter() - start
    arrays = block_arrays(batch, seq, embed)

    tensors = {name: torch.from_numpy(a.copy()).requires_grad_(True) for name, a in arrays.items()}

    def eager() -> object:
        return torch.autograd.grad(torch_loss(torch, tensors, heads), [tensors[n] for n in NAMES])

    calls: dict[str, Call] = {"rlx": Call(lambda: exe(**arrays)), "torch eager": Call(eager)}
    # The torch function itself under torch.compile with rlx's TorchDynamo backend: the route of
    # a torch user who changes nothing but the backend.
    import rlx.torch.dynamo as rlx_dynamo

    eager_before = rlx_dynamo.stats["eager"]
    backend_fn = torch.compile(lambda t: torch_loss(torch, t, heads), backend="rlx", dynamic=False)

    def via_backend() -> object:
        return torch.autograd.grad(backend_fn(tensors), [tensors[n] for n in NAMES])

    start = time.perf_counter()
    via_backend()
    backend_first = time.perf_counter() - start
    if rlx_dynamo.stats["eager"] != eager_before:
        raise RuntimeError(f"the rlx backend left the block to eager torch: {rlx_dynamo.fallbacks}")
    calls["rlx backend"] = Call(via_backend)
    compiled_warmup = None
    if not args.no_compile:
        compiled_fn = torch.compile(lambda t: torch_loss(torch, t, heads))

        def compiled() -> object:
            return torch.autograd.grad(compiled_fn(tensors), [tensors[n] for n in NAMES])

        start = time.perf_counter()
        compiled()
        compiled_warmup = time.perf_counter() - start
        calls["torch.compile"] = Call(compiled)

    got = exe(**arrays)
    want = eager()
    through_backend = via_backend()
    errors = {}
    for name, grad, other in zip(NAMES, want, through_backend, strict=True):
        ref = grad.numpy()
        scale = max(1e-30, float(np.max(np.abs(ref))))
        errors[name] = float(np.max(np.abs(got[f"d_{name}"] - ref)) / scale)
        errors[f"{name} (backend)"] = float(np.max(np.abs(other.numpy() - ref)) / scale)
    worst = max(errors.values())
    if worst > 1e-3:
        raise RuntimeError(f"rlx and torch disagree on {shape}: relative errors {errors}")
    for call in calls.values():
        call.run()  # warm-up
    bursts = h.time_bursts(calls, args.repeat, args.gap, args.warm)
    stats = {name: h.Stats.of(s) for name, s in bursts.cold.items()}
    warm = {name: float(np.median(s)) for name, s in bursts.warm.items() if s}
    memory = {}
    if not args.no_memory:
        for name in ("rlx", "torch eager"):
            memory[name] = memory_in_fresh_process(name, shape, args.threads)
    breakdown = (
        profile_breakdown(graph, arrays, args.threads)
        if shape == max(SHAPES, key=lambda s: s[0] * s[1] * s[2]) or args.profile_all
        else None
    )
    blas = h.compare_blas(h.RlxOpenBlas(), matmul_products(exe.graph))
    flops = block_flops(batch, seq, embed, heads)
    bound = (flops["matmul"] + flops["attention"]) / (args.sgemm_gflops * 1e9)
    return {
        "shape": {"B": batch, "S": seq, "E": embed, "H": heads, "hidden": mlp_hidden(embed)},
        "flops": flops,
        "sgemm_bound_s": bound,
        "best_possible_speedup_vs_eager": stats["torch eager"].median / bound,
        "best_possible_speedup_vs_compile": stats["torch.compile"].median / bound if "torch.compile" in stats else None,
        "build_grad_s": build_s,
        "compile_s": compile_s,
        "cached_compile_s": cached_s,
        "kernels": len(exe.kernels),
        "nodes": len(exe.graph),
        "graph_nodes_built": len(graph),
        "median_s": {name: s.median for name, s in stats.items()},
        "min_s": {name: s.minimum for name, s in stats.items()},
        "samples_s": {name: list(s.samples) for name, s in stats.items()},
        "speedup_vs": {name: stats[name].median / stats["rlx"].median for name in stats if name != "rlx"},
        "warm_median_s": warm,
        "warm_samples_s": bursts.warm,
        "warm_speedup_vs": {name: warm[name] / warm["rlx"] for name in warm if name != "rlx"},
        "peak_extra_bytes": memory,
        "torch_compile_first_call_s": compiled_warmup,
        "rlx_backend_first_call_s": backend_first,
        "max_rel_error_vs_torch": worst,
        "breakdown_s": breakdown,
        "matmuls_one_thread_s": {"rlx OpenBLAS": blas.openblas_s, "torch BLAS": blas.torch_s},
        "matmuls_vs_torch_blas": blas.as_dict(),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smallest shape, 3 repetitions, no torch.compile")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gap", type=float, default=0.05)
    h.add_warm_option(parser)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (its first compile is slow)")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--profile-all", action="store_true", help="time breakdown for every shape")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--probe-memory", choices=("rlx", "torch eager"), help=argparse.SUPPRESS)
    parser.add_argument("--probe-shape", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeat, args.no_compile = 3, True
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.probe_memory:
        shape = tuple(int(part) for part in args.probe_shape.split(","))
        return run_memory_probe(args.probe_memory, shape, args.threads)  # type: ignore[arg-type]
    import torch

    torch.set_num_threads(args.threads)
    shapes = SHAPES[:1] if args.quick else SHAPES
    blas = h.RlxOpenBlas()
    sgemm = h.measure_sgemm(blas, 1024, args.threads, 3, 0.05)
    print(
        f"CPU: {h.cpu_model()}, {h.core_count()} cores; threads {args.threads}; torch {torch.__version__}; "
        f"rlx OpenBLAS ({blas.corename()}) sgemm 1024^3: {sgemm.gflops_multi:.0f} GFLOP/s on {args.threads} threads"
    )
    args.sgemm_gflops = sgemm.gflops_multi
    results = [run_shape(shape, args, torch) for shape in shapes]
    largest = max(shapes, key=lambda s: s[0] * s[1] * s[2])
    cold = cold_compile_in_fresh_process(largest)

    header = [
        "B,S,E,H",
        "rlx ms",
        "eager ms",
        "compile ms",
        "eager/rlx",
        "compile/rlx",
        "rlx backend ms",
        "eager/backend",
        "sgemm-bound ms",
        "rlx / bound",
        "kernels/nodes",
        "rlx MiB",
        "eager MiB",
        "compile s",
        "matmuls 1 thr: OpenBLAS / torch ms",
    ]
    rows = []
    for r in results:
        s = r["shape"]
        med = r["median_s"]
        mem = r["peak_extra_bytes"]
        rows.append(
            [
                f"{s['B']},{s['S']},{s['E']},{s['H']}",
                f"{med['rlx'] * 1e3:.1f}",
                f"{med['torch eager'] * 1e3:.1f}",
                f"{med['torch.compile'] * 1e3:.1f}" if "torch.compile" in med else "-",
                f"{r['speedup_vs']['torch eager']:.2f}x",
                f"{r['speedup_vs']['torch.compile']:.2f}x" if "torch.compile" in r["speedup_vs"] else "-",
                f"{med['rlx backend'] * 1e3:.1f}",
                f"{med['torch eager'] / med['rlx backend']:.2f}x",
                f"{r['sgemm_bound_s'] * 1e3:.1f}",
                f"{med['rlx'] / r['sgemm_bound_s']:.2f}x",
                f"{r['kernels']}/{r['nodes']}",
                f"{mem['rlx'] / 2**20:.0f}" if mem.get("rlx") is not None else "-",
                f"{mem['torch eager'] / 2**20:.0f}" if mem.get("torch eager") is not None else "-",
                f"{r['compile_s']:.2f}",
                "{rlx OpenBLAS:.0f} / {torch BLAS:.0f}".format_map(
                    {k: v * 1e3 for k, v in r["matmuls_one_thread_s"].items()}
                ),
            ]
        )
    print()
    print(h.markdown_table(header, rows))
    eager = h.geomean(r["speedup_vs"]["torch eager"] for r in results)
    compiled = h.geomean(r["speedup_vs"].get("torch.compile", 0) for r in results)
    compile_room = (
        f", torch.compile {h.geomean(r['best_possible_speedup_vs_compile'] for r in results):.2f}x"
        if all(r["best_possible_speedup_vs_compile"] for r in results)
        else ""
    )
    print(
        "\nsgemm-bound: the block's matmul and causal-attention FLOPs at the sgemm rate measured above, the"
        " least time an implementation on this BLAS can take. Against it torch eager leaves room for at most"
        f" {h.geomean(r['best_possible_speedup_vs_eager'] for r in results):.2f}x (geometric mean){compile_room}."
        "\nmatmuls 1 thr: the block's matrix products (the matmul nodes, not attention), each timed on one"
        " thread in native loops through rlx's OpenBLAS and torch's BLAS (MKL), alternating bursts: torch's BLAS"
        f" runs them {h.geomean(r['matmuls_vs_torch_blas']['torch_speedup'] for r in results):.2f}x"
        " as fast (geometric mean)."
        f"\ngeometric mean speed-up: vs torch eager {eager:.2f}x (target 1.5x)"
        + (f", vs torch.compile {compiled:.2f}x (target 1.2x)" if compiled else "")
        + '\nrlx backend: the torch function under torch.compile(backend="rlx") (TorchDynamo\'s graph'
        " translated to rlx), the route of a torch user who changes only the backend: torch eager / it"
        f" {h.geomean(r['median_s']['torch eager'] / r['median_s']['rlx backend'] for r in results):.2f}x"
        " (geometric mean)"
    )
    if args.warm:
        warm_rows = [
            [f"{r['shape']['B']},{r['shape']['S']},{r['shape']['E']},{r['shape']['H']}"]
            + [f"{r['warm_median_s'][name] * 1e3:.1f}" for name in r["warm_median_s"]]
            + [f"{x:.2f}x" for x in r["warm_speedup_vs"].values()]
            for r in results
        ]
        names = list(results[0]["warm_median_s"])
        header_warm = ["B,S,E,H", *(f"{n} ms" for n in names), *(f"{n}/rlx" for n in names if n != "rlx")]
        print(f"\n{h.warm_heading(args.warm)}:")
        print(h.markdown_table(header_warm, warm_rows))
        print(
            "warm geometric mean speed-up: "
            + ", ".join(
                f"vs {n} {h.geomean(r['warm_speedup_vs'][n] for r in results):.2f}x" for n in names if n != "rlx"
            )
            + f" {h.WARM_NOT_TARGETS}"
        )
    print(
        f"largest shape {largest}: build + grad {cold['build_grad']:.2f} s + cold compile {cold['compile']:.2f} s "
        f"in a fresh process (target under 2 s together; import {cold['import']:.2f} s); "
        f"cached compile {results[-1]['cached_compile_s'] * 1e3:.2f} ms (target under 5 ms)"
    )
    for r in results:
        if r["breakdown_s"]:
            total = sum(r["breakdown_s"].values())
            parts = ", ".join(
                f"{k} {v * 1e3:.1f} ms ({v / total:.0%})"
                for k, v in sorted(r["breakdown_s"].items(), key=lambda kv: -kv[1])
            )
            s = r["shape"]
            print(f"where rlx's time goes at B={s['B']} S={s['S']} E={s['E']} H={s['H']}: {parts}")
    report = {
        "machine": {
            "cpu": h.cpu_model(),
            "cores": h.core_count(),
            "threads": args.threads,
            "openblas_core": blas.corename(),
            "sgemm_gflops": sgemm.gflops_multi,
            "env_openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
        },
        "versions": {"torch": torch.__version__, "numpy": np.__version__},
        "git": h.git_revision(REPO),
        "date": time.strftime("%Y-%m-%d"),
        "results": results,
        "cold_compile_largest": cold,
        "geomean_speedup": {"torch eager": eager, "torch.compile": compiled},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
