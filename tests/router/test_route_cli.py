"""`radixlm route` / `serve --dp-size` flags: bad ones exit != 0 with one line saying what to change."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixlm.cli import (
    build_parser,
    build_route_parser,
    dp_router_options,
    main,
    replica_args,
    route_config,
    router_options,
    server_settings,
)
from radixlm.router.launcher import replica_env
from radixlm.runtime.server.settings import API_KEY_ENV


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


def test_route_takes_the_key_as_the_server_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """--api-key, else --api-key-file, else $RADIXLM_API_KEY; an empty one is refused before anything starts."""
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")

    def key(*args: str) -> str | None:
        return route_config(build_route_parser().parse_args(["--worker-urls", "http://a:1", *args])).api_key

    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert (key("--api-key", "flag"), key("--api-key-file", str(key_file)), key()) == ("flag", "from-file", "from-env")
    with pytest.raises(ValueError, match="give --api-key or --api-key-file, not both"):
        key("--api-key", "flag", "--api-key-file", str(key_file))
    monkeypatch.delenv(API_KEY_ENV)
    assert key() is None
    monkeypatch.setenv(API_KEY_ENV, " ")
    assert main(["route", "--worker-urls", "http://a:1"]) == 2
    err = capsys.readouterr().err
    assert "RADIXLM_API_KEY is set but empty" in err and len(err.strip().splitlines()) == 1, err


def test_serve_dp_gives_its_router_the_replicas_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The router of `serve --dp-size N` checks the key itself: the one the replicas get, however given."""
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    for args, key in [(["--api-key", "flag"], "flag"), (["--api-key-file", str(key_file)], "from-file"), ([], "from-env")]:
        ns = build_parser().parse_args(["serve", "--dp-size", "2", "--router-policy", "round_robin", *args])
        options = dp_router_options(ns, server_settings(ns).api_key)
        assert options["api_key"] == key and options["policy"] == "round_robin"
        assert replica_args(["--dp-size", "2", *args]) == args  # the replicas read it the same way
    with pytest.raises(SystemExit):  # one key for all: no router-only key
        build_parser().parse_args(["serve", "--dp-size", "2", "--router-api-key", "k"])


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
