"""The pass manager: names, verification after each pass, error blame, printing and timings."""

from __future__ import annotations

import io

import pytest
from passes_helpers import qkv

import rlx
from rlx import Graph, RlxError, RlxKeyError, RlxTypeError, RlxValueError, TensorType, Wrt
from rlx.passes import DEFAULT_PIPELINE, PASSES, Pass, register, run


def siblings() -> Graph:
    g = Graph("attn")
    q, k, v, dy = qkv(g)
    dq = g.attention_bwd(q, k, v, dy, wrt=Wrt.QUERY)
    dv = g.attention_bwd(q, k, v, dy, wrt=Wrt.VALUE)
    g.attention(q, k, v)  # dead
    g.output(dq=dq, dv=dv)
    return g


def _break_types(graph: Graph) -> bool:
    """Corrupt a node's result type behind the API's back, as a buggy pass could."""
    node = next(node for node in graph.nodes if node.op is rlx.OpKind.ATTENTION_BWD)
    node.types = (TensorType((1, 1, 1, 1)),)
    return True


def test_default_pipeline_is_registered() -> None:
    assert DEFAULT_PIPELINE == ("cse", "fuse-attention-bwd", "decompose", "cse", "fuse-elementwise", "dce")
    assert all(name in PASSES for name in DEFAULT_PIPELINE)
    assert rlx.passes.run is run


def test_runs_in_order_and_reports_change() -> None:
    g = siblings()
    assert run(g, ["fuse-attention-bwd", "dce"]) is True
    assert [node.op for node in g.nodes][-1] is rlx.OpKind.ATTENTION_BWD
    assert len(g) == 5
    assert run(g, ("fuse-attention-bwd", "dce")) is False
    assert run(g, []) is False


def test_unknown_name_lists_known_ones_and_runs_nothing() -> None:
    g = siblings()
    text = str(g)
    with pytest.raises(RlxKeyError) as info:
        run(g, ["fuse-attention-bwd", "fuse-everything"])
    assert isinstance(info.value, KeyError)
    message = str(info.value)
    assert "'fuse-everything'" in message
    assert all(name in message for name in ("cse", "dce", "fuse-attention-bwd"))
    assert str(g) == text


@pytest.mark.parametrize("names", ["dce", "cse,dce", [1], None])
def test_names_must_be_a_list_of_str(names: object) -> None:
    with pytest.raises(TypeError, match="pass names"):
        run(siblings(), names)  # type: ignore[arg-type]


def test_graph_must_be_a_graph() -> None:
    with pytest.raises(RlxTypeError, match=r"rlx\.Graph"):
        run("graph @g {}", ["dce"])  # type: ignore[arg-type]


def test_verification_after_each_pass_blames_the_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(PASSES, "break-types", Pass("break-types", _break_types))
    with pytest.raises(RlxValueError) as info:
        run(siblings(), ["dce", "break-types", "cse"])
    assert str(info.value).startswith("pass 'break-types': graph 'attn' failed verification")
    assert isinstance(info.value.__cause__, RlxValueError)


def test_verify_false_skips_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(PASSES, "break-types", Pass("break-types", _break_types))
    assert run(siblings(), ["break-types"], verify=False) is True


def test_error_raised_inside_a_pass_keeps_its_class(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(graph: Graph) -> bool:
        raise RlxTypeError("bad attrs on node 7")

    monkeypatch.setitem(PASSES, "boom", Pass("boom", boom))
    with pytest.raises(RlxTypeError, match=r"^pass 'boom': bad attrs on node 7$"):
        run(siblings(), ["boom"])


def test_graph_broken_on_entry_is_not_blamed_on_a_pass() -> None:
    g = siblings()
    _break_types(g)
    with pytest.raises(RlxValueError) as info:
        run(g, ["dce"])
    assert not str(info.value).startswith("pass ")


def test_timings_accumulate_per_pass() -> None:
    timings: dict[str, float] = {"dce": 1.0}
    run(siblings(), ["cse", "dce", "fuse-attention-bwd", "dce"], timings=timings)
    assert set(timings) == {"cse", "dce", "fuse-attention-bwd"}
    assert timings["dce"] > 1.0
    assert all(isinstance(seconds, float) and seconds >= 0 for seconds in timings.values())


def test_print_after_all_prints_only_passes_that_changed() -> None:
    stream = io.StringIO()
    g = siblings()
    run(g, ["cse", "fuse-attention-bwd", "dce"], print_after_all=stream)
    text = stream.getvalue()
    assert "IR after cse" not in text  # nothing to merge
    assert text.index("// ----- IR after fuse-attention-bwd ----- //") < text.index("// ----- IR after dce ----- //")
    assert text.endswith(str(g) + "\n")
    assert "wrt = q|v" in text


def test_print_after_all_true_prints_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    run(siblings(), ["dce"], print_after_all=True)
    assert "// ----- IR after dce ----- //" in capsys.readouterr().out


def test_register_refuses_a_different_pass_under_a_taken_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rlx.passes.base, "PASSES", dict(PASSES))
    assert register(PASSES["dce"]) is PASSES["dce"]  # re-registering the same pass is harmless
    with pytest.raises(RlxError, match="already registered"):
        register(Pass("dce", lambda graph: False))
    with pytest.raises(TypeError):
        register(rlx.passes.dce)  # type: ignore[arg-type]
