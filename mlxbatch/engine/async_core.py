"""AsyncEngineCore: the engine from asyncio.

Owns a background task that drives ``EngineCore.step`` on one dedicated thread (MLX work never runs on two
threads at once) and routes deltas to per-request queues. Submissions are validated in the caller's task,
so a bad request raises there and the others go on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator

from mlxbatch.engine.core import EngineCore, Prompt
from mlxbatch.types import RequestOutput, SamplingParams, StreamDelta


class AsyncEngineCore:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxbatch-step")
        self._queues: dict[str, asyncio.Queue[StreamDelta]] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._closed = False

    async def _run(self, fn, *args):  # type: ignore[no-untyped-def]
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())

    async def _step_loop(self) -> None:
        while not self._closed:
            if not self.core.has_unfinished:
                self._wake.clear()
                await self._wake.wait()
                continue
            for delta in await self._run(self.core.step):
                q = self._queues.get(delta.request_id)
                if q is not None:
                    q.put_nowait(delta)

    async def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                          request_id: str | None = None) -> str:
        rid = await self._run(self.core.add_request, prompt, params, request_id, True)
        self._queues[rid] = asyncio.Queue()
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
