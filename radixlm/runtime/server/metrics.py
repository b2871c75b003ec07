"""Prometheus metrics, in a registry owned by one app (no process-global collectors)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
_HIT_BUCKETS = (0.0, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)
_PROGRAM_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0)
_ACCEPT_BUCKETS = tuple(float(n) for n in range(17))  # guessed tokens accepted per checked draft (at most 16)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """Latencies and token counts observed by the server; engine state refreshed from its stats."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("radixlm_time_to_first_token_seconds",
                              "Time from request arrival to its first output token.", buckets=_TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("radixlm_inter_token_latency_seconds",
                             "Time between consecutive output tokens of a request.", buckets=_ITL_BUCKETS,
                             registry=r)
        self.e2e = Histogram("radixlm_e2e_request_latency_seconds",
                             "Time from request arrival to its last output.", buckets=_E2E_BUCKETS, registry=r)
        self.spec_accepted = Histogram("radixlm_spec_accepted_tokens",
                                       "Per draft checked (speculative decoding): the guessed tokens accepted.",
                                       buckets=_ACCEPT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("radixlm_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("radixlm_generation_tokens", "Generated tokens.", registry=r)
        self.cached_tokens = Counter("radixlm_cached_prompt_tokens",
                                     "Prompt tokens read from the radix cache instead of computed.", registry=r)
        self.requests = Counter("radixlm_requests", "Finished engine requests by finish reason.",
                                ["finish_reason"], registry=r)
        self.http_responses = Counter("radixlm_http_responses", "HTTP responses by status code.", ["status"],
                                      registry=r)
        self.running = Gauge("radixlm_num_running_requests", "Requests in the running batch.", registry=r)
        self.waiting = Gauge("radixlm_num_waiting_requests", "Requests waiting for admission.", registry=r)
        self.kv_used = Gauge("radixlm_kv_slots_used", "KV token slots held by requests in flight.", registry=r)
        self.kv_total = Gauge("radixlm_kv_slots_total", "KV token slots in the pool.", registry=r)
        self.cache_tokens = Gauge("radixlm_radix_cache_tokens", "Tokens held by the radix cache.", registry=r)
        self.cache_hit_rate = Gauge("radixlm_radix_cache_hit_rate",
                                    "Share of finished requests' prompt tokens read from the cache.", registry=r)
        self.retractions = Gauge("radixlm_retractions", "Requests retracted since start (decode out of KV).",
                                 registry=r)
        self.engine_up = Gauge("radixlm_engine_up", "1 while the engine process serves requests.", registry=r)
        self.engine_crashes = Counter("radixlm_engine_crashes", "Times the engine process died.", registry=r)
        self.engine_restarts = Counter("radixlm_engine_restarts",
                                       "Times a fresh engine process was started after a crash.", registry=r)
        self.slow_client_aborts = Counter("radixlm_slow_client_aborts",
                                          "Requests aborted because their client did not read its stream: "
                                          "write_timeout or pending_outputs.", ["reason"], registry=r)
        self.sessions_open = Gauge("radixlm_sessions_open", "Open multi-turn sessions.", registry=r)
        self.session_pinned = Gauge("radixlm_session_pinned_tokens",
                                    "KV tokens pinned by sessions between turns (summed per session).", registry=r)
        self.session_turns = Counter("radixlm_session_turns", "Finished session turns.", registry=r)
        self.session_history = Counter("radixlm_session_history_tokens",
                                       "Prompt tokens of session turns that came from their history.", registry=r)
        self.session_cached = Counter("radixlm_session_cached_tokens",
                                      "Prompt tokens of session turns read from the cache.", registry=r)
        self.session_hit = Histogram("radixlm_session_turn_hit_ratio",
                                     "Per session turn: cached tokens / history tokens (turns with history).",
                                     buckets=_HIT_BUCKETS, registry=r)

        self.programs_running = Gauge("radixlm_programs_running", "POST /run_program programs in flight.",
                                      registry=r)
        self.programs_finished = Counter("radixlm_programs_finished",
                                         "POST /run_program programs that ended, by outcome: ok, error (a node "
                                         "failed) or abort (the client left).", ["outcome"], registry=r)
        self.program_latency = Histogram("radixlm_program_latency_seconds",
                                         "Time from a /run_program request to its program's end (ok or error).",
                                         buckets=_PROGRAM_BUCKETS, registry=r)
        self.program_round_trips_saved = Counter(
            "radixlm_program_round_trips_saved",
            "Engine requests that programs sent in-process (gens, selects' scoring, fork prefills): HTTP round "
            "trips a client-driven program would have made.", registry=r)

    def observe_finished(self, meta: Mapping[str, Any], e2e_seconds: float) -> None:
        self.e2e.observe(e2e_seconds)
        self.prompt_tokens.inc(int(meta.get("prompt_tokens", 0)))
        self.generation_tokens.inc(int(meta.get("completion_tokens", 0)))
        self.cached_tokens.inc(int(meta.get("cached_tokens", 0)))
        reason = (meta.get("finish_reason") or {}).get("type") or "unknown"
        self.requests.labels(reason).inc()
        for accepted in meta.get("spec_accept_lengths") or ():
            self.spec_accepted.observe(accepted)
        if meta.get("session_id") is not None and reason != "abort":
            history, cached = int(meta.get("session_history_tokens", 0)), int(meta.get("cached_tokens", 0))
            self.session_turns.inc()
            self.session_history.inc(history)
            self.session_cached.inc(cached)
            if history:
                self.session_hit.observe(min(cached / history, 1.0))

    def observe_unfinished(self, outcome: str) -> None:
        """A request that ended without a final output: 'abort' (client gone) or 'error'."""
        self.requests.labels(outcome).inc()

    def refresh(self, stats: Mapping[str, Any] | None) -> None:
        """Engine gauges from a `stats` reply; None: the engine is not serving."""
        self.engine_up.set(0 if stats is None else 1)
        if stats is None:
            return
        self.running.set(stats["running_requests"])
        self.waiting.set(stats["waiting_requests"])
        self.kv_used.set(stats["kv_slots_used_by_requests"])
        self.kv_total.set(stats["kv_slots_total"])
        self.cache_tokens.set(stats["cache_tokens"])
        self.retractions.set(stats["retractions"])
        self.cache_hit_rate.set(cache_hit_rate(stats))
        self.sessions_open.set(stats.get("sessions_open", 0))
        self.session_pinned.set(stats.get("session_pinned_tokens", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def cache_hit_rate(stats: Mapping[str, Any]) -> float:
    prompt = stats.get("prompt_tokens_total", 0)
    return stats.get("cached_tokens_total", 0) / prompt if prompt else 0.0
