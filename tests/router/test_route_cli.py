"""`radixlm route` / `serve --dp-size` flags: bad ones exit != 0 with one line saying what to change."""

from __future__ import annotations

import pytest

from radixlm.cli import build_route_parser, main, replica_args, router_options
from radixlm.router.launcher import replica_env


@pytest.mark.parametrize(("argv", "says"), [
    (["route"], "give at least one worker: --worker-urls"),
    (["route", "--worker-urls", "localhost:3"], "fix --worker-urls"),
    (["route", "--worker-urls", "http://a:1", "--cache-threshold", "2"], "--cache-threshold must be in [0, 1]"),
    (["route", "--worker-urls", "http://a:1", "--policy", "nope"], "argument --policy: invalid choice: 'nope'"),
    (["route", "--worker-urls", "http://a:1", "--port", "x"], "argument --port: invalid int value: 'x'"),
    (["serve", "--dp-size", "0"], "--dp-size must be >= 1"),
])
def test_bad_flags_one_line(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_flags_come_from_the_config() -> None:
    ns = build_route_parser().parse_args(["--worker-urls", "http://a:1", "http://b:2", "--policy", "round_robin",
                                          "--balance-abs-threshold", "4", "--api-key", "k"])
    opts = router_options(ns)
    assert opts["api_key"] == "k" and router_options(build_route_parser().parse_args([]))["api_key"] is None
    assert opts["worker_urls"] == ["http://a:1", "http://b:2"] and opts["policy"] == "round_robin"
    assert opts["balance_abs_threshold"] == 4 and opts["cache_threshold"] == 0.5  # the dataclass default


def test_replica_args_and_env() -> None:
    argv = ["--dp-size", "2", "--port=8000", "--dtype", "float32", "--host", "0.0.0.0", "--router-policy",
            "round_robin", "--router-cache-threshold=0.3", "--api-key", "k"]
    assert replica_args(argv) == ["--dtype", "float32", "--api-key", "k"]
    assert replica_env(3, 4, 2, {"CUDA_VISIBLE_DEVICES": "4,5"})["CUDA_VISIBLE_DEVICES"] == "5"
    assert replica_env(1, 2, 2, {})["CUDA_VISIBLE_DEVICES"] == "1"
    assert "OMP_NUM_THREADS" in replica_env(0, 2, 0, {}) and replica_env(0, 2, 0, {"OMP_NUM_THREADS": "7"}) == \
        {"OMP_NUM_THREADS": "7"}


def test_router_imports_neither_torch_nor_the_runtime() -> None:
    import subprocess
    import sys

    code = ("import sys, radixlm.router.app, radixlm.router.launcher, radixlm.router.runner; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('radixlm.runtime')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
