"""Engine: the in-process runtime API (generate, async_generate, stream).

There is no background thread: whoever waits for results drives the EngineCore's step loop
(one caller at a time, under a lock; other callers wait for their outputs). A second thread
running torch next to the main thread's OpenMP pool slows every step (docs/machines.md), and the
server runs the core in its own process anyway.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

from radixlm.runtime.config import EngineConfig
from radixlm.runtime.engine_core import EngineCore, RequestOutput
from radixlm.runtime.intake import PromptRequest, Submission, submissions
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.session_handle import Session
from radixlm.runtime.sessions import SessionParams
from radixlm.runtime.tokenizer_lock import encoding_lock

Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]
ParamsLike = SamplingParams | Mapping[str, Any] | None


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
        self._lock = threading.RLock()
        self._boxes: dict[str, _Box] = {}
        self._closed = False
        self._ids = itertools.count()

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
        session_params: SessionParams | Mapping[str, Any] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Complete one prompt (text, token ids or chat messages) or a list of them.

        Returns {"text", "output_ids", "meta_info"} per completion; a list when the input
        is a list or n > 1 (n completions per prompt, in order). With ``session_params`` the
        prompt is a new turn of an open session (see ``open_session``; one prompt, n = 1).
        """
        subs, single = self._prepare(prompt, input_ids, sampling_params, return_logprob,
                                     logprob_start_len, top_logprobs_num, session_params)
        boxes = self._submit(subs)
        self._drive(lambda: all(b.finished for b in boxes))
        outs = [b.result() for b in boxes]
        return outs[0] if single else outs

    async def async_generate(self, prompt: Prompt | Sequence[Prompt] | None = None,
                             sampling_params: ParamsLike | Sequence[ParamsLike] = None,
                             **kwargs: Any) -> dict[str, Any] | list[dict[str, Any]]:
        """generate() for asyncio: steps run between awaits, so concurrent calls batch together."""
        subs, single = self._prepare(prompt, kwargs.pop("input_ids", None), sampling_params, **kwargs)
        boxes = self._submit(subs)
        await self._async_drive(lambda: all(b.finished for b in boxes))
        outs = [b.result() for b in boxes]
        return outs[0] if single else outs

    def stream(self, prompt: Prompt | None = None, sampling_params: ParamsLike = None, *,
               input_ids: Sequence[int] | None = None, **kwargs: Any) -> Iterator[dict[str, Any]]:
        """Yield {"text": delta, "output_ids": delta, "finished", "meta_info"} chunks for one prompt."""
        box = self._submit_one(prompt, input_ids, sampling_params, kwargs)
        try:
            while True:
                self._drive(lambda: bool(box.pending) or box.finished)
                while box.pending:
                    yield _chunk(box.pending.pop(0))
                if box.finished and not box.pending:
                    box.result()  # raises the request's error, if any
                    return
        finally:
            if not box.finished:
                self.abort(box.rid)

    async def async_stream(self, prompt: Prompt | None = None, sampling_params: ParamsLike = None,
                           **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        """stream() for asyncio."""
        box = self._submit_one(prompt, kwargs.pop("input_ids", None), sampling_params, kwargs)
        try:
            while True:
                await self._async_drive(lambda: bool(box.pending) or box.finished)
                while box.pending:
                    yield _chunk(box.pending.pop(0))
                if box.finished and not box.pending:
                    box.result()
                    return
        finally:
            if not box.finished:
                self.abort(box.rid)

    def abort(self, rid: str) -> None:
        """End a request wherever it is; its caller gets finish_reason abort."""
        with self._lock:
            out = self.core.abort(rid)
            if out is not None:
                self._deliver(out)

    def flush_cache(self) -> None:
        """Wait until idle, then drop every cached prefix (open sessions stay open, unpinned)."""
        self._drive(lambda: not self.core.has_work)
        with self._lock:
            self.core.flush_cache()

    # -- sessions (docs/sessions.md) ----------------------------------------------------------
    def open_session(self, capacity: int | None = None, ttl: float | None = None,
                     session_id: str | None = None) -> str:
        """Open a multi-turn session whose KV stays pinned between turns; returns its id.

        ``capacity``: most tokens (history + output) the session may hold; ``ttl``: seconds it
        may stay idle (default: the ``session_ttl`` option)."""
        with self._lock:
            return self.core.sessions.open(session_id, capacity, ttl)

    def close_session(self, session_id: str) -> None:
        """Close a session and unpin its KV; SessionNotFoundError if it is not open."""
        with self._lock:
            self.core.sessions.close(session_id)

    def session(self, capacity: int | None = None, ttl: float | None = None,
                session_id: str | None = None) -> Session:
        """Open a session and return a handle whose generate() continues it turn by turn."""
        return Session(self, self.open_session(capacity, ttl, session_id))  # type: ignore[arg-type]

    def shutdown(self) -> None:
        """Abort whatever is still in flight; stop the tensor-parallel worker ranks."""
        with self._lock:
            for rid in list(self.core.requests):
                self.abort(rid)
            self.core.close()
            self._closed = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # -- request preparation -------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a text, a chat (list of {role, content}) or already-tokenized input."""
        if isinstance(prompt, str):
            with encoding_lock(self.tokenizer):
                return list(self.tokenizer.encode(prompt))
        if prompt and all(isinstance(m, Mapping) for m in prompt):
            chat = [dict(m) for m in prompt if isinstance(m, Mapping)]
            text = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            with encoding_lock(self.tokenizer):
                return list(self.tokenizer.encode(text, add_special_tokens=False))
        ids = [t for t in prompt if isinstance(t, int) and not isinstance(t, bool)]
        if len(ids) == len(prompt):
            return ids
        raise ValueError("a prompt must be a string, a list of token ids, or a list of chat messages")

    def _prepare(self, prompt: Prompt | Sequence[Prompt] | None, input_ids: Any,
                 sampling_params: ParamsLike | Sequence[ParamsLike], return_logprob: bool = False,
                 logprob_start_len: int = -1, top_logprobs_num: int = 0,
                 session_params: SessionParams | Mapping[str, Any] | None = None) -> tuple[list[Submission], bool]:
        """The request's completions, through the intake the server shares (radixlm.runtime.intake),
        and whether the answer is one object (one prompt, n = 1) rather than a list."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        batch: list[Any]
        if input_ids is not None:
            batch = [input_ids] if input_ids and isinstance(input_ids[0], int) else list(input_ids)
            single = bool(input_ids) and isinstance(input_ids[0], int)
        else:
            assert prompt is not None
            single = isinstance(prompt, str) or (bool(prompt) and not isinstance(prompt[0], (str, list, tuple)))
            batch = [prompt] if single else list(prompt)
        if not batch:
            raise ValueError("no prompt given")
        plist = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(batch)
        if len(plist) != len(batch):
            raise ValueError(f"{len(plist)} sampling_params for {len(batch)} prompts; give one or one per prompt")
        prompts = [PromptRequest(f"{uuid.uuid4().hex[:12]}-{next(self._ids)}", self.encode(p), _params(sp),
                                 return_logprob, logprob_start_len, top_logprobs_num)
                   for p, sp in zip(batch, plist)]
        session = session_params if session_params is None or isinstance(session_params, SessionParams) \
            else SessionParams.from_dict(session_params)
        subs = [s for copies in submissions(prompts, session) for s in copies]
        return subs, single and len(subs) == 1

    def _submit_one(self, prompt: Prompt | None, input_ids: Sequence[int] | None, sampling_params: ParamsLike,
                    kwargs: dict[str, Any]) -> _Box:
        subs, single = self._prepare(prompt, input_ids, sampling_params, **kwargs)
        if not single:
            raise ValueError("streaming takes one prompt with n=1; call it once per prompt")
        return self._submit(subs)[0]

    def _submit(self, subs: list[Submission]) -> list[_Box]:
        if self._closed:
            raise RuntimeError("the engine is shut down")
        boxes = []
        with self._lock:
            for s in subs:
                box = _Box(s.rid)
                boxes.append(box)
                try:
                    self.core.add_request(s)
                except Exception:  # (a refused request takes the batch's others with it)
                    for b in boxes[:-1]:
                        self.abort(b.rid)
                    raise
                self._boxes[s.rid] = box
        return boxes

    # -- driving the core ----------------------------------------------------------------
    def _step_once(self) -> None:
        """One core step under the lock; a failing step fails its requests, not the engine."""
        with self._lock:
            if not self.core.has_work:
                return
            try:
                outputs = self.core.step()
            except Exception as e:  # noqa: BLE001 - surfaced to every affected caller
                for rid in list(self.core.requests):
                    self.core.abort(rid)
                    box = self._boxes.pop(rid, None)
                    if box is not None:
                        box.fail(e)
                for rid in list(self._boxes):  # (a request the failed step had already ended: its output is lost)
                    self._boxes.pop(rid).fail(e)
                return
            for out in outputs:
                self._deliver(out)

    def _try_step(self) -> bool:
        """Step if no other caller is driving; False when another one is (our outputs arrive
        through it)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self._step_once()
        finally:
            self._lock.release()
        return True

    def _drive(self, done: Callable[[], bool]) -> None:
        while not done():
            if not self._try_step():
                time.sleep(0.001)

    async def _async_drive(self, done: Callable[[], bool]) -> None:
        await asyncio.sleep(0)  # let coroutines started in the same tick submit before the first step
        while not done():
            await asyncio.sleep(0 if self._try_step() else 0.001)

    def _deliver(self, out: RequestOutput) -> None:
        box = self._boxes.get(out.rid)
        if box is None:
            return
        if out.error is not None:  # its constraint did not compile (ValueError), or a fault ended it
            box.fail(RuntimeError(out.error) if out.internal else ValueError(out.error))
            del self._boxes[out.rid]
            return
        box.pending.append(out)
        box.parts.append(out)
        if out.finished:
            box.finished = True
            del self._boxes[out.rid]


class _Box:
    """Where one request's outputs land."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.parts: list[RequestOutput] = []
        self.pending: list[RequestOutput] = []
        self.finished = False
        self.error: BaseException | None = None

    def fail(self, err: BaseException) -> None:
        self.error, self.finished = err, True

    def result(self) -> dict[str, Any]:
        if self.error is not None:
            raise self.error
        return _collect(self.parts)


def _params(sp: ParamsLike) -> SamplingParams:
    if sp is None:
        return SamplingParams()
    if isinstance(sp, SamplingParams):
        return sp
    if isinstance(sp, Mapping):
        return SamplingParams.from_dict(sp)
    raise ValueError(f"sampling_params must be a dict or SamplingParams, got {type(sp).__name__}")


def _collect(parts: list[RequestOutput]) -> dict[str, Any]:
    ids: list[int] = []
    for p in parts:
        p.apply_ids(ids)
    return {"text": "".join(p.text_delta for p in parts), "output_ids": ids, "meta_info": parts[-1].meta}


def _chunk(out: RequestOutput) -> dict[str, Any]:
    """A stream chunk: deltas; ``replace_from`` (when not None) says which earlier output ids
    the new ones replace."""
    return {"text": out.text_delta, "output_ids": out.token_ids_delta, "replace_from": out.replace_from,
            "finished": out.finished, "meta_info": out.meta}
