"""Daemon worker threads for user code that may never return.

    threads = DaemonThreads()
    result = await threads.run(fn, *args)      # from a coroutine; fn runs in a worker thread

concurrent.futures.ThreadPoolExecutor joins its workers when the interpreter exits, so one
reward function stuck in an endless call would keep a drained server from ever exiting. These
threads are daemons, reused while they are idle; a stuck one is simply never reused, and the
scorer counts and bounds those.
"""

import asyncio
import contextlib
import queue
import threading


class DaemonThreads:
    def __init__(self, name: str = "reward"):
        self._name = name
        self._idle: list[queue.SimpleQueue] = []  # the inboxes of idle workers
        self._lock = threading.Lock()
        self._closed = False

    def run(self, fn, *args) -> asyncio.Future:
        """Start `fn(*args)` in a worker thread; the future resolves on the calling loop."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._work, args=(inbox,), name=self._name, daemon=True).start()
        inbox.put((loop, future, fn, args))
        return future

    def _work(self, inbox: queue.SimpleQueue) -> None:
        while (job := inbox.get()) is not None:
            loop, future, fn, args = job
            try:
                outcome, value = _set_result, fn(*args)
            except BaseException as error:  # handed to the waiting coroutine
                outcome, value = _set_exception, error
            # A closed loop (RuntimeError) means that nobody waits for this any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(outcome, future, value)
            with self._lock:
                if self._closed:
                    return
                self._idle.append(inbox)

    def close(self) -> None:
        """Let idle workers exit; busy ones exit when their call returns."""
        with self._lock:
            self._closed = True
            for inbox in self._idle:
                inbox.put(None)
            self._idle.clear()


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():  # it may have been cancelled meanwhile
        future.set_result(value)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
