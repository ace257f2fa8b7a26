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
    """The definition, tap by tap, in float64: ``out[n, o, p] = b[o] + sum over the taps t and
    the group's channels c of x_padded[n, c, p*s + t*d] * w[o, c, t]``."""
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
    for tap in itertools.product(*(range(t) for t in taps)):
        # x_padded[n, c, p*s + t*d] for every output position p: a strided slice per spatial axis.
        rows = tuple(
            slice(t * d, t * d + (n - 1) * s + 1, s)
            for t, d, s, n in zip(tap, dilation, stride, out_sizes, strict=True)
        )
        shifted = padded[(slice(None), slice(None), *rows)]
        for group in range(groups):
            channels = shifted[:, group * per_group : (group + 1) * per_group]
            weights = w[(slice(group * outs, (group + 1) * outs), slice(None), *tap)].astype(np.float64)
            out[:, group * outs : (group + 1) * outs] += np.einsum("nc...,oc->no...", channels, weights)
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


GRADIENT_CASES = [
    {"x": (2, 4, 5, 6), "w": (6, 4, 3, 3), "stride": 1, "padding": 1, "dilation": 1, "groups": 1},
    {"x": (2, 4, 6, 5), "w": (4, 2, 2, 3), "stride": 1, "padding": ((3, 0), (0, 2)), "dilation": (2, 1), "groups": 2},
    {"x": (2, 3, 7, 6), "w": (3, 1, 3, 3), "stride": 1, "padding": "same", "dilation": 1, "groups": 3},
    {"x": (1, 2, 9), "w": (6, 1, 2), "stride": 1, "padding": 0, "dilation": 3, "groups": 2},
    {"x": (2, 3, 9), "w": (2, 3, 3), "stride": 2, "padding": ((2, 1),), "dilation": 1, "groups": 1},
    {"x": (1, 2, 8, 7), "w": (2, 1, 3, 3), "stride": (2, 3), "padding": 1, "dilation": 1, "groups": 2},
]  # fmt: skip


@pytest.mark.parametrize("case", GRADIENT_CASES, ids=[str(c["x"]) + str(c["w"]) for c in GRADIENT_CASES])
def test_conv_gradient_rules_against_central_differences(case: dict) -> None:
    """Every route of the gradient rule: the transposed convolution (stride 1: im2col of dy, or a
    loop nest where the convolution is depthwise, or grouped with a channel multiplier), and the
    decomposition's gradient where the stride is larger."""
    g = Graph("conv_grad_rules")
    x, w = g.input("x", case["x"]), g.input("w", case["w"])
    y = g.conv(x, w, None, case["stride"], case["padding"], case["dilation"], case["groups"])
    weights = np.random.default_rng(11).standard_normal(y.shape)
    loss = g.sum(y * y * g.constant(weights.astype(np.float32)))
    dx, dw = rlx.grad(g, loss, [x, w])
    g.output(dx=dx, dw=dw)
    rng = np.random.default_rng(12)
    xv, wv = rng.standard_normal(case["x"]), rng.standard_normal(case["w"])
    bv = np.zeros(case["w"][0])
    arrays = {"x": xv.astype(np.float32), "w": wv.astype(np.float32)}
    got = rlx.compile(g)(**arrays)
    reference = rlx.reference.run(g, **arrays)

    def loss_of() -> float:
        out = direct_conv(xv, wv, bv, case)
        return float(np.sum(out * out * weights))

    for name, array in (("dx", xv), ("dw", wv)):
        want = central_differences(loss_of, array)
        np.testing.assert_allclose(got[name], want, rtol=1e-3, atol=1e-3, err_msg=name)
        np.testing.assert_allclose(reference[name], want, rtol=1e-4, atol=1e-4, err_msg=name)


LAYOUT_CASES = [
    {"x": (2, 4, 5, 10), "w": (6, 2, 3, 3), "stride": 1, "padding": 1, "dilation": 1, "groups": 2},
    {"x": (2, 3, 9, 20), "w": (4, 3, 3, 3), "stride": 2, "padding": ((1, 0), (2, 1)), "dilation": (1, 2),
     "groups": 1},
    {"x": (1, 2, 11), "w": (3, 2, 4), "stride": 1, "padding": "same", "dilation": 2, "groups": 1},
    {"x": (1, 2, 3, 4, 9), "w": (4, 1, 2, 2, 3), "stride": 1, "padding": (1, 0, 1), "dilation": 1, "groups": 2},
]  # fmt: skip


SLOW_LAYOUT_CASES = ((2, 3, 9, 20), (1, 2, 3, 4, 9))


@pytest.mark.parametrize("planes", [True, False], ids=["planes", "channels_last"])
@pytest.mark.parametrize(
    "case",
    # The largest case (strides, asymmetric padding and dilation together) and the 3-D one are
    # slow cases: the others cover both layouts in the default run.
    [pytest.param(c, marks=pytest.mark.slow) if c["x"] in SLOW_LAYOUT_CASES else c for c in LAYOUT_CASES],
    ids=[str(c["x"]) + str(c["w"]) for c in LAYOUT_CASES],
)
def test_both_column_layouts_against_the_definition(case: dict, planes: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """im2col writes planes (``[N, G, Cg*K, P]``) where the output's last axis fills the vector
    lanes and channels last otherwise (:func:`rlx.ops.conv._columns_as_planes`): each layout,
    forced on the same convolutions, gives the definition's values and gradients."""
    from rlx.ops import conv as conv_module

    monkeypatch.setattr(conv_module, "PLANE_MIN_RUN", 1 if planes else 1 << 30)
    g = Graph("conv_layouts")
    x, w, b = g.input("x", case["x"]), g.input("w", case["w"]), g.input("b", (case["w"][0],))
    y = g.conv(x, w, b, case["stride"], case["padding"], case["dilation"], case["groups"])
    weights = np.random.default_rng(13).standard_normal(y.shape)
    loss = g.sum(y * y * g.constant(weights.astype(np.float32)))
    dx, dw = rlx.grad(g, loss, [x, w])
    g.output(y=y, dx=dx, dw=dw)
    exe = rlx.compile(g)
    transposes = [kernel.name for kernel in exe.kernels if "transpose" in kernel.name]  # copies, not views
    xv, wv, bv, want = _definition_with_differences(case, weights)
    got = exe(x=xv.astype(np.float32), w=wv.astype(np.float32), b=bv.astype(np.float32))
    for name in ("y", "dx", "dw"):
        tolerance = 1e-4 if name == "y" else 1e-3
        np.testing.assert_allclose(got[name], want[name], rtol=tolerance, atol=tolerance, err_msg=name)
    if planes and case["stride"] == 1 and case["groups"] == 1:  # planes in, planes out: no copy moves channels
        assert not transposes, transposes


_DEFINITIONS: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]] = {}


def _definition_with_differences(
    case: dict, weights: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """The inputs of ``case`` and the definition's output and central-difference gradients,
    computed once for both layouts (the differences are most of the test's time)."""
    key = repr(case)
    if key not in _DEFINITIONS:
        rng = np.random.default_rng(14)
        xv, wv, bv = rng.standard_normal(case["x"]), rng.standard_normal(case["w"]), rng.standard_normal(case["w"][0])

        def loss_of() -> float:
            out = direct_conv(xv, wv, bv, case)
            return float(np.sum(out * out * weights))

        want = {"y": direct_conv(xv, wv, bv, case)}
        want.update({name: central_differences(loss_of, a) for name, a in (("dx", xv), ("dw", wv))})
        _DEFINITIONS[key] = (xv, wv, bv, want)
    return _DEFINITIONS[key]


def test_a_wide_stem_writes_planes_and_one_product() -> None:
    """A 7x7 stride-2 stem over 3 channels (an image model's first layer): the columns as planes,
    one product for the whole batch, and the output in NCHW as the product leaves it."""
    g = Graph("stem")
    x, w = g.input("x", (2, 3, 32, 32)), g.input("w", (16, 3, 7, 7))
    g.output(y=g.conv(x, w, stride=2, padding=3))
    exe = rlx.compile(g)
    products = [node for node in exe.graph.nodes if node.op is rlx.OpKind.MATMUL]
    assert len(products) == 1 and products[0].outputs[0].shape == (2, 1, 16, 256)
    assert not any("transpose" in kernel.name for kernel in exe.kernels), exe.kernels
    rng = np.random.default_rng(15)
    xv, wv = rng.standard_normal((2, 3, 32, 32)), rng.standard_normal((16, 3, 7, 7))
    case = {"stride": 2, "padding": 3, "dilation": 1, "groups": 1}
    got = exe(x=xv.astype(np.float32), w=wv.astype(np.float32))["y"]
    np.testing.assert_allclose(got, direct_conv(xv, wv, np.zeros(16), case), rtol=1e-4, atol=1e-4)


def test_input_gradient_of_a_unit_stride_conv_is_a_conv() -> None:
    """The rule's point: at stride 1 the input's gradient is one more convolution (three BLAS
    products in all), not the columns' cotangent scattered back through a padded copy per offset."""
    g = Graph("conv_grad_form")
    x, w = g.input("x", (2, 8, 6, 6)), g.input("w", (8, 8, 3, 3))
    loss = g.mean(g.conv(x, w, padding=1) ** 2)
    dx, dw = rlx.grad(g, loss, [x, w])
    g.output(dx=dx, dw=dw)
    assert sum(node.op is rlx.OpKind.CONV for node in g.nodes) == 2
    exe = rlx.compile(g)
    assert sum(node.op is rlx.OpKind.MATMUL for node in exe.graph.nodes) == 3
    widest = max(len(node.inputs) for node in exe.graph.nodes if node.op is rlx.OpKind.FUSED_ELEMENTWISE)
    assert widest < 9  # no sum of nine padded windows


@pytest.mark.slow  # the generic second-order check of the conv sample runs by default
def test_conv_second_order_gradient() -> None:
    """The input's gradient is a convolution, so it differentiates again (a gradient penalty)."""
    g = Graph("conv_second_order")
    x, w = g.input("x", (1, 2, 5, 5)), g.input("w", (3, 2, 3, 3))
    (dx,) = rlx.grad(g, g.sum(g.tanh(g.conv(x, w, padding=1))), [x])
    (dw,) = rlx.grad(g, g.sum(dx * dx), [w])
    g.output(dw=dw)
    rng = np.random.default_rng(13)
    xv, wv = rng.standard_normal((1, 2, 5, 5)), rng.standard_normal((3, 2, 3, 3)) * 0.5
    got = rlx.compile(g)(x=xv.astype(np.float32), w=wv.astype(np.float32))["dw"]
    case = {"stride": 1, "padding": 1, "dilation": 1, "groups": 1}

    def penalty() -> float:  # d/dx sum(tanh(conv(x))) = conv^T(1 - tanh^2), by differences too
        def inner() -> float:
            return float(np.sum(np.tanh(direct_conv(xv, wv, np.zeros(3), case))))

        return float(np.sum(central_differences(inner, xv, eps=1e-5) ** 2))

    np.testing.assert_allclose(got, central_differences(penalty, wv, eps=1e-4), rtol=2e-3, atol=2e-3)


def direct_conv_transpose(x: np.ndarray, w: np.ndarray, stride: tuple[int, ...], padding: tuple[int, ...],
                          extra: tuple[int, ...], groups: int, dilation: tuple[int, ...]) -> np.ndarray:  # fmt: skip
    """The definition by scattering: input entry ``i`` adds ``x[i] * w[t]`` at ``i*s + t*d - p``
    (tap by tap: the entries ``i`` whose target lies inside the output, a strided slice)."""
    taps = w.shape[2:]
    per_group, outs = x.shape[1] // groups, w.shape[1]
    sizes = [(n - 1) * s - 2 * p + d * (t - 1) + e + 1
             for n, s, p, d, t, e in zip(x.shape[2:], stride, padding, dilation, taps, extra, strict=True)]  # fmt: skip
    out = np.zeros((x.shape[0], groups * outs, *sizes))
    for t in itertools.product(*(range(k) for k in taps)):
        sources, targets = [], []
        for n, s, p, d, k, size in zip(x.shape[2:], stride, padding, dilation, t, sizes, strict=True):
            inside = [i for i in range(n) if 0 <= i * s + k * d - p < size]
            if not inside:
                break
            sources.append(slice(inside[0], inside[-1] + 1))
            targets.append(slice(inside[0] * s + k * d - p, inside[-1] * s + k * d - p + 1, s))
        else:
            for group in range(groups):
                chans = slice(group * per_group, (group + 1) * per_group)
                taken = x[(slice(None), chans, *sources)].astype(np.float64)
                tap = w[(chans, slice(None), *t)].astype(np.float64)
                out[(slice(None), slice(group * outs, (group + 1) * outs), *targets)] += np.einsum(
                    "nc...,co->no...", taken, tap
                )
    return out


TRANSPOSE_CASES = [
    {"x": (2, 4, 5, 4), "w": (4, 3, 3, 3), "stride": (1, 1), "padding": (1, 0), "extra": (0, 0), "groups": 1,
     "dilation": (1, 1)},
    {"x": (2, 4, 4, 3), "w": (4, 2, 3, 2), "stride": (2, 3), "padding": (1, 0), "extra": (1, 2), "groups": 2,
     "dilation": (1, 1)},
    {"x": (1, 3, 6), "w": (3, 2, 3), "stride": (1,), "padding": (3,), "extra": (1,), "groups": 1, "dilation": (2,)},
    {"x": (2, 2, 5), "w": (2, 2, 4), "stride": (2,), "padding": (1,), "extra": (0,), "groups": 1, "dilation": (1,)},
    {"x": (1, 2, 3, 2, 2), "w": (2, 1, 2, 2, 2), "stride": (2, 1, 1), "padding": (0, 1, 0), "extra": (1, 0, 0),
     "groups": 2, "dilation": (1, 1, 1)},
]  # fmt: skip


@pytest.mark.parametrize("case", TRANSPOSE_CASES, ids=[str(c["x"]) + str(c["stride"]) for c in TRANSPOSE_CASES])
def test_conv_transpose_matches_the_definition_torch_and_differences(case: dict) -> None:
    rng = np.random.default_rng(14)
    args = (case["stride"], case["padding"], case["extra"], case["groups"], case["dilation"])
    g = Graph("conv_transpose")
    x, w = g.input("x", case["x"]), g.input("w", case["w"])
    bias = g.input("b", (case["w"][1] * case["groups"],))
    y = g.conv_transpose(x, w, bias, *args)
    weights = rng.standard_normal(y.shape)
    dx, dw = rlx.grad(g, g.sum(y * g.constant(weights.astype(np.float32))), [x, w])
    g.output(y=y, dx=dx, dw=dw)
    xv, wv = rng.standard_normal(case["x"]), rng.standard_normal(case["w"])
    bv = rng.standard_normal(y.shape[1])
    want = direct_conv_transpose(xv, wv, *args) + bv.reshape(-1, *(1,) * (len(case["x"]) - 2))
    got = rlx.compile(g)(x=xv.astype(np.float32), w=wv.astype(np.float32), b=bv.astype(np.float32))
    assert got["y"].shape == want.shape
    np.testing.assert_allclose(got["y"], want, rtol=1e-4, atol=1e-4)

    def loss_of() -> float:
        return float(np.sum(direct_conv_transpose(xv, wv, *args) * weights))

    np.testing.assert_allclose(got["dx"], central_differences(loss_of, xv), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got["dw"], central_differences(loss_of, wv), rtol=1e-4, atol=1e-4)
    torch = pytest.importorskip("torch")
    functional = {1: torch.nn.functional.conv_transpose1d, 2: torch.nn.functional.conv_transpose2d,
                  3: torch.nn.functional.conv_transpose3d}  # fmt: skip
    expected = functional[len(case["x"]) - 2](
        torch.from_numpy(xv), torch.from_numpy(wv), torch.from_numpy(bv), case["stride"], case["padding"],
        case["extra"], case["groups"], case["dilation"],
    )  # fmt: skip
    np.testing.assert_allclose(got["y"], expected.numpy(), rtol=1e-4, atol=1e-4)


def test_conv_transpose_errors() -> None:
    g = Graph("conv_transpose_errors")
    x = g.input("x", (2, 4, 5, 5))
    with pytest.raises(rlx.RlxValueError, match=r"weight must be \[C, O/groups"):
        g.conv_transpose(x, g.input("w1", (3, 2, 3, 3)))
    with pytest.raises(rlx.RlxValueError, match="output_padding"):
        g.conv_transpose(x, g.input("w2", (4, 2, 3, 3)), stride=2, output_padding=2)
    with pytest.raises(rlx.RlxValueError, match="empty"):
        g.conv_transpose(x, g.input("w3", (4, 2, 1, 1)), padding=3)
    with pytest.raises(rlx.RlxTypeError, match="float32"):
        g.conv_transpose(x, g.input("w4", (4, 2, 3, 3), dtype="int32"))


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
    x = g.input("x", (2, 1, 9, 8))
    if kind == "max":
        y = g.max_pool(x, window, stride, padding)
    else:
        y = g.avg_pool(x, window, stride, padding, count_include_pad=include_pad)
    weights = rng.standard_normal(y.shape)
    loss = g.sum(y * g.constant(weights.astype(np.float32)))
    (dx,) = rlx.grad(g, loss, [x])
    g.output(y=y, dx=dx)
    xv = rng.standard_normal((2, 1, 9, 8))
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


@pytest.mark.parametrize("stride", [1, 2])
def test_conv_and_its_transpose_with_a_symbolic_batch(stride: int) -> None:
    """One executable for every batch size: the forward, the transposed convolution and the
    gradients of both against the float64 reference."""
    g = Graph("conv_symbolic_batch")
    x, w, wt = g.input("x", ("n", 4, 9, 8)), g.input("w", (6, 2, 3, 3)), g.input("wt", (6, 2, 3, 3))
    y = g.conv(x, w, stride=stride, padding=1, groups=2)
    z = g.conv_transpose(y, wt, stride=stride, padding=1, output_padding=stride - 1, groups=2)
    dx, dw, dwt = rlx.grad(g, g.sum(z * z), [x, w, wt])
    g.output(z=z, dx=dx, dw=dw, dwt=dwt)
    exe = rlx.compile(g)
    for n in (1, 3):
        rng = np.random.default_rng(n)
        arrays = {
            "x": rng.standard_normal((n, 4, 9, 8), dtype=np.float32),
            "w": rng.standard_normal((6, 2, 3, 3), dtype=np.float32),
            "wt": rng.standard_normal((6, 2, 3, 3), dtype=np.float32),
        }
        got, want = exe(**arrays), rlx.reference.run(g, **arrays)
        assert got["z"].shape == (n, 4, 9 + stride - 1, 8)
        for name in want:
            scale = float(np.max(np.abs(want[name])))
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5 * scale, err_msg=name)
    assert exe.compile_count == 1


@pytest.mark.parametrize(
    ("kind", "shape", "window", "stride", "padding", "dilation"),
    [("max", (2, 3, 17), 3, 3, 1, 2), ("max", (1, 2, 7, 9, 6), (2, 3, 2), (2, 2, 3), (1, 1, 0), 1),
     ("avg", (1, 2, 7, 9, 6), (3, 2, 2), (1, 2, 2), (1, 1, 0), 1), ("avg", (2, 3, 10), 4, 3, 2, 1)],
)  # fmt: skip
def test_pooling_in_one_three_axes_against_torch(
    kind: str, shape: tuple[int, ...], window: object, stride: object, padding: object, dilation: object
) -> None:
    """Pooling over 1 and 3 axes, strided, dilated, padded: values and gradients as torch's (and
    the compiled gradient as the float64 reference's)."""
    torch = pytest.importorskip("torch")
    g = Graph("pool_axes")
    x = g.input("x", shape)
    y = g.max_pool(x, window, stride, padding, dilation) if kind == "max" else g.avg_pool(x, window, stride, padding)
    weights = np.random.default_rng(15).standard_normal(y.shape).astype(np.float32)
    (dx,) = rlx.grad(g, g.sum(y * g.constant(weights)), [x])
    g.output(y=y, dx=dx)
    xv = np.random.default_rng(16).standard_normal(shape).astype(np.float32)
    got = rlx.compile(g)(x=xv)
    np.testing.assert_allclose(got["dx"], rlx.reference.run(g, x=xv)["dx"], rtol=1e-5, atol=1e-6)
    spatial = len(shape) - 2
    xt = torch.tensor(xv, requires_grad=True)
    if kind == "max":
        function = getattr(torch.nn.functional, f"max_pool{spatial}d")
        yt = function(xt, window, stride, padding, dilation)
    else:
        function = getattr(torch.nn.functional, f"avg_pool{spatial}d")
        yt = function(xt, window, stride, padding)
    (yt * torch.from_numpy(weights)).sum().backward()
    np.testing.assert_allclose(got["y"], yt.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["dx"], xt.grad.numpy(), rtol=1e-5, atol=1e-5)


def first_maximum_pooling(
    x: np.ndarray, dy: np.ndarray, window: int, stride: int, padding: int
) -> tuple[np.ndarray, np.ndarray]:
    """torch's max_pool2d and its backward by their definition: each window gives the entry its
    scan (row-major, padding skipped) keeps, one greater than the maximum so far or NaN, and
    that entry gets the window's ``dy``. Returns the pooled values and ``dx``."""
    dx = np.zeros_like(x, dtype=np.float64)
    y = np.zeros(dy.shape, dtype=np.float64)
    for n, c, i, j in itertools.product(*(range(s) for s in dy.shape)):
        best, at = -np.inf, None
        for a, b in itertools.product(range(window), range(window)):
            r, s = i * stride - padding + a, j * stride - padding + b
            if 0 <= r < x.shape[2] and 0 <= s < x.shape[3]:
                value = x[n, c, r, s]
                if at is None or value > best or np.isnan(value):
                    best, at = value, (r, s)
        assert at is not None
        dx[n, c, at[0], at[1]] += dy[n, c, i, j]
        y[n, c, i, j] = x[n, c, at[0], at[1]]
    return y, dx


@pytest.mark.parametrize(("window", "stride", "padding"), [(3, 2, 1), (2, 2, 0), (3, 1, 1), (3, 3, 0), (4, 4, 0)])
def test_max_pool_gives_a_tied_window_its_first_maximum(window: int, stride: int, padding: int) -> None:
    """After a ReLU whole windows tie at 0: as in torch, the first maximum in the window gets all
    of ``dy`` (``maximum``'s own rule would split it), and a window with NaN gives NaN and its
    gradient to its last NaN."""
    shape = (2, 3, 7, 8)
    g = Graph("pool_ties")
    x = g.input("x", shape)
    y = g.max_pool(x, window, stride, padding)
    dy = g.input("dy", y.shape)
    (dx,) = rlx.grad(g, y, [x], dy)
    g.output(y=y, dx=dx)
    rng = np.random.default_rng(17)
    xv = np.maximum(rng.integers(-2, 3, shape), 0).astype(np.float32)  # ties everywhere
    xv[0, 0, 1, 1] = xv[0, 0, 1, 2] = xv[1, 2, 4, 4] = np.nan
    xv[1, 1] = -np.inf  # a plane of -inf: every window keeps its first entry inside x
    xv[0, 2, 3, 3] = np.inf
    dyv = rng.standard_normal(y.shape).astype(np.float32)
    exe = rlx.compile(g)
    got = exe(x=xv, dy=dyv)
    if stride != window or padding:  # (tiling windows are one reduction)
        # The maximum's position is picked once and read there; the gradient is one scatter-add.
        assert [k.name for k in exe.kernels].count("scatter_add_along_axis") == 1
    values, want = first_maximum_pooling(xv, dyv, window, stride, padding)
    assert np.isnan(values).any()
    np.testing.assert_array_equal(got["y"], values)  # NaN where the window holds one
    np.testing.assert_allclose(got["dx"], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(rlx.reference.run(g, x=xv, dy=dyv)["dx"], want, rtol=1e-6, atol=1e-6)
    torch = pytest.importorskip("torch")
    xt = torch.tensor(xv, requires_grad=True)
    yt = torch.nn.functional.max_pool2d(xt, window, stride, padding)
    yt.backward(torch.from_numpy(dyv))
    np.testing.assert_array_equal(got["y"], yt.detach().numpy())
    np.testing.assert_allclose(got["dx"], xt.grad.numpy(), rtol=1e-6, atol=1e-6)


def direct_pooling(x: np.ndarray, kind: str, window: int, stride: int, padding: int, ceil_mode: bool,
                   count_include_pad: bool = True, divisor: int | None = None) -> np.ndarray:  # fmt: skip
    """torch's 2-d pooling by its definition (``pooling_output_shape`` and the CPU kernels'
    window bounds): float64, ``x [N, C, H, W]``."""

    def size(n: int) -> int:
        span = n + 2 * padding - window
        if not ceil_mode:
            return span // stride + 1
        out = -(-span // stride) + 1
        return out - 1 if (out - 1) * stride >= n + padding else out

    rows, cols = size(x.shape[2]), size(x.shape[3])
    out = np.zeros((*x.shape[:2], rows, cols))
    for i, j in itertools.product(range(rows), range(cols)):
        r0, c0 = i * stride - padding, j * stride - padding
        r1, c1 = min(r0 + window, x.shape[2] + padding), min(c0 + window, x.shape[3] + padding)
        whole = (r1 - r0) * (c1 - c0)
        patch = x[:, :, max(r0, 0) : min(r1, x.shape[2]), max(c0, 0) : min(c1, x.shape[3])]
        if kind == "max":
            out[:, :, i, j] = patch.max(axis=(2, 3))
        else:
            count = divisor or (whole if count_include_pad else patch.shape[2] * patch.shape[3])
            out[:, :, i, j] = patch.sum(axis=(2, 3)) / count
    return out


@pytest.mark.parametrize(
    ("kind", "window", "stride", "padding", "include_pad", "divisor"),
    [("max", 3, 2, 1, True, None), ("max", 2, 2, 0, True, None), ("max", 3, 3, 0, True, None),
     ("avg", 3, 2, 1, True, None), ("avg", 3, 2, 1, False, None), ("avg", 2, 3, 1, True, None),
     ("avg", 3, 2, 0, True, 4)],
)  # fmt: skip
@pytest.mark.parametrize("ceil_mode", [True, False])
def test_pooling_in_ceil_mode_and_with_a_divisor(
    kind: str, window: int, stride: int, padding: int, include_pad: bool, divisor: int | None, ceil_mode: bool
) -> None:
    """``ceil_mode`` takes one more window where the last only partly fits (not one starting past
    the input and its left padding); an average divides by the entries of ``x`` and its padding
    the window covers (never past the padding), by those of ``x`` alone, or by ``divisor_override``:
    values against the definition, gradients against central differences (one channel: the
    differences over every entry are most of the time, and channels pool apart)."""
    shape = (2, 1, 8, 7)
    g = Graph("pool_ceil")
    x = g.input("x", shape)
    if kind == "max":
        y = g.max_pool(x, window, stride, padding, ceil_mode=ceil_mode)
    else:
        y = g.avg_pool(x, window, stride, padding, include_pad, ceil_mode, divisor)
    weights = np.random.default_rng(18).standard_normal(y.shape)
    (dx,) = rlx.grad(g, g.sum(y * g.constant(weights.astype(np.float32))), [x])
    g.output(y=y, dx=dx)
    xv = np.random.default_rng(19).standard_normal(shape)
    got = rlx.compile(g)(x=xv.astype(np.float32))
    want = direct_pooling(xv, kind, window, stride, padding, ceil_mode, include_pad, divisor)
    assert got["y"].shape == want.shape
    np.testing.assert_allclose(got["y"], want, rtol=1e-5, atol=1e-6)

    def loss() -> float:
        return float(
            np.sum(direct_pooling(xv, kind, window, stride, padding, ceil_mode, include_pad, divisor) * weights)
        )

    np.testing.assert_allclose(got["dx"], central_differences(loss, xv), rtol=1e-3, atol=1e-4)


def direct_adaptive(x: np.ndarray, kind: str, outs: tuple[int, ...]) -> np.ndarray:
    """torch's adaptive pooling by its definition: output ``i`` of an axis of length ``L`` pools
    entries ``floor(i*L/out)`` to ``ceil((i+1)*L/out)``."""
    spatial = x.ndim - 2
    out = np.zeros((*x.shape[:2], *outs))
    for position in itertools.product(*(range(o) for o in outs)):
        window = tuple(
            slice(i * n // o, -(-(i + 1) * n // o)) for i, n, o in zip(position, x.shape[2:], outs, strict=True)
        )
        patch = x[(slice(None), slice(None), *window)]
        axes = tuple(range(2, spatial + 2))
        out[(slice(None), slice(None), *position)] = patch.max(axis=axes) if kind == "max" else patch.mean(axis=axes)
    return out


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize(
    ("shape", "output_size", "outs"),
    [((2, 3, 10), 4, (4,)), ((2, 2, 7, 9), (3, None), (3, 9)), ((1, 2, 5, 5), 7, (7, 7)),
     pytest.param((1, 2, 5, 6, 7), (2, 3, 4), (2, 3, 4), marks=pytest.mark.slow),  # 3-D: a slow case
     ((2, 2, 8, 6), (4, 2), (4, 2)), ((2, 3, 12, 10), 1, (1, 1)),
     ((2, 2, 8, 6), (2, 1), (2, 1))],
)  # fmt: skip
def test_adaptive_pooling_against_the_definition(
    kind: str, shape: tuple[int, ...], output_size: object, outs: tuple[int, ...]
) -> None:
    """Adaptive pooling to sizes that do not divide the axes (windows of different lengths,
    overlapping where the output is longer), and to sizes that do: values against the
    definition, gradients against central differences; a tied maximum's gradient goes to the
    window's first (row-major), as torch's."""
    g = Graph("adaptive")
    x = g.input("x", shape)
    y = g.adaptive_max_pool(x, output_size) if kind == "max" else g.adaptive_avg_pool(x, output_size)  # type: ignore[arg-type]
    weights = np.random.default_rng(20).standard_normal(y.shape)
    (dx,) = rlx.grad(g, g.sum(y * g.constant(weights.astype(np.float32))), [x])
    g.output(y=y, dx=dx)
    xv = np.random.default_rng(21).standard_normal(shape)
    got = rlx.compile(g)(x=xv.astype(np.float32))
    np.testing.assert_allclose(got["y"], direct_adaptive(xv, kind, outs), rtol=1e-5, atol=1e-6)

    def loss() -> float:
        return float(np.sum(direct_adaptive(xv, kind, outs) * weights))

    np.testing.assert_allclose(got["dx"], central_differences(loss, xv), rtol=1e-3, atol=1e-4)
    if kind == "max":
        torch = pytest.importorskip("torch")
        ties = np.maximum(np.round(xv), 0).astype(np.float32)
        got = rlx.compile(g)(x=ties)
        xt = torch.tensor(ties, requires_grad=True)
        yt = getattr(torch.nn.functional, f"adaptive_max_pool{len(shape) - 2}d")(xt, output_size)
        (yt * torch.from_numpy(weights.astype(np.float32))).sum().backward()
        np.testing.assert_array_equal(got["y"], yt.detach().numpy())
        np.testing.assert_allclose(got["dx"], xt.grad.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["max", "avg"])
def test_global_pooling_is_one_reduction(kind: str) -> None:
    """Windows that tile the input (a global pool, a 4x4 pool of stride 4) pool by one reduction
    over the window's entries: a handful of nodes, not one slice per entry (576 slices of a
    24x24 map, read inline by a max pool's gradient, took LLVM minutes to compile)."""
    g = Graph("global_pool")
    x = g.input("x", (2, 4, 24, 24))
    y = g.adaptive_max_pool(x, 1) if kind == "max" else g.adaptive_avg_pool(x, 1)
    assert len(g.nodes) <= 20, g
    (dx,) = rlx.grad(g, g.sum(y * y), [x])
    g.output(y=y, dx=dx)
    xv = np.random.default_rng(22).standard_normal((2, 4, 24, 24)).astype(np.float32)
    got = rlx.compile(g)(x=xv)
    want = xv.max(axis=(2, 3), keepdims=True) if kind == "max" else xv.mean(axis=(2, 3), keepdims=True)
    np.testing.assert_allclose(got["y"], want, rtol=1e-5, atol=1e-6)
    if kind == "avg":
        np.testing.assert_allclose(got["dx"], np.broadcast_to(2 * want / 576, xv.shape), rtol=1e-5, atol=1e-8)
    else:
        np.testing.assert_allclose(got["dx"], np.where(xv == want, 2 * want, 0.0), rtol=1e-6)


def test_max_pool_of_planes_too_large_for_float_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planes of 2^24 entries or more (whose positions float32 cannot hold exactly) take the
    maximum by a chain of selects instead: the same values and gradients."""
    from rlx.ops import conv

    monkeypatch.setattr(conv, "EXACT_FLOAT_POSITIONS", 1)
    shape = (2, 2, 7, 8)
    g = Graph("pool_chain")
    x = g.input("x", shape)
    y = g.max_pool(x, 3, 2, 1)
    dy = g.input("dy", y.shape)
    (dx,) = rlx.grad(g, y, [x], dy)
    g.output(y=y, dx=dx)
    rng = np.random.default_rng(5)
    xv = np.maximum(rng.integers(-2, 3, shape), 0).astype(np.float32)
    xv[0, 1, 2, 2] = np.nan
    dyv = rng.standard_normal(y.shape).astype(np.float32)
    exe = rlx.compile(g)
    assert "scatter_add_along_axis" not in [k.name for k in exe.kernels]
    got = exe(x=xv, dy=dyv)
    values, want = first_maximum_pooling(xv, dyv, 3, 2, 1)
    np.testing.assert_array_equal(got["y"], values)
    np.testing.assert_allclose(got["dx"], want, rtol=1e-6, atol=1e-6)
