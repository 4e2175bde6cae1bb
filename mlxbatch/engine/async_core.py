"""AsyncEngineCore: the engine from asyncio.

Owns a background task that drives ``EngineCore.step`` on one dedicated thread (MLX work never runs on two
threads at once) and routes deltas to per-request queues. Submissions are validated in the caller's task,
so a bad request raises there and the others go on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
from collections.abc import AsyncIterator

import mlx.core as mx

from mlxbatch.engine.core import EngineCore, Prompt
from mlxbatch.types import RequestOutput, SamplingParams, StreamDelta


class AsyncEngineCore:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        # MLX streams are per thread: the step thread gets its own on the engine's device
        self._thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="mlxbatch-step",
            initializer=lambda: mx.set_default_stream(mx.new_stream(mx.default_device())))
        self._queues: dict[str, asyncio.Queue[StreamDelta | BaseException]] = {}
        self._ids = itertools.count()
        self._loop_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._closed = False

    async def _run(self, fn, *args):  # type: ignore[no-untyped-def]
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())

    async def _step_loop(self) -> None:
        try:
            while not self._closed:
                if not self.core.has_unfinished:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                for delta in await self._run(self.core.step):
                    q = self._queues.get(delta.request_id)
                    if q is not None:
                        q.put_nowait(delta)
        except BaseException as exc:  # a dead step loop must not leave callers waiting forever
            for q in self._queues.values():
                q.put_nowait(exc)
            raise

    async def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                          request_id: str | None = None) -> str:
        rid = request_id or f"async-{next(self._ids)}"
        self._queues[rid] = asyncio.Queue()  # before submission: no delta can arrive before its queue
        try:
            await self._run(self.core.add_request, prompt, params, rid, True)
        except BaseException:
            self._queues.pop(rid, None)
            raise
        self._ensure_loop()
        self._wake.set()
        return rid

    async def stream(self, prompt: Prompt, params: SamplingParams | None = None,
                     request_id: str | None = None) -> AsyncIterator[StreamDelta]:
        rid = await self.add_request(prompt, params, request_id)
        q = self._queues[rid]
        try:
            while True:
                delta = await q.get()
                if isinstance(delta, BaseException):
                    raise delta
                yield delta
                if delta.output is not None:
                    return
        finally:
            self._queues.pop(rid, None)

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None) -> RequestOutput:
        async for delta in self.stream(prompt, params, request_id):
            if delta.output is not None:
                return delta.output
        raise AssertionError("stream ended without an output")  # pragma: no cover

    async def abort(self, request_id: str) -> None:
        await self._run(self.core.abort, request_id)
        self._wake.set()

    async def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._loop_task is not None:
            await asyncio.gather(self._loop_task, return_exceptions=True)
        await self._run(self.core.shutdown)
        self._thread.shutdown(wait=True)
