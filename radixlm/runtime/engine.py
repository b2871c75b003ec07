"""Engine: the in-process runtime API (generate, async_generate, stream).

A single background thread owns the EngineCore and runs its step loop while work exists;
callers hand requests over through a queue and receive outputs through per-request sinks.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

from radixlm.runtime.config import EngineConfig
from radixlm.runtime.engine_core import EngineCore, RequestOutput
from radixlm.runtime.sampling_params import SamplingParams

Prompt = Union[str, Sequence[int], Sequence[Mapping[str, Any]]]
ParamsLike = Union[SamplingParams, Mapping[str, Any], None]


@dataclass(frozen=True)
class _Submit:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    sink: Any  # callable(RequestOutput | BaseException)


class Engine:
    """Load a model and serve generate() calls from any thread or event loop.

    `Engine(model="smollm2-135m-instruct", dtype="float32", max_total_tokens=4096, ...)`:
    keyword options are the fields of the config dataclasses in radixlm.runtime.config.
    """

    def __init__(self, model: str | None = None, **options: Any) -> None:
        if model is not None:
            options["model"] = model
        self.config = EngineConfig.from_kwargs(**options)
        self.core = EngineCore(self.config)
        self.tokenizer = self.core.tokenizer
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._sinks: dict[str, Any] = {}
        self._closed = False
        self._flush_waiters: list[threading.Event] = []
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="radixlm-engine", daemon=True)
        self._thread.start()

    # -- public API ----------------------------------------------------------------------
    def generate(
        self,
        prompt: Prompt | Sequence[Prompt] | None = None,
        sampling_params: ParamsLike | Sequence[ParamsLike] = None,
        *,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Complete one prompt (text, token ids or chat messages) or a list of them.

        Returns {"text", "output_ids", "meta_info"} per completion; a list when the input
        is a list or n > 1 (n completions per prompt, in order).
        """
        subs, single = self._prepare(prompt, input_ids, sampling_params, return_logprob,
                                     logprob_start_len, top_logprobs_num)
        results: dict[str, dict[str, Any]] = {}
        done = threading.Event()
        errors: list[BaseException] = []
        lock = threading.Lock()
        parts: dict[str, list[RequestOutput]] = {s.rid: [] for s in subs}

        def sink(out: RequestOutput | BaseException, rid: str) -> None:
            with lock:
                if isinstance(out, BaseException):
                    errors.append(out)
                    results[rid] = {}
                else:
                    parts[rid].append(out)
                    if out.finished:
                        results[rid] = _collect(parts[rid])
                if len(results) == len(subs):
                    done.set()

        self._submit(subs, sink)
        done.wait()
        if errors:
            raise errors[0]
        outs = [results[s.rid] for s in subs]
        return outs[0] if single else outs

    async def async_generate(self, prompt: Prompt | None = None, sampling_params: ParamsLike = None,
                             **kwargs: Any) -> dict[str, Any] | list[dict[str, Any]]:
        """generate() without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.generate(prompt, sampling_params, **kwargs)
        )

    def stream(self, prompt: Prompt | None = None, sampling_params: ParamsLike = None, *,
               input_ids: Sequence[int] | None = None, **kwargs: Any) -> Iterator[dict[str, Any]]:
        """Yield {"text": delta, "output_ids": delta, "finished", "meta_info"} chunks for one prompt."""
        subs, single = self._prepare(prompt, input_ids, sampling_params, kwargs.get("return_logprob", False),
                                     kwargs.get("logprob_start_len", -1), kwargs.get("top_logprobs_num", 0))
        if not single or len(subs) != 1:
            raise ValueError("stream() takes one prompt with n=1; call it once per prompt")
        q: queue.Queue[Any] = queue.Queue()
        self._submit(subs, lambda out, rid: q.put(out))
        finished = False
        try:
            while not finished:
                out = q.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield _chunk(out)
        finally:
            if not finished:
                self.abort(subs[0].rid)

    async def async_stream(self, prompt: Prompt | None = None, sampling_params: ParamsLike = None,
                           **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        """stream() for asyncio: chunks arrive through the event loop, no thread per request."""
        subs, single = self._prepare(prompt, kwargs.pop("input_ids", None), sampling_params,
                                     kwargs.get("return_logprob", False), kwargs.get("logprob_start_len", -1),
                                     kwargs.get("top_logprobs_num", 0))
        if not single or len(subs) != 1:
            raise ValueError("async_stream() takes one prompt with n=1")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._submit(subs, lambda out, rid: loop.call_soon_threadsafe(q.put_nowait, out))
        finished = False
        try:
            while not finished:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield _chunk(out)
        finally:
            if not finished:
                self.abort(subs[0].rid)

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    def flush_cache(self) -> None:
        """Wait until idle, then drop every cached prefix."""
        done = threading.Event()
        self._inbox.put(("flush", done))
        done.wait()

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._inbox.put(("stop", None))
            self._thread.join(timeout=30)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # -- request preparation -------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a text, a chat (list of {role, content}) or already-tokenized input."""
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        if prompt and all(isinstance(m, Mapping) for m in prompt):
            text = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise ValueError("a prompt must be a string, a list of token ids, or a list of chat messages")

    def _prepare(self, prompt, input_ids, sampling_params, return_logprob, logprob_start_len,
                 top_logprobs_num) -> tuple[list[_Submit], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        if input_ids is not None:
            batch = [input_ids] if input_ids and isinstance(input_ids[0], int) else list(input_ids)
            single = bool(input_ids) and isinstance(input_ids[0], int)
        else:
            single = isinstance(prompt, str) or (bool(prompt) and not isinstance(prompt[0], (str, list, tuple)))
            batch = [prompt] if single else list(prompt)
        if not batch:
            raise ValueError("no prompt given")
        plist = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(batch)
        if len(plist) != len(batch):
            raise ValueError(f"{len(plist)} sampling_params for {len(batch)} prompts; give one or one per prompt")
        subs: list[_Submit] = []
        for p, sp in zip(batch, plist):
            params = _params(sp)
            ids = self.encode(p)
            for i in range(params.n):
                copy = params
                if params.n > 1:  # each completion its own sample; seeded ones stay reproducible
                    seed = None if params.seed is None else params.seed + i
                    copy = SamplingParams.from_dict({**params.to_dict(), "n": 1, "seed": seed})
                rid = f"{uuid.uuid4().hex[:12]}-{next(self._ids)}"
                subs.append(_Submit(rid, ids, copy, return_logprob, logprob_start_len, top_logprobs_num, None))
        return subs, single and len(subs) == 1

    def _submit(self, subs: list[_Submit], sink: Any) -> None:
        if self._closed:
            raise RuntimeError("the engine is shut down")
        for s in subs:
            self._inbox.put(("add", s, sink))

    # -- the loop thread -----------------------------------------------------------------
    def _loop(self) -> None:
        core = self.core
        while True:
            block = not core.has_work
            try:
                while True:
                    msg = self._inbox.get(block=block)
                    block = False
                    if not self._handle(msg):
                        return
            except queue.Empty:
                pass
            if self._flush_waiters and not core.has_work:
                core.cache.reset()
                while self._flush_waiters:
                    self._flush_waiters.pop().set()
            if core.has_work:
                try:
                    outputs = core.step()
                except BaseException as e:  # a broken step fails its requests, not the engine
                    for rid in list(core.tracks):
                        core.abort(rid)
                        self._deliver_error(rid, e)
                    continue
                for out in outputs:
                    self._deliver(out)

    def _handle(self, msg: tuple) -> bool:
        kind = msg[0]
        if kind == "stop":
            for rid in list(self.core.tracks):
                out = self.core.abort(rid)
                if out:
                    self._deliver(out)
            return False
        if kind == "add":
            s, sink = msg[1], msg[2]
            self._sinks[s.rid] = sink
            try:
                self.core.add_request(s.rid, s.prompt_ids, s.params, s.return_logprob,
                                      s.logprob_start_len, s.top_logprobs_num)
            except ValueError as e:
                self._deliver_error(s.rid, e)
        elif kind == "abort":
            out = self.core.abort(msg[1])
            if out:
                self._deliver(out)
        elif kind == "flush":
            self._flush_waiters.append(msg[1])  # served once the running work drains
        return True

    def _deliver(self, out: RequestOutput) -> None:
        sink = self._sinks.get(out.rid)
        if out.finished:
            self._sinks.pop(out.rid, None)
        if sink is not None:
            sink(out, out.rid)

    def _deliver_error(self, rid: str, err: BaseException) -> None:
        sink = self._sinks.pop(rid, None)
        if sink is not None:
            sink(err, rid)


def _params(sp: ParamsLike) -> SamplingParams:
    if sp is None:
        return SamplingParams()
    if isinstance(sp, SamplingParams):
        return sp
    if isinstance(sp, Mapping):
        return SamplingParams.from_dict(sp)
    raise ValueError(f"sampling_params must be a dict or SamplingParams, got {type(sp).__name__}")


def _collect(parts: list[RequestOutput]) -> dict[str, Any]:
    return {
        "text": "".join(p.text_delta for p in parts),
        "output_ids": [t for p in parts for t in p.token_ids_delta],
        "meta_info": parts[-1].meta,
    }


def _chunk(out: RequestOutput) -> dict[str, Any]:
    return {"text": out.text_delta, "output_ids": out.token_ids_delta, "finished": out.finished,
            "meta_info": out.meta}
