"""A newcomer's first hour: each snag met while trying rlx, fixed and kept fixed."""

from __future__ import annotations

import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import rlx
from rlx import Graph
from rlx.cli import main

REPO = Path(__file__).resolve().parent.parent


def small_graph() -> Graph:
    g = Graph("small")
    x = g.input("x", (2, 3))
    g.input("unused", (4,))
    g.output(y=g.tanh(x) * 2.0)
    return g


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"rlx {rlx.__version__}"


def test_demo_help_describes_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from rlx.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    demo = commands.choices["demo"]
    for action in demo._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{action.option_strings} has no help"
        if action.default not in (None, False):
            assert "default" in action.help, f"{action.option_strings} does not say its default {action.default}"
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = capsys.readouterr().out
    for action in demo._actions:
        assert action.option_strings[-1] in text


def test_opt_without_passes_says_what_it_did(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    g = Graph("opt")
    q, k, v, dy = (g.input(n, (1, 4, 2, 8)) for n in ("q", "k", "v", "dy"))
    out = g.attention(q, k, v)
    dq, dk, dv = rlx.grad(g, out, [q, k, v], dy)
    g.output(dq=dq, dk=dk, dv=dv)
    path = tmp_path / "g.rlx"
    path.write_text(str(g))
    assert main(["opt", str(path)]) == 0
    captured = capsys.readouterr()
    assert "no -p given: ran no passes" in captured.err
    assert captured.out.count("attention_bwd ") == 3  # as parsed
    assert main(["opt", str(path), "-p", "default"]) == 0
    assert capsys.readouterr().out.count("attention_bwd ") == 1  # fused by the default pipeline


def test_readme_links_stay_inside_the_project() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#]+)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        resolved = (REPO / target).resolve()
        assert resolved.is_relative_to(REPO) and resolved.exists(), (
            f"README links to {target}, which a clone of the project does not have"
        )


def test_a_python_list_input_says_list() -> None:
    exe = rlx.compile(small_graph())
    with pytest.raises(rlx.RlxTypeError, match="Python list"):
        exe(x=[[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])


def test_positional_arguments_say_pass_by_name() -> None:
    exe = rlx.compile(small_graph())
    with pytest.raises(rlx.RlxTypeError, match="by name"):
        exe(np.ones((2, 3), np.float32))


def test_no_outputs_is_a_clear_error() -> None:
    g = Graph()
    g.input("x", (2,))
    with pytest.raises(rlx.RlxValueError, match="no outputs"):
        rlx.compile(g)


def test_value_of_a_copy_is_told_apart() -> None:
    g = small_graph()
    copy = g.copy()
    with pytest.raises(rlx.RlxValueError, match="copy"):
        g.add(copy.inputs["x"], g.inputs["x"])


def test_unused_inputs_are_not_required() -> None:
    exe = rlx.compile(small_graph())
    x = np.ones((2, 3), np.float32)
    np.testing.assert_allclose(exe(x=x)["y"], 2 * np.tanh(x), rtol=1e-6)
    np.testing.assert_allclose(exe(x=x, unused=np.zeros(4, np.float32))["y"], 2 * np.tanh(x), rtol=1e-6)
    with pytest.raises(rlx.RlxValueError):
        exe(x=x, unused=np.zeros(5, np.float32))  # still checked when given


def test_compile_times_are_numbers() -> None:
    exe = rlx.compile(small_graph())
    assert all(isinstance(value, float) for value in exe.compile_times.values())


def test_pickle_and_save_load_in_a_fresh_process(tmp_path: Path) -> None:
    exe = rlx.compile(small_graph())
    again = pickle.loads(pickle.dumps(exe))
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(again(x=x)["y"], exe(x=x)["y"])
    path = tmp_path / "small.rlx"
    exe.save(path)
    code = (
        "import sys, numpy as np, rlx\n"
        f"e = rlx.load({str(path)!r})\n"
        "x = np.arange(6, dtype=np.float32).reshape(2, 3)\n"
        "assert np.allclose(e(x=x)['y'], 2 * np.tanh(x))\n"
        "assert e.compile_times['llvm_optimize'] == 0.0, e.compile_times  # linked, not compiled\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    (tmp_path / "not.rlx").write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(rlx.RlxTypeError, match="not an rlx executable"):
        rlx.load(tmp_path / "not.rlx")


@pytest.mark.parametrize(("layout", "given"), [(rlx.Layout.BSHD, (1, 2, 8, 4)), (rlx.Layout.BHSD, (1, 8, 2, 4))])
def test_the_other_layout_is_named(layout: rlx.Layout, given: tuple[int, ...]) -> None:
    g = Graph()
    shape = layout.join(1, 8, 2, 4)
    q, k, v = (g.input(n, shape) for n in "qkv")
    g.output(o=g.attention(q, k, v, layout=layout))
    arrays = {n: np.ones(shape, np.float32) for n in "qkv"}
    arrays["q"] = np.ones(given, np.float32)
    with pytest.raises(rlx.RlxValueError, match=r"layout BHSD.*layout BSHD|layout BSHD.*layout BHSD") as info:
        rlx.compile(g)(**arrays)
    assert str(shape) in str(info.value)
    with pytest.raises(rlx.RlxValueError, match="layout"):
        rlx.reference.run(g, **arrays)
