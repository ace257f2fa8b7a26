"""RuntimeConfig: defaults, validation, hashing (the compile cache keys on it) and env overrides."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

import rlx
from rlx import RuntimeConfig
from rlx.config import resolve_config, resolve_num_threads

ENV_VARS = ("RLX_NUM_THREADS", "RLX_ATTN_BWD_SERIAL")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Every test starts without the overrides, whatever the calling shell sets."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# ----------------------------------------------------------------------------- defaults and values


def test_defaults_match_the_spec() -> None:
    config = RuntimeConfig()
    assert config.attn_mask_neg_inf == -1e9
    assert config.mask_binary_threshold == 0.5
    assert config.num_threads is None
    assert rlx.RuntimeConfig is RuntimeConfig


def test_numbers_are_normalised_to_python_floats_and_ints() -> None:
    config = RuntimeConfig(attn_mask_neg_inf=-5, mask_binary_threshold=np.float32(0.25), num_threads=np.int64(3))
    assert config.attn_mask_neg_inf == -5.0 and type(config.attn_mask_neg_inf) is float
    assert config.mask_binary_threshold == 0.25 and type(config.mask_binary_threshold) is float
    assert config.num_threads == 3 and type(config.num_threads) is int
    assert config == RuntimeConfig(attn_mask_neg_inf=-5.0, mask_binary_threshold=0.25, num_threads=3)


@pytest.mark.parametrize("neg", [0.0, -0.0, -1.0, -1e30, -math.inf, np.float32(-1e9), np.float64(-2.0)])
def test_valid_neg_inf_values(neg: float) -> None:
    assert RuntimeConfig(attn_mask_neg_inf=neg).attn_mask_neg_inf == float(neg)


@pytest.mark.parametrize("threshold", [0.0, 0.5, 1.0, -3.0, math.inf, -math.inf])
def test_any_non_nan_threshold_is_valid(threshold: float) -> None:
    assert RuntimeConfig(mask_binary_threshold=threshold).mask_binary_threshold == threshold


BAD_CONFIGS = [
    # (kwargs, builtin, message fragment)
    ({"attn_mask_neg_inf": "-1e9"}, TypeError, "RuntimeConfig.attn_mask_neg_inf must be a float, got str"),
    ({"attn_mask_neg_inf": None}, TypeError, "attn_mask_neg_inf must be a float, got NoneType"),
    ({"attn_mask_neg_inf": True}, TypeError, "attn_mask_neg_inf must be a float, got bool"),
    ({"attn_mask_neg_inf": np.bool_(False)}, TypeError, "attn_mask_neg_inf must be a float, got bool"),
    ({"attn_mask_neg_inf": 1j}, TypeError, "attn_mask_neg_inf must be a float, got complex"),
    ({"attn_mask_neg_inf": math.nan}, ValueError, "attn_mask_neg_inf must be a non-positive number or -inf, got nan"),
    ({"attn_mask_neg_inf": 1.0}, ValueError, "attn_mask_neg_inf must be a non-positive number or -inf, got 1.0"),
    ({"attn_mask_neg_inf": math.inf}, ValueError, "non-positive number or -inf, got inf"),
    ({"attn_mask_neg_inf": -(10**400)}, ValueError, "RuntimeConfig.attn_mask_neg_inf must fit in a float, got -1000"),
    ({"mask_binary_threshold": "0.5"}, TypeError, "RuntimeConfig.mask_binary_threshold must be a float, got str"),
    ({"mask_binary_threshold": False}, TypeError, "mask_binary_threshold must be a float, got bool"),
    ({"mask_binary_threshold": math.nan}, ValueError, "RuntimeConfig.mask_binary_threshold must not be NaN"),
    ({"mask_binary_threshold": np.float32("nan")}, ValueError, "mask_binary_threshold must not be NaN"),
    ({"num_threads": 0}, ValueError, "RuntimeConfig.num_threads must be >= 1, got 0"),
    ({"num_threads": -2}, ValueError, "num_threads must be >= 1, got -2"),
    ({"num_threads": True}, TypeError, "RuntimeConfig.num_threads must be an int or None, got bool"),
    ({"num_threads": 2.0}, TypeError, "num_threads must be an int or None, got float"),
    ({"num_threads": "4"}, TypeError, "num_threads must be an int or None, got str"),
]


@pytest.mark.parametrize(
    ("kwargs", "builtin", "fragment"), BAD_CONFIGS, ids=[f"{i}-{next(iter(c[0]))}" for i, c in enumerate(BAD_CONFIGS)]
)
def test_bad_values_raise_rlx_errors(kwargs: dict, builtin: type[Exception], fragment: str) -> None:
    with pytest.raises(rlx.RlxError) as info:
        RuntimeConfig(**kwargs)
    assert isinstance(info.value, builtin), type(info.value).__mro__
    assert fragment in str(info.value)


def test_with_overrides_validates_like_the_constructor() -> None:
    base = RuntimeConfig()
    changed = base.with_overrides(num_threads=2, attn_mask_neg_inf=-math.inf)
    assert changed == RuntimeConfig(attn_mask_neg_inf=-math.inf, num_threads=2)
    assert base == RuntimeConfig(), "the original is unchanged"
    with pytest.raises(rlx.RlxValueError, match="num_threads must be >= 1"):
        base.with_overrides(num_threads=0)
    with pytest.raises(rlx.RlxTypeError, match=r"RuntimeConfig has no field 'threads'; fields: attn_mask_neg_inf, "):
        base.with_overrides(threads=2)


def test_config_is_frozen() -> None:
    config = RuntimeConfig()
    with pytest.raises(AttributeError):
        config.num_threads = 2  # type: ignore[misc]


def test_resolve_config_fills_the_default_and_checks_the_type() -> None:
    assert resolve_config(None) == RuntimeConfig()
    config = RuntimeConfig(num_threads=2)
    assert resolve_config(config) is config
    with pytest.raises(rlx.RlxTypeError, match=r"config must be an rlx\.RuntimeConfig, got dict"):
        resolve_config({"num_threads": 2})  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- hashing


def test_equal_configs_are_equal_and_hash_alike() -> None:
    """The compile cache keys on the config: equal settings must hit the same entry."""
    a = RuntimeConfig(attn_mask_neg_inf=-1e4, mask_binary_threshold=0.3, num_threads=2)
    b = RuntimeConfig(attn_mask_neg_inf=-10000, mask_binary_threshold=0.3, num_threads=np.int32(2))
    assert a == b and hash(a) == hash(b)
    assert RuntimeConfig() == RuntimeConfig() and hash(RuntimeConfig()) == hash(RuntimeConfig())
    assert RuntimeConfig(attn_mask_neg_inf=-math.inf) == RuntimeConfig(attn_mask_neg_inf=float("-inf"))
    assert len({a, b, RuntimeConfig(), RuntimeConfig(num_threads=3)}) == 3
    cache = {a: "compiled"}
    assert cache[b] == "compiled"


def test_different_configs_differ() -> None:
    base = RuntimeConfig()
    others = [
        RuntimeConfig(attn_mask_neg_inf=-math.inf),
        RuntimeConfig(mask_binary_threshold=0.75),
        RuntimeConfig(num_threads=1),
    ]
    assert all(other != base for other in others)
    assert len({base, *others}) == 4


# ----------------------------------------------------------------------------- environment


def test_default_threads_are_every_core() -> None:
    assert resolve_num_threads(RuntimeConfig()) == _cores()


def test_rlx_num_threads_sets_the_default(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("RLX_NUM_THREADS", "3")
    assert resolve_num_threads(RuntimeConfig()) == 3
    clean_env.setenv("RLX_NUM_THREADS", " 5 ")
    assert resolve_num_threads(RuntimeConfig()) == 5
    clean_env.setenv("RLX_NUM_THREADS", "")
    assert resolve_num_threads(RuntimeConfig()) == _cores(), "empty means unset"


def test_config_num_threads_wins_over_rlx_num_threads(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("RLX_NUM_THREADS", "3")
    assert resolve_num_threads(RuntimeConfig(num_threads=4)) == 4


@pytest.mark.parametrize("text", ["zero", "0", "-2", "2.5", "4_0", "+4", "\u0664", "1e3"])
def test_invalid_rlx_num_threads_names_the_variable(clean_env: pytest.MonkeyPatch, text: str) -> None:
    clean_env.setenv("RLX_NUM_THREADS", text)
    with pytest.raises(rlx.RlxValueError) as info:
        resolve_num_threads(RuntimeConfig())
    assert isinstance(info.value, ValueError)
    assert str(info.value) == f"RLX_NUM_THREADS must be a positive integer, got {text!r}"


def test_invalid_rlx_num_threads_is_ignored_when_the_config_decides(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("RLX_NUM_THREADS", "lots")
    assert resolve_num_threads(RuntimeConfig(num_threads=2)) == 2


@pytest.mark.parametrize("config", [RuntimeConfig(), RuntimeConfig(num_threads=4)])
def test_attn_bwd_serial_forces_one_thread(clean_env: pytest.MonkeyPatch, config: RuntimeConfig) -> None:
    clean_env.setenv("RLX_ATTN_BWD_SERIAL", "1")
    clean_env.setenv("RLX_NUM_THREADS", "8")
    assert resolve_num_threads(config) == 1


@pytest.mark.parametrize("text", ["", "0", " 0 "])
def test_attn_bwd_serial_off(clean_env: pytest.MonkeyPatch, text: str) -> None:
    clean_env.setenv("RLX_ATTN_BWD_SERIAL", text)
    assert resolve_num_threads(RuntimeConfig(num_threads=4)) == 4


def test_the_l2_caches_are_read_as_a_whole_number_per_core() -> None:
    """What decides whether attention kernels stream their outputs: positive, a multiple of the
    cores, and the sysfs figure where the kernel gives one."""
    from rlx.config import l2_cache_bytes, machine_cores

    total = l2_cache_bytes()
    assert total > 0 and total % machine_cores() == 0
    root = "/sys/devices/system/cpu/cpu0/cache"
    if os.path.isdir(root):
        for index in os.listdir(root):
            try:
                with open(os.path.join(root, index, "level")) as level, open(os.path.join(root, index, "size")) as size:
                    if level.read().strip() == "2" and size.read().strip().endswith("K"):
                        per_core = total // machine_cores()
                        assert per_core % 1024 == 0
            except OSError:
                continue
