"""The rlx command line: ``opt`` (golden output, dumps, errors) and ``demo`` (end to end)."""

from __future__ import annotations

import io
import subprocess
import sys
import types
from pathlib import Path
from textwrap import dedent

import numpy as np
import pytest

import rlx
import rlx.codegen
from rlx import cli

SOURCE = dedent(
    """\
    graph @attn {
      %q = input "q" : f32[2,6,2,4]
      %k = input "k" : f32[2,6,2,4]
      %v = input "v" : f32[2,6,2,4]
      %dy = input "dy" : f32[2,6,2,4]
      %0 = attention_bwd %q, %k, %v, %dy {wrt = q, mask = causal, layout = bshd} : f32[2,6,2,4]
      %1 = attention_bwd %q, %k, %v, %dy {wrt = k, mask = causal, layout = bshd} : f32[2,6,2,4]
      %2 = attention_bwd %q, %k, %v, %dy {wrt = v, mask = causal, layout = bshd} : f32[2,6,2,4]
      %3 = attention %q, %k, %v {mask = none, layout = bshd} : f32[2,6,2,4]
      output dq = %0, dk = %1, dv = %2
    }
    """
)

FUSED = dedent(
    """\
    graph @attn {
      %q = input "q" : f32[2,6,2,4]
      %k = input "k" : f32[2,6,2,4]
      %v = input "v" : f32[2,6,2,4]
      %dy = input "dy" : f32[2,6,2,4]
      %0, %1, %2 = attention_bwd %q, %k, %v, %dy {wrt = q|k|v, mask = causal, layout = bshd} \
: f32[2,6,2,4], f32[2,6,2,4], f32[2,6,2,4]
      output dq = %0, dk = %1, dv = %2
    }
    """
)


@pytest.fixture
def ir_file(tmp_path: Path) -> str:
    path = tmp_path / "attn.rlx"
    path.write_text(SOURCE)
    return str(path)


def test_opt_fuses_and_prints_golden_ir(ir_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["opt", ir_file, "-p", "fuse-attention-bwd,dce"]) == 0
    captured = capsys.readouterr()
    assert captured.out == FUSED
    assert captured.err == ""


def test_opt_without_passes_round_trips(ir_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["opt", ir_file]) == 0
    assert capsys.readouterr().out == SOURCE


def test_opt_reads_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(SOURCE))
    assert cli.main(["opt", "-", "--passes", " fuse-attention-bwd , dce "]) == 0
    assert capsys.readouterr().out == FUSED


def test_opt_print_after_all_and_timings_go_to_stderr(ir_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["opt", ir_file, "-p", "cse,fuse-attention-bwd,dce", "--print-after-all", "--timings"]) == 0
    captured = capsys.readouterr()
    assert captured.out == FUSED
    assert "IR after cse" not in captured.err  # cse changed nothing
    dump_fuse = captured.err.index("// ----- IR after fuse-attention-bwd ----- //")
    dump_dce = captured.err.index("// ----- IR after dce ----- //")
    assert dump_fuse < captured.err.index("%0 = attention %q, %k, %v") < dump_dce  # dead node still there
    assert captured.err[dump_dce:].split("\n", 1)[1].startswith(FUSED)
    table = captured.err[captured.err.index("pass ") :].splitlines()
    assert [row.split()[0] for row in table[1:]] == ["cse", "fuse-attention-bwd", "dce"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["opt", "{missing}"], "cannot read"),
        (
            ["opt", "{file}", "-p", "fuse"],
            "unknown pass 'fuse'; known passes: cse, dce, decompose, fuse-attention-bwd, fuse-elementwise",
        ),
        (["opt", "{bad}"], "line 2"),
    ],
)
def test_opt_errors_exit_1_with_a_message(
    tmp_path: Path, ir_file: str, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    bad = tmp_path / "bad.rlx"
    bad.write_text("graph @g {\n  %q = input q : f32[2]\n}\n")
    paths = {"{missing}": str(tmp_path / "nope.rlx"), "{file}": ir_file, "{bad}": str(bad)}
    assert cli.main([paths.get(arg, arg) for arg in argv]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("rlx opt: error: ")
    assert message in captured.err


def test_emit_llvm_without_codegen_is_a_clear_error(
    ir_file: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "rlx.codegen", None)  # import fails
    assert cli.main(["opt", ir_file, "--emit", "llvm"]) == 1
    assert "--emit llvm needs the code generator" in capsys.readouterr().err


def test_emit_llvm_hands_the_transformed_graph_to_codegen(
    ir_file: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = {}

    def fake_emit(graph: object, passes: list[str]) -> str:
        seen["graph"], seen["passes"] = str(graph), passes
        return "; ModuleID = 'attn'"

    monkeypatch.setitem(sys.modules, "rlx.codegen", types.SimpleNamespace(emit_llvm_ir=fake_emit))
    assert cli.main(["opt", ir_file, "-p", "fuse-attention-bwd,dce", "--emit", "llvm"]) == 0
    assert capsys.readouterr().out == "; ModuleID = 'attn'\n"
    assert seen == {"graph": FUSED.rstrip("\n"), "passes": []}


SMALL = ["demo", "--batch", "1", "--heads", "2", "--seq", "16", "--dim", "8"]


def test_demo_runs_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(SMALL) == 0
    out = capsys.readouterr().out
    before, after = out.split("== after cse, fuse-attention-bwd, decompose, cse, fuse-elementwise, dce")
    assert before.count("attention_bwd") == 3 and "{wrt = q, mask = causal, layout = bshd}" in before
    assert "{wrt = q|k|v, mask = causal, layout = bshd}" in after
    assert "attention_bwd nodes: 3 -> 1" in out
    assert "f32[1,16,2,8]" in out
    assert "MISMATCH" not in out and out.count(" ok\n") == 2
    assert "central differences" in out
    for row in ("rlx fused", "rlx unfused", "reference (float64)"):
        assert row in out


class _SkewedExecutable:
    """Wraps a real executable but scales dK by 1.01: the demo must notice."""

    def __init__(self, exe: rlx.codegen.Executable) -> None:
        self.exe, self.graph, self.threads = exe, exe.graph, exe.threads

    def __call__(self, **arrays: np.ndarray) -> dict[str, np.ndarray]:
        results = self.exe(**arrays)
        results["dk"] = results["dk"] * np.float32(1.01)
        return results


def test_demo_reports_a_mismatch(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    real_compile = rlx.compile
    monkeypatch.setattr(rlx, "compile", lambda *a, **k: _SkewedExecutable(real_compile(*a, **k)))
    assert cli.main(SMALL) == 1
    out = capsys.readouterr().out
    assert out.count("MISMATCH") == 2  # caught by both the reference and the finite differences


def test_demo_rejects_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", "--seq", "0"])
    assert info.value.code == 2
    assert "positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("lr", ["-1", "0", "nan", "inf", "fast"])
def test_demo_rejects_a_learning_rate_not_positive(lr: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", "--lm", "--lr", lr])
    assert info.value.code == 2
    assert f"--lr: expected a positive number, got {lr!r}" in capsys.readouterr().err


def test_module_entry_point_exits_1_without_traceback(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rlx.cli", "opt", str(tmp_path / "missing.rlx")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "cannot read" in result.stderr


def test_lm_demo_trains_and_samples(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "tiny.txt"
    text.write_text("the cat sat on the mat. " * 40, encoding="utf-8")
    argv = [
        "demo",
        "--lm",
        "--data",
        str(text),
        "--steps",
        "40",
        "--batch",
        "4",
        "--seq",
        "16",
        "--embed",
        "16",
        "--heads",
        "2",
        "--layers",
        "1",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "tiny char LM on" in out and "tokens/s" in out and "== sample" in out
    first, last = (float(x) for x in out.split("   loss ")[-1].split(" (")[0].split(" -> "))
    assert last < first
    # Not a terminal: a progress line per tenth of the steps, no carriage returns.
    progress = [line for line in out.splitlines() if "tokens/s" in line]
    assert "\r" not in out and len(progress) == 10 and progress[-1].lstrip().startswith("[" + "#" * 30 + "]")


def test_lm_demo_defaults_to_the_readme(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "demo",
        "--lm",
        "--steps",
        "5",
        "--batch",
        "2",
        "--seq",
        "16",
        "--embed",
        "16",
        "--heads",
        "2",
        "--layers",
        "1",
    ]
    cli.main(argv)
    assert "README" in capsys.readouterr().out


def test_lm_demo_refuses_a_missing_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--lm", "--data", "/no/such/file.txt"]) == 1
    assert "cannot read /no/such/file.txt" in capsys.readouterr().err


def test_the_lms_own_options_imply_lm(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """``rlx demo --data book.txt`` trains on the book (it ran the attention demo and ignored it)."""
    text = tmp_path / "tiny.txt"
    text.write_text("the cat sat on the mat. " * 40, encoding="utf-8")
    argv = ["demo", "--data", str(text), "--steps", "3", "--batch", "2", "--seq", "16", "--embed", "16"]
    cli.main([*argv, "--heads", "2", "--layers", "1"])  # (3 steps need not beat the uniform guess)
    out = capsys.readouterr().out
    assert "tiny char LM on" in out and str(text) in out
    assert cli.main(["demo", "--data", "/no/such/file.txt"]) == 1
    assert "cannot read /no/such/file.txt" in capsys.readouterr().err


def test_lm_demo_redraws_one_progress_line_on_a_terminal() -> None:
    import io

    from rlx.demo_lm import train

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    train("the cat sat on the mat. " * 40, "text", 20, 2, 16, 16, 2, 1, 3e-3, 0, out, sample_chars=10)
    text = out.getvalue()
    assert text.count("\r   [") == 4  # every 5 steps, each drawn over the one before
    drawn = text.split("\r")[1:]
    assert all("\n" not in line for line in drawn[:-1]) and drawn[-1].split("\n")[0].endswith("tokens/s")
