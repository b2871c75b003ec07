"""`radixlm` command line: engine flags come from the config dataclasses, choices from registries."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import typing
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from radixlm.runtime.config import COMPONENT_TYPES, DTYPES, JSON_WHITESPACE, SPECULATIVE_ALGORITHMS

if TYPE_CHECKING:
    from radixlm.router.config import RouterConfig

HELP = {
    "model": "built-in name, HF model folder, .gguf file, or dummy:<config>",
    "cache_dir": "where converted models are kept (default $RADIXLM_CACHE or ~/.cache/radixlm)",
    "cache": "prefix cache: radix shares prefixes, none is the no-sharing twin",
    "max_total_tokens": "KV pool size in tokens (default: from --mem-fraction)",
    "chunked_prefill_size": "prompt tokens per step while other requests decode or wait; 0 turns chunking off",
    "max_prefill_tokens": "prompt tokens per step without chunking, and for a prompt alone on the server",
    "tp_size": "tensor-parallel ranks, one process each (NCCL on CUDA, gloo on CPU); default: 1",
    "dist_timeout": "seconds a collective waits for a rank before the engine restarts; default: 120",
    "speculative_algorithm": "guess a greedy request's next tokens and check them in one forward pass: ngram (its own "
                             "prompt and output), radix (the radix cache first, then as ngram), none; default: none",
    "speculative_num_draft_tokens": "the most guessed tokens a step checks for a request (1-16); default: 4",
    "dtype": "auto: bf16 on CUDA and on CPUs with native bf16 (avx512_bf16/AMX), else fp32",
    "quantization": "weight-only CPU quantization; auto: a GGUF's own 4-bit weights on a bf16 CPU, fp16 weights "
                    "(FBGEMM) in fp32 without native bf16, else none",
    "quant_dense_above": "quantized layers multiply a dense weight copy at steps of more rows (default: 1 under auto)",
    "program_active_cap": "program scheduling: new programs start only while fewer started ones are under way "
                          "(default 0: twice --max-running-requests)",
    "program_gap_steps": "program scheduling: steps a client-named program between two of its requests still "
                         "counts as under way (default: 8; a /run_program program counts until it ends)",
}


def _choices() -> dict[str, Sequence[str]]:
    from radixlm.runtime.constrained import GRAMMAR_BACKENDS
    from radixlm.runtime.kernels.attention import ATTENTION_BACKENDS
    from radixlm.runtime.model.quant_linear import QUANT_METHODS
    from radixlm.runtime.radix_cache import CACHES
    from radixlm.runtime.scheduler import POLICIES

    return {"dtype": DTYPES, "quantization": ("auto", "none", *sorted(QUANT_METHODS)), "cache": sorted(CACHES), "policy": sorted(POLICIES),
            "attention_backend": sorted(ATTENTION_BACKENDS), "grammar_backend": sorted(GRAMMAR_BACKENDS),
            "json_whitespace": JSON_WHITESPACE, "speculative_algorithm": SPECULATIVE_ALGORITHMS}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field (--max-total-tokens ...), defaults from the dataclasses."""
    choices = _choices()
    for cls in COMPONENT_TYPES:
        group = parser.add_argument_group(cls.__name__)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            kind = _scalar(hints[f.name])
            group.add_argument(
                "--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=default,
                choices=choices.get(f.name), help=HELP.get(f.name, f"default: {default}"),
            )
    parser.add_argument("--attention-backend", default=None, choices=choices["attention_backend"],
                        help="default: triton on CUDA, torch elsewhere")


def _scalar(hint: Any) -> Callable[[str], Any]:
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if args[0] is bool:
        return _parse_bool
    return args[0] if args[0] in (int, float, str) else str


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def engine_options(ns: argparse.Namespace) -> dict[str, Any]:
    names = {f.name for cls in COMPONENT_TYPES for f in dataclasses.fields(cls)}
    opts = {k: v for k, v in vars(ns).items() if k in names and v is not None}
    opts["attention_backend"] = ns.attention_backend
    return opts


# `radixlm generate` decodes greedily unless asked otherwise (the runtime's own default temperature is 1).
GENERATE_DEFAULTS: dict[str, Any] = {"temperature": 0.0}
_SAMPLING_DEST = "sampling."


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per SamplingParams field (--top-p, --stop ...), from its declaration. A name an engine
    flag already has (--seed, --jump-forward) gets a --sampling- prefix."""
    from radixlm.runtime.sampling_params import DEFAULTS, PARAMS

    engine = {f.name for cls in COMPONENT_TYPES for f in dataclasses.fields(cls)} | {"attention_backend"}
    group = parser.add_argument_group("SamplingParams", "unset: the --sampling-params value, then the default")
    for name, p in PARAMS.items():
        flag = ("--sampling-" if name in engine else "--") + name.replace("_", "-")
        default = GENERATE_DEFAULTS.get(name, DEFAULTS[name])
        group.add_argument(flag, dest=_SAMPLING_DEST + name, default=None, metavar=name.upper(),
                           help=f"{p.help} (default: {'none' if default in ((), None) else default})",
                           **_sampling_flag(p.kind))


def _sampling_flag(kind: str) -> dict[str, Any]:
    if kind == "bool":
        return {"type": _parse_bool, "nargs": "?", "const": True}  # --flag alone means true
    if kind in ("stop", "stop_regex", "choices", "token_ids"):
        return {"type": int if kind == "token_ids" else str, "action": "append"}  # repeat the flag for more
    if kind == "logit_bias":
        return {"type": json.loads}  # a JSON object, e.g. '{"42": 5.0}'
    return {"type": {"int": int, "float": float, "seed": int}.get(kind, str)}


def sampling_options(ns: argparse.Namespace) -> dict[str, Any]:
    """The sampling parameters given as flags (a dict for SamplingParams.from_dict)."""
    return {k.removeprefix(_SAMPLING_DEST): v for k, v in vars(ns).items()
            if k.startswith(_SAMPLING_DEST) and v is not None}


def generate_params(ns: argparse.Namespace) -> Any:
    """The SamplingParams of `radixlm generate`: flags over --sampling-params over GENERATE_DEFAULTS."""
    from radixlm.runtime.sampling_params import SamplingParams

    given = json.loads(ns.sampling_params) if ns.sampling_params else {}
    if not isinstance(given, dict):
        raise ValueError("--sampling-params must be a JSON object, e.g. '{\"top_p\": 0.9}'")  # noqa: TRY004
    return SamplingParams.from_dict({**GENERATE_DEFAULTS, **given, **sampling_options(ns)})


def _generate(ns: argparse.Namespace) -> int:
    from radixlm.runtime.engine import Engine

    params = generate_params(ns)
    t0 = time.perf_counter()
    engine = Engine(**engine_options(ns))
    load = time.perf_counter() - t0
    prompt: Any = [{"role": "user", "content": ns.prompt}] if ns.chat else ns.prompt
    meta: dict[str, Any] = {}
    if params.n > 1:  # several completions: printed one after another when all are done
        outs = engine.generate(prompt, params)
        for i, out in enumerate(outs if isinstance(outs, list) else [outs]):
            sys.stdout.write(f"{'' if i == 0 else chr(10)}--- completion {i}\n{out['text']}\n")
            meta = out["meta_info"]
    else:
        for chunk in engine.stream(prompt, params):
            sys.stdout.write(chunk["text"])
            sys.stdout.flush()
            meta = chunk["meta_info"] or meta
        sys.stdout.write("\n")
    engine.shutdown()
    if ns.verbose:
        n, dt = meta.get("completion_tokens", 0), meta.get("e2e_latency", 0.0)
        print(f"[load {load:.1f}s, {n} tokens in {dt:.2f}s, ttft {meta.get('ttft') or 0:.3f}s, "
              f"finish {meta.get('finish_reason')}]", file=sys.stderr)
    return 0


API_KEY_FILE_HELP = "read the API key from this file's first line (else --api-key, else $RADIXLM_API_KEY)"
SERVER_HELP = {
    "host": "address to listen on",
    "port": "port to listen on (0: any free port, logged at start)",
    "api_key": "require 'Authorization: Bearer <key>' on every route but /health",
    "max_queued_requests": "engine requests in flight (running + waiting) before new ones get 429",
    "max_request_bytes": "largest request body accepted (larger: 413)",
    "shutdown_grace": "seconds in-flight requests get to finish after SIGTERM/SIGINT, then they are aborted",
    "served_model_name": "model id reported by /v1/models (default: the model's name)",
    "max_top_logprobs": "largest top_logprobs_num / top_logprobs / logprobs a request may ask for",
    "restart_on_failure": "start a fresh engine process when it dies (at most --max-restarts per --restart-window); "
                          "on by default, '--restart-on-failure false' turns it off",
    "max_restarts": "engine restarts allowed within --restart-window; past it the server answers 503 until restarted",
    "restart_window": "seconds over which --max-restarts is counted",
    "stream_write_timeout": "seconds a stream may wait for its client to read; then the request is aborted "
                            "and the connection closed",
    "max_pending_outputs": "engine outputs one request may have waiting for its HTTP handler; then it is aborted",
    "debug_routes": "serve GET /debug/check: KV accounting and the radix cache's integrity check",
    "header_timeout": "seconds a connection may take to send a request's headers; then it is closed (slowloris)",
    "body_timeout": "seconds a request's body may take to arrive; then 408",
    "max_response_bytes": "what one response may cost, estimated before it runs (400) and metered on streams",
    "max_stop_bytes": "UTF-8 bytes of one request's stop strings and stop_regex patterns in all (more: 400)",
    "max_sessions": "open sessions at most; /open_session past it answers 429",
    "max_session_ttl": "the largest ttl /open_session accepts, in seconds",
    "special_tokens_in_content": "read special-token text in chat message content as control tokens "
                                 "(the old behaviour: lets a user inject roles)",
    "max_program_nodes": "POST /run_program: nodes one request graph may hold (fork branches' included)",
    "max_program_fork_width": "POST /run_program: branches one fork may have",
    "max_program_fork_depth": "POST /run_program: forks nested in forks at most",
    "max_program_text_bytes": "POST /run_program: UTF-8 bytes of a graph's texts and select choices",
    "max_program_gens": "POST /run_program: generations one program may run (n samples count n)",
}


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ServerSettings field, defaults from the dataclass."""
    from radixlm.runtime.server.settings import ServerSettings

    for cls in (ServerSettings, *_server_parts().values()):
        group = parser.add_argument_group(cls.__name__)
        hints = typing.get_type_hints(cls)
        for f in _flat_fields(cls):
            kind = _scalar(hints[f.name])
            switch: dict[str, Any] = {"nargs": "?", "const": True} if kind is _parse_bool else {}  # --flag: true
            group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=f.default,
                               help=f"{SERVER_HELP.get(f.name, '')} (default: {f.default})", **switch)
    group.add_argument("--api-key-file", default=None, help=API_KEY_FILE_HELP)


def _server_parts() -> dict[str, Any]:
    """ServerSettings' nested dataclasses by field name; their fields are flags of their own."""
    from radixlm.runtime.server.settings import ServerSettings

    return {f.name: f.default_factory for f in dataclasses.fields(ServerSettings)
            if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)}


def _flat_fields(cls: Any) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.default_factory is dataclasses.MISSING
            or not dataclasses.is_dataclass(f.default_factory)]


def server_settings(ns: argparse.Namespace) -> Any:
    import os

    from radixlm.runtime.server.settings import ServerSettings, resolve_api_key

    values: dict[str, Any] = {f.name: getattr(ns, f.name) for f in _flat_fields(ServerSettings)}
    for name, part in _server_parts().items():  # nested settings (e.g. /run_program's limits)
        values[name] = part(**{f.name: getattr(ns, f.name) for f in _flat_fields(part)})
    values["api_key"] = resolve_api_key(ns.api_key, getattr(ns, "api_key_file", None), os.environ)
    return ServerSettings(**values)


def _serve(ns: argparse.Namespace) -> int:
    import asyncio
    import logging

    from radixlm.runtime.config import EngineConfig
    from radixlm.runtime.server.runner import serve

    if ns.dp_size < 1:
        raise ValueError(f"--dp-size must be >= 1, got {ns.dp_size}")
    settings = server_settings(ns)
    config = EngineConfig.from_kwargs(**engine_options(ns))
    if config.parallel.tp_size > 1:  # a --tp-size that cannot work fails before the server starts
        from radixlm.runtime.engine_build import check_parallel

        check_parallel(config)
    if ns.dp_size > 1:
        return _serve_replicas(ns, settings.api_key)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return asyncio.run(serve(settings, config))


ROUTER_HELP = {
    "worker_urls": "the replicas: radixlm serve urls, e.g. http://127.0.0.1:30001 http://127.0.0.1:30002",
    "policy": "which worker gets a request: cache_aware (prefix affinity unless imbalanced), round_robin, "
              "shortest_queue (fewest in flight)",
    "host": "address to listen on",
    "port": "port to listen on (0: any free port, logged at start)",
    "cache_threshold": "cache_aware: share of the prompt a worker must already hold to get it",
    "balance_abs_threshold": "cache_aware: affinity is ignored when the in-flight counts differ by more than this",
    "balance_rel_threshold": "cache_aware: ... and the largest is more than this times the smallest",
    "max_tree_chars": "cache_aware: prompt characters remembered per worker (least recently used dropped)",
    "health_interval": "seconds between health checks of each worker",
    "health_timeout": "seconds a health check (and a connection to a worker) may take",
    "health_failures": "failed health checks in a row that take a worker out (a refused connection: at once)",
    "request_timeout": "seconds a request passed to a worker may take in all, streams included (then 504)",
    "max_request_bytes": "largest request body accepted (larger: 413)",
    "max_sessions": "session -> worker bindings kept (the oldest forgotten past it)",
    "shutdown_grace": "seconds in-flight requests get to finish after SIGTERM/SIGINT",
    "api_key": "require 'Authorization: Bearer <key>' on every route but /health and /openapi.json, checked by "
               "the router itself before routing (give it the replicas' key)",
}
# Flags of `radixlm serve --dp-size N` that the launcher sets for each replica itself.
_REPLICA_OWN = ("--dp-size", "--host", "--port")


def add_router_flags(parser: argparse.ArgumentParser, prefix: str = "", skip: Sequence[str] = ()) -> None:
    """One flag per RouterConfig field, defaults from the dataclass, policies from the registry."""
    from radixlm.router.config import RouterConfig
    from radixlm.router.policies import POLICIES

    group = parser.add_argument_group("RouterConfig")
    hints = typing.get_type_hints(RouterConfig)
    for f in dataclasses.fields(RouterConfig):
        if f.name in skip:
            continue
        flag, dest = "--" + prefix + f.name.replace("_", "-"), prefix.replace("-", "_") + f.name
        if f.name == "worker_urls":
            group.add_argument(flag, dest=dest, nargs="+", default=(), metavar="URL", help=ROUTER_HELP[f.name])
            continue
        group.add_argument(flag, dest=dest, type=_scalar(hints[f.name]), default=f.default,
                           choices=sorted(POLICIES) if f.name == "policy" else None,
                           help=f"{ROUTER_HELP.get(f.name, '')} (default: {f.default})")


def router_options(ns: argparse.Namespace, prefix: str = "") -> dict[str, Any]:
    """The RouterConfig fields given on the command line (with their flag prefix removed)."""
    from radixlm.router.config import RouterConfig

    key = prefix.replace("-", "_")
    names = {f.name for f in dataclasses.fields(RouterConfig)}
    return {k.removeprefix(key): v for k, v in vars(ns).items() if k.startswith(key) and k.removeprefix(key) in names}


def route_config(ns: argparse.Namespace) -> RouterConfig:
    """`radixlm route`'s RouterConfig: its flags, the API key taken as the server takes it (--api-key,
    else --api-key-file, else $RADIXLM_API_KEY; empty refused)."""
    import os

    from radixlm.router.config import RouterConfig
    from radixlm.runtime.server.settings import resolve_api_key

    api_key = resolve_api_key(ns.api_key, ns.api_key_file, os.environ)
    return RouterConfig(**{**router_options(ns), "worker_urls": tuple(ns.worker_urls), "api_key": api_key})


def _route(ns: argparse.Namespace) -> int:
    import asyncio
    import logging

    from radixlm.router.runner import route

    config = route_config(ns)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return asyncio.run(route(config))


def replica_args(argv: Sequence[str]) -> list[str]:
    """`radixlm serve` arguments without the launcher's own (--dp-size, --host, --port, --router-*)."""
    out, skip_value = [], False
    for arg in argv:
        if skip_value:
            skip_value = False
            continue
        name = arg.split("=", 1)[0]
        if name in _REPLICA_OWN or name.startswith("--router-"):
            skip_value = "=" not in arg
            continue
        out.append(arg)
    return out


def dp_router_options(ns: argparse.Namespace, api_key: str | None) -> dict[str, Any]:
    """The options of the router `radixlm serve --dp-size N` starts: its --router-* flags, the server's
    --host, --port and --shutdown-grace, and the replicas' own API key, which it then checks itself."""
    return {**router_options(ns, "router-"), "host": ns.host, "port": ns.port, "shutdown_grace": ns.shutdown_grace,
            "api_key": api_key}


def _serve_replicas(ns: argparse.Namespace, api_key: str | None) -> int:
    import asyncio
    import logging

    import torch

    from radixlm.router.launcher import serve_replicas

    argv = list(ns.argv)
    args = replica_args(argv[argv.index("serve") + 1:] if "serve" in argv else argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return asyncio.run(serve_replicas(args, ns.dp_size, gpus, dp_router_options(ns, api_key)))


class _OneLineParser(argparse.ArgumentParser):
    """Bad flags: one line saying what to change (no usage block), exit code 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_route_parser(parser_class: type[argparse.ArgumentParser] = _OneLineParser) -> argparse.ArgumentParser:
    route = parser_class(prog="radixlm route", description="route requests over radixlm serve replicas "
                         "(cache-aware by default; docs/router.md)")
    add_router_flags(route)
    route.add_argument("--api-key-file", default=None, help=API_KEY_FILE_HELP)
    route.set_defaults(func=_route)
    return route


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="radixlm", description="LM programs on a radix-tree KV cache runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt with the engine and stream the text")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as one user turn of the chat template")
    gen.add_argument("--sampling-params", help='JSON object of sampling params, e.g. \'{"top_p": 0.9}\'')
    gen.add_argument("-v", "--verbose", action="store_true", help="print timing to stderr")
    add_sampling_flags(gen)
    add_engine_flags(gen)
    gen.set_defaults(func=_generate)
    srv = sub.add_parser("serve", help="serve the model over HTTP (SGLang native and OpenAI-compatible APIs)")
    add_server_flags(srv)
    srv.add_argument("--dp-size", type=int, default=1,
                     help="data parallel: this many replicas on free local ports (one per GPU where there are "
                          "GPUs) behind a router on --host/--port (--router-* flags; docs/router.md)")
    add_router_flags(srv, "router-", skip=("worker_urls", "host", "port", "shutdown_grace", "api_key"))
    add_engine_flags(srv)
    srv.set_defaults(func=_serve)
    sub.add_parser("route", help="route requests over radixlm serve replicas (docs/router.md)", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["route"]:
        ns = build_route_parser().parse_args(args[1:])
    else:
        ns = build_parser().parse_args(args)
    ns.argv = args
    try:
        return int(ns.func(ns))
    except ValueError as e:
        print(f"radixlm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
