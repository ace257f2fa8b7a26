"""The ``rlx`` command line: ``rlx opt`` transforms textual IR, ``rlx demo`` runs the main job.

``rlx opt FILE -p fuse-attention-bwd,dce`` works like ``mlir-opt``/``xdsl-opt``: the final IR goes
to stdout, ``--print-after-all`` dumps and ``--timings`` go to stderr, so stdout can be piped.
Errors print one line on stderr and exit with status 1, never a traceback.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

import numpy as np

import rlx
from rlx.errors import RlxError
from rlx.ir import Graph, Layout, MaskKind, OpKind, parse

# ----------------------------------------------------------------------------- rlx opt


def run_opt(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Parse, transform and print (or lower) one textual-IR file."""
    text = sys.stdin.read() if args.file == "-" else _read(args.file)
    graph = parse(text)
    timings: dict[str, float] = {}
    if args.passes is None:
        args.passes = []
        print(
            "rlx opt: no -p given: ran no passes, the graph is printed as parsed "
            f"(-p default runs the default pipeline, {','.join(rlx.passes.DEFAULT_PIPELINE)})",
            file=err,
        )
    elif args.passes == ["default"]:
        args.passes = list(rlx.passes.DEFAULT_PIPELINE)
    rlx.passes.run(graph, args.passes, print_after_all=err if args.print_after_all else False, timings=timings)
    if args.timings:
        print_timings(timings, err)
    if args.emit == "llvm":
        print(emit_llvm(graph), file=out)
    else:
        print(graph, file=out)
    return 0


def emit_llvm(graph: Graph) -> str:
    """The LLVM IR module the code generator builds for ``graph`` exactly as given.

    ``passes=[]``: ``rlx opt`` has already run the passes the user asked for, and no others.
    """
    try:
        from rlx.codegen import emit_llvm_ir
    except ImportError as exc:
        raise CliError(f"--emit llvm needs the code generator (rlx.codegen.emit_llvm_ir): {exc}") from exc
    return str(emit_llvm_ir(graph, passes=[]))


def print_timings(timings: Mapping[str, float], stream: TextIO) -> None:
    width = max((len(name) for name in timings), default=4)
    print(f"{'pass':<{width}}  time (ms)", file=stream)
    for name, seconds in timings.items():
        print(f"{name:<{width}}  {seconds * 1e3:9.3f}", file=stream)


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {path}: {exc.strerror if isinstance(exc, OSError) else exc}") from exc


def _pass_list(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


# ----------------------------------------------------------------------------- rlx demo


def build_demo_graph(batch: int, heads: int, seq: int, dim: int) -> Graph:
    """Causal BSHD forward attention plus ``rlx.grad`` w.r.t. q, k and v (three single-wrt nodes)."""
    g = Graph("attention_block")
    shape = (batch, seq, heads, dim)
    q, k, v, dy = (g.input(name, shape) for name in ("q", "k", "v", "dy"))
    out = g.attention(q, k, v, mask=MaskKind.CAUSAL, layout=Layout.BSHD)
    dq, dk, dv = rlx.grad(g, out, [q, k, v], dy)
    g.output(out=out, dq=dq, dk=dk, dv=dv)
    return g


def demo_inputs(graph: Graph, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(value.static_shape).astype(np.float32) for name, value in graph.inputs.items()}


def max_abs_diff(got: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray]) -> float:
    return max(float(np.max(np.abs(got[name].astype(np.float64) - expected[name]))) for name in expected)


def finite_difference_error(
    arrays: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray], samples: int, seed: int
) -> float:
    """Worst ``|grad - fd| / (1 + |fd|)`` over sampled entries of dq, dk, dv.

    ``fd`` is a central difference of ``sum(attention(q, k, v) * dy)`` with the float64 reference
    forward, so it checks the gradients against the forward itself, not against another backward.
    An entry of head (b, h) only moves that head's output, so the loss is taken over that head.
    """
    from rlx.reference import attention_forward

    base = {name: np.asarray(array, dtype=np.float64) for name, array in arrays.items()}
    rng = np.random.default_rng(seed + 1)
    eps, worst = 1e-4, 0.0
    for name in ("q", "k", "v"):
        for _ in range(samples):
            index = tuple(int(rng.integers(size)) for size in base[name].shape)
            b, h = index[0], index[2]
            head = {key: base[key][b : b + 1, :, h : h + 1, :] for key in ("q", "k", "v", "dy")}
            local = (0, index[1], 0, index[3])
            shifted = {}
            for sign in (1.0, -1.0):
                moved = head[name].copy()
                moved[local] += sign * eps
                operands = {**head, name: moved}
                out = attention_forward(operands["q"], operands["k"], operands["v"], mask=MaskKind.CAUSAL)
                shifted[sign] = float(np.sum(out * head["dy"]))
            fd = (shifted[1.0] - shifted[-1.0]) / (2 * eps)
            worst = max(worst, abs(float(grads["d" + name][index]) - fd) / (1.0 + abs(fd)))
    return worst


def _median_times(runs: Mapping[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Median seconds per callable, calls interleaved so machine noise hits all alike."""
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeat):
        for name, call in runs.items():
            start = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - start)
    return {name: float(np.median(times)) for name, times in samples.items()}


def run_demo(args: argparse.Namespace, out: TextIO) -> int:
    """Build, differentiate, fuse, compile, run and check; 0 when every check passes."""
    from rlx.reference import evaluate

    graph = build_demo_graph(args.batch, args.heads, args.seq, args.dim)
    print(f"== forward + rlx.grad: B={args.batch} H={args.heads} S={args.seq} D={args.dim}, causal, bshd", file=out)
    print(graph, file=out)

    start = time.perf_counter()
    fused = rlx.compile(graph)
    compile_fused = time.perf_counter() - start
    start = time.perf_counter()
    unfused = rlx.compile(graph, passes=[])
    compile_unfused = time.perf_counter() - start
    print(f"\n== after {', '.join(rlx.passes.DEFAULT_PIPELINE)} (the graph rlx compiled)", file=out)
    print(fused.graph, file=out)
    print(f"attention_bwd nodes: {_count_bwd(graph)} -> {_count_bwd(fused.graph)}", file=out)

    arrays = demo_inputs(graph, args.seed)
    start = time.perf_counter()
    expected = evaluate(graph, arrays)  # the oracle: the unfused graph on the float64 reference
    reference_time = time.perf_counter() - start
    results = {"rlx fused": fused(**arrays), "rlx unfused": unfused(**arrays)}
    times = _median_times(
        {"rlx fused": functools.partial(fused, **arrays), "rlx unfused": functools.partial(unfused, **arrays)},
        args.repeat,
    )
    errors = {name: max_abs_diff(got, expected) for name, got in results.items()}
    fd_error = finite_difference_error(arrays, results["rlx fused"], args.samples, args.seed)

    scale = max(float(np.max(np.abs(array))) for array in expected.values())
    tolerance = 1e-4 * max(1.0, scale)
    print(
        f"\n== results ({fused.threads} threads, median of {args.repeat} interleaved calls, seed {args.seed})", file=out
    )
    print(f"{'':<22}{'time (ms)':>11}{'max |err| vs reference':>26}", file=out)
    for name in ("rlx fused", "rlx unfused"):
        print(f"{name:<22}{times[name] * 1e3:>11.2f}{errors[name]:>26.2e}", file=out)
    print(f"{'reference (float64)':<22}{reference_time * 1e3:>11.2f}{'-':>26}", file=out)
    print(
        f"fused speed-up over unfused: {times['rlx unfused'] / times['rlx fused']:.2f}x; "
        f"compile: fused {compile_fused * 1e3:.0f} ms, unfused {compile_unfused * 1e3:.0f} ms",
        file=out,
    )
    fd_ok = fd_error <= 1e-3
    errors_ok = all(error <= tolerance for error in errors.values())
    print(
        f"gradients vs central differences ({3 * args.samples} entries): worst error {fd_error:.2e}  "
        f"{'ok' if fd_ok else 'MISMATCH'}",
        file=out,
    )
    print(f"compiled vs reference (tolerance {tolerance:.1e}): {'ok' if errors_ok else 'MISMATCH'}", file=out)
    return 0 if errors_ok and fd_ok else 1


def run_lm_demo(args: argparse.Namespace, out: TextIO) -> int:
    """Train the tiny char LM; 0 when its loss fell below the uniform guess."""
    from rlx.demo_lm import default_text, train

    if args.data is not None:
        text, source = _read(args.data), args.data
    else:
        text, source = default_text()
    heads = args.heads or 4
    if args.embed % heads:
        raise CliError(f"--embed {args.embed} must be a multiple of --heads {heads}")
    final = train(
        text,
        source,
        args.steps,
        args.batch or 16,
        args.seq or 64,
        args.embed,
        heads,
        args.layers,
        args.lr,
        args.seed,
        out,
    )
    return 0 if final < math.log(len(set(text))) else 1


def _count_bwd(graph: Graph) -> int:
    return sum(node.op is OpKind.ATTENTION_BWD for node in graph.nodes)


# ----------------------------------------------------------------------------- main


class CliError(RlxError):
    """A command-line problem (unreadable file, missing code generator): message, exit 1."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlx", description="Graph-IR compiler for ML models.")
    parser.add_argument("--version", action="version", version=f"rlx {rlx.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    opt = commands.add_parser("opt", help="run passes on a textual-IR file and print the result")
    opt.add_argument("file", metavar="FILE", help="textual IR, or - for stdin")
    opt.add_argument(
        "-p",
        "--passes",
        type=_pass_list,
        default=None,
        help=f"comma-separated passes, from: {', '.join(rlx.passes.PASSES)}; or 'default' for the default "
        f"pipeline ({','.join(rlx.passes.DEFAULT_PIPELINE)}). Without -p no pass runs (and stderr says so)",
    )
    opt.add_argument("--print-after-all", action="store_true", help="print the IR after each pass that changed it")
    opt.add_argument("--timings", action="store_true", help="print the time each pass took")
    opt.add_argument("--emit", choices=("ir", "llvm"), default="ir", help="print textual IR (default) or LLVM IR")

    demo = commands.add_parser(
        "demo",
        help="attention forward -> grad -> fuse -> run -> check; with --lm, train a tiny char LM",
        description="Without --lm: build causal attention, differentiate, fuse, compile, run, and check against "
        "the reference and finite differences (defaults B=4 H=8 S=512 D=64). With --lm: train a 2-block "
        "character-level transformer LM on a text file with AdamW (defaults batch 16, S=64, E=64, 4 heads).",
    )
    demo.add_argument("--lm", action="store_true", help="train the tiny character-level LM instead")
    # The LM's own options imply --lm (``rlx demo --data book.txt`` means: train on it).
    demo.add_argument("--data", metavar="PATH", help="text file to train the LM on (default: the project's README)")
    demo.add_argument("--steps", type=_positive, default=None, help="LM training steps (default 300)")
    demo.add_argument("--lr", type=_learning_rate, default=None, help="LM peak learning rate (default 3e-3)")
    demo.add_argument("--layers", type=_positive, default=None, help="LM transformer blocks (default 2)")
    demo.add_argument("--embed", type=_positive, default=None, help="LM embedding size (default 64)")
    demo.add_argument("--batch", type=_positive, default=None, help="batch size (default 4; LM 16)")
    demo.add_argument("--heads", type=_positive, default=None, help="attention heads (default 8; LM 4)")
    demo.add_argument("--seq", type=_positive, default=None, help="sequence length (default 512; LM 64)")
    demo.add_argument("--dim", type=_positive, default=64, help="attention head dim (default 64)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.add_argument(
        "--samples", type=_positive, default=4, help="finite-difference entries checked per gradient (default 4)"
    )
    demo.add_argument("--repeat", type=_positive, default=9, help="timed calls of each executable (default 9)")
    return parser


LM_DEFAULTS = {"data": None, "steps": 300, "lr": 3e-3, "layers": 2, "embed": 64}  # options only the LM takes


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _learning_rate(text: str) -> float:
    """A positive, finite float (torch's AdamW refuses a negative one too)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rlx`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "opt":
            return run_opt(args, sys.stdout, sys.stderr)
        if args.lm or any(getattr(args, name) is not None for name in LM_DEFAULTS):
            for name, default in LM_DEFAULTS.items():
                setattr(args, name, default if getattr(args, name) is None else getattr(args, name))
            return run_lm_demo(args, sys.stdout)
        args.batch, args.heads, args.seq = args.batch or 4, args.heads or 8, args.seq or 512
        return run_demo(args, sys.stdout)
    except RlxError as exc:
        print(f"rlx {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
