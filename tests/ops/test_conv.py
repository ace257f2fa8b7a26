"""``conv``: 1-3 spatial axes, strides, dilations, paddings (ints, pairs, "same", "valid") and
groups, against a direct float64 loop over windows (and ``torch.nn.functional.conv*d`` where
torch is installed); gradients against central differences; bad arguments as build errors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import rlx
from rlx import Graph
from tests.helpers import central_differences

CASES = [
    {"x": (2, 3, 9, 10), "w": (4, 3, 3, 3), "stride": 1, "padding": 1, "dilation": 1, "groups": 1},
    {"x": (2, 4, 11, 8), "w": (6, 2, 3, 2), "stride": (2, 1), "padding": ((1, 0), (2, 1)), "dilation": (1, 2),
     "groups": 2},
    {"x": (1, 6, 7, 7), "w": (6, 1, 3, 3), "stride": 2, "padding": "valid", "dilation": 1, "groups": 6},
    {"x": (2, 3, 17), "w": (5, 3, 4), "stride": 3, "padding": 2, "dilation": 1, "groups": 1},
    {"x": (2, 3, 12), "w": (5, 3, 3), "stride": 1, "padding": "same", "dilation": 2, "groups": 1},
    {"x": (2, 3, 12), "w": (5, 3, 4), "stride": 1, "padding": "same", "dilation": 1, "groups": 1},
    {"x": (1, 2, 5, 6, 4), "w": (3, 2, 2, 3, 2), "stride": 1, "padding": (1, 0, 1), "dilation": 1, "groups": 1},
    {"x": (2, 3, 16, 16), "w": (8, 3, 4, 4), "stride": 4, "padding": 0, "dilation": 1, "groups": 1},
]  # fmt: skip


def _pairs(padding: object, taps: tuple[int, ...], dilation: tuple[int, ...]) -> list[tuple[int, int]]:
    reach = [d * (t - 1) for d, t in zip(dilation, taps, strict=True)]
    if padding == "valid":
        return [(0, 0)] * len(taps)
    if padding == "same":
        return [(r // 2, r - r // 2) for r in reach]
    entries = [padding] * len(taps) if isinstance(padding, int) else list(padding)  # type: ignore[call-overload]
    return [(e, e) if isinstance(e, int) else tuple(e) for e in entries]


def direct_conv(x: np.ndarray, w: np.ndarray, b: np.ndarray, case: dict) -> np.ndarray:
    """The definition, window by window, in float64."""
    spatial = x.ndim - 2
    taps = w.shape[2:]
    stride = (case["stride"],) * spatial if isinstance(case["stride"], int) else case["stride"]
    dilation = (case["dilation"],) * spatial if isinstance(case["dilation"], int) else case["dilation"]
    pads = _pairs(case["padding"], taps, dilation)
    padded = np.pad(x.astype(np.float64), [(0, 0), (0, 0), *pads])
    groups = case["groups"]
    per_group, outs = x.shape[1] // groups, w.shape[0] // groups
    out_sizes = [(padded.shape[2 + a] - dilation[a] * (taps[a] - 1) - 1) // stride[a] + 1 for a in range(spatial)]
    out = np.zeros((x.shape[0], w.shape[0], *out_sizes))
    for o in range(w.shape[0]):
        group = o // outs
        channels = padded[:, group * per_group : (group + 1) * per_group]
        for position in itertools.product(*(range(n) for n in out_sizes)):
            window = tuple(
                slice(p * s, p * s + d * (t - 1) + 1, d)
                for p, s, d, t in zip(position, stride, dilation, taps, strict=True)
            )
            patch = channels[(slice(None), slice(None), *window)]
            out[(slice(None), o, *position)] = np.sum(patch * w[o], axis=tuple(range(1, spatial + 2)))
    return out + b.reshape(-1, *(1,) * spatial)


@pytest.mark.parametrize("case", CASES, ids=[str(c["x"]) + str(c["padding"]) for c in CASES])
def test_conv_matches_the_definition_and_torch(case: dict) -> None:
    rng = np.random.default_rng(8)
    g = Graph("conv")
    x, w, b = g.input("x", case["x"]), g.input("w", case["w"]), g.input("b", (case["w"][0],))
    g.output(y=g.conv(x, w, b, case["stride"], case["padding"], case["dilation"], case["groups"]))
    xv, wv, bv = (rng.standard_normal(s).astype(np.float32) for s in (case["x"], case["w"], (case["w"][0],)))
    want = direct_conv(xv, wv, bv, case)
    got = rlx.compile(g)(x=xv, w=wv, b=bv)["y"]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(rlx.reference.run(g, x=xv, w=wv, b=bv)["y"], want, rtol=1e-5, atol=1e-5)
    torch = pytest.importorskip("torch")
    functional = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d, 3: torch.nn.functional.conv3d}
    pads = _pairs(case["padding"], case["w"][2:], (case["dilation"],) * (len(case["x"]) - 2)
                  if isinstance(case["dilation"], int) else case["dilation"])  # fmt: skip
    flat = [side for pair in reversed(pads) for side in pair]
    expected = functional[len(case["x"]) - 2](
        torch.nn.functional.pad(torch.from_numpy(xv), flat), torch.from_numpy(wv), torch.from_numpy(bv),
        stride=case["stride"], dilation=case["dilation"], groups=case["groups"],
    )  # fmt: skip
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-4, atol=1e-4)


def test_conv_gradients_against_central_differences() -> None:
    case = {"x": (2, 4, 5, 6), "w": (4, 2, 3, 2), "stride": (2, 1), "padding": ((1, 0), (0, 1)), "dilation": (1, 2),
            "groups": 2}  # fmt: skip
    g = Graph("conv_grad")
    x, w, b = g.input("x", case["x"]), g.input("w", case["w"]), g.input("b", (4,))
    y = g.conv(x, w, b, case["stride"], case["padding"], case["dilation"], case["groups"])
    weights = np.random.default_rng(9).standard_normal(y.shape)
    loss = g.sum(y * y * g.constant(weights.astype(np.float32)))
    dx, dw, db = rlx.grad(g, loss, [x, w, b])
    g.output(dx=dx, dw=dw, db=db)
    rng = np.random.default_rng(10)
    xv, wv, bv = rng.standard_normal(case["x"]), rng.standard_normal(case["w"]), rng.standard_normal(4)
    got = rlx.compile(g)(x=xv.astype(np.float32), w=wv.astype(np.float32), b=bv.astype(np.float32))

    def loss_of() -> float:
        out = direct_conv(xv, wv, bv, case)
        return float(np.sum(out * out * weights))

    for name, array in (("dx", xv), ("dw", wv), ("db", bv)):
        np.testing.assert_allclose(got[name], central_differences(loss_of, array), rtol=1e-3, atol=1e-3, err_msg=name)


def test_conv_errors_name_what_is_wrong() -> None:
    g = Graph("conv_errors")
    x = g.input("x", (2, 4, 8, 8))
    with pytest.raises(rlx.RlxValueError, match="groups=3"):
        g.conv(x, g.input("w1", (6, 1, 3, 3)), groups=3)
    with pytest.raises(rlx.RlxValueError, match="second axis must be 2"):
        g.conv(x, g.input("w2", (6, 4, 3, 3)), groups=2)
    with pytest.raises(rlx.RlxValueError, match="does not fit"):
        g.conv(x, g.input("w3", (6, 4, 9, 3)))
    with pytest.raises(rlx.RlxValueError, match="'same' needs stride 1"):
        g.conv(x, g.input("w4", (6, 4, 3, 3)), stride=2, padding="same")
    with pytest.raises(rlx.RlxValueError, match="stride must be an int >= 1"):
        g.conv(x, g.input("w5", (6, 4, 3, 3)), stride=0)
    with pytest.raises(rlx.RlxValueError, match="weight must be"):
        g.conv(x, g.input("w6", (6, 4, 3)))
    with pytest.raises(rlx.RlxValueError, match="bias must be"):
        g.conv(x, g.input("w7", (6, 4, 3, 3)), bias=g.input("b", (5,)))


def _direct_pool(x: np.ndarray, kind: str, window: int, stride: int, padding: int, include_pad: bool) -> np.ndarray:
    """Pooling by its definition over 2-d windows, in float64."""
    fill = -np.inf if kind == "max" else 0.0
    padded = np.pad(
        x.astype(np.float64), [(0, 0), (0, 0), (padding, padding), (padding, padding)], constant_values=fill
    )
    inside = np.pad(np.ones(x.shape[2:]), padding)
    rows = (padded.shape[2] - window) // stride + 1
    cols = (padded.shape[3] - window) // stride + 1
    out = np.zeros((*x.shape[:2], rows, cols))
    for i, j in itertools.product(range(rows), range(cols)):
        patch = padded[:, :, i * stride : i * stride + window, j * stride : j * stride + window]
        if kind == "max":
            out[:, :, i, j] = patch.max(axis=(2, 3))
        else:
            count = (
                window * window
                if include_pad
                else inside[i * stride : i * stride + window, j * stride : j * stride + window].sum()
            )
            out[:, :, i, j] = patch.sum(axis=(2, 3)) / count
    return out


@pytest.mark.parametrize(
    ("kind", "window", "stride", "padding", "include_pad"),
    [
        ("max", 3, 2, 1, True),
        ("max", 2, 2, 0, True),
        ("avg", 3, 1, 1, True),
        ("avg", 3, 2, 1, False),
        ("avg", 2, 2, 0, True),
    ],
)
def test_pooling_matches_the_definition(kind: str, window: int, stride: int, padding: int, include_pad: bool) -> None:
    rng = np.random.default_rng(11)
    g = Graph("pool")
    x = g.input("x", (2, 3, 9, 8))
    if kind == "max":
        y = g.max_pool(x, window, stride, padding)
    else:
        y = g.avg_pool(x, window, stride, padding, count_include_pad=include_pad)
    weights = rng.standard_normal(y.shape)
    loss = g.sum(y * g.constant(weights.astype(np.float32)))
    (dx,) = rlx.grad(g, loss, [x])
    g.output(y=y, dx=dx)
    xv = rng.standard_normal((2, 3, 9, 8))
    got = rlx.compile(g)(x=xv.astype(np.float32))
    np.testing.assert_allclose(
        got["y"], _direct_pool(xv, kind, window, stride, padding, include_pad), rtol=1e-5, atol=1e-6
    )

    def loss_of() -> float:
        return float(np.sum(_direct_pool(xv, kind, window, stride, padding, include_pad) * weights))

    np.testing.assert_allclose(got["dx"], central_differences(loss_of, xv), rtol=1e-4, atol=1e-4)


def test_pooling_errors() -> None:
    g = Graph("pool_errors")
    x = g.input("x", (2, 3, 8, 8))
    with pytest.raises(rlx.RlxValueError, match="at most half the window"):
        g.max_pool(x, 2, padding=2)
    with pytest.raises(rlx.RlxValueError, match="window must be an int >= 1"):
        g.avg_pool(x, 0)
    with pytest.raises(rlx.RlxValueError, match="does not fit"):
        g.max_pool(x, 9)
