"""A TCP proxy on 127.0.0.1 that delays what the server sends back: a slow registry on demand.

It runs its own event loop in a thread, so sync tests (and the processes of a Ray cluster that
connect to it) can use it alike. Each server-to-client chunk leaves ``delay_s`` after it
arrived, in order and pipelined (chunks do not queue behind each other's delays), so the
proxy adds latency without cutting throughput. ``delay_s`` may change while it runs. When the
server is gone (a connection fails or breaks) the client's connection is closed, as a dead
server's would be.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Coroutine
from typing import Any


class DelayProxy:
    def __init__(self, upstream_port: int, delay_s: float = 0.0, host: str = "127.0.0.1") -> None:
        self.upstream = (host, upstream_port)
        self.delay_s = delay_s
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        """As a Redis URL (what the tests put in front of)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self._thread.start()
        self._server = self._run(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = int(self._server.sockets[0].getsockname()[1])

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._writers):
                writer.close()
            tasks = asyncio.all_tasks() - {asyncio.current_task()}
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self._run(close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def _run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            self._close(writer)
            return
        self._writers.add(up_writer)
        ahead = asyncio.ensure_future(self._pipe(reader, up_writer, delayed=False))
        back = asyncio.ensure_future(self._pipe(up_reader, writer, delayed=True))
        await asyncio.wait({ahead, back}, return_when=asyncio.FIRST_COMPLETED)
        for task in (ahead, back):
            task.cancel()
        self._close(writer)
        self._close(up_writer)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, delayed: bool
    ) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                due, data = await queue.get()
                wait_s = due - time.monotonic()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)
                writer.write(data)
                await writer.drain()
                queue.task_done()

        sender = asyncio.ensure_future(send())
        try:
            while data := await reader.read(65536):
                if sender.done():
                    return
                queue.put_nowait((time.monotonic() + (self.delay_s if delayed else 0.0), data))
            # The source ended: what is queued still goes out (a reply to the last command).
            with contextlib.suppress(Exception):
                await asyncio.wait_for(queue.join(), self.delay_s + 1.0)
        except OSError:
            return
        finally:
            sender.cancel()

    def _close(self, writer: asyncio.StreamWriter) -> None:
        self._writers.discard(writer)
        with contextlib.suppress(Exception):
            writer.close()
