"""The scoring processes of one server: start them, hand each a request, watch it, replace it.

    pool = ScoringProcesses(partial(FunctionScorer.load, "my_rewards:score"), processes=2)
    await pool.start()                       # StartFailed when the scorer cannot be built
    async with pool.process(deadline) as process:     # waits up to deadline for a free one
        response = await process.score(request_bytes, deadline)
    await pool.close()

Each request runs in a process of child.py, from the request's bytes to the response's, so
that nothing a request or a reward function does can hold the server's event loop. The
watchdog in this module kills the process and starts another when:
- a sample runs past the scorer's `hang_after`. The sample gets TIMEOUT, and the next process
  scores the rest. The samples that the killed process had finished are read from its
  journal and never scored again;
- the call's deadline passes (the client's, or the server's `call_timeout`). Samples without a
  result get TIMEOUT;
- the call is cancelled because its client went away. Nobody waits for the work any more.
A process that dies on a sample (a crash in C code, the kernel's OOM killer) fails that sample
with ERROR, and the next process scores the rest. Results travel as encoded bytes (wire.chunk),
which the server joins in order and never decodes, so a huge result costs the server's event
loop only a copy.
"""

import asyncio
import contextlib
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable

from ferrule_rewards import child, journal, logs, tree, wire
from ferrule_rewards.records import Status

log = logging.getLogger(__name__)
_LENGTH = struct.Struct("!i")  # multiprocessing.Connection's frame header
_LONG_LENGTH = struct.Struct("!Q")
RESTART_BACKOFF = (0.1, 5.0)  # seconds between failed starts of a process: first, longest
EXIT_WAIT = 0.5  # seconds a process whose socket closed gets to exit by itself
KILL_RETRIES = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)  # seconds before each new try at listing a tree


class StartFailed(Exception):
    """A scoring process could not build its scorer. `status` is 2 when the arguments were at
    fault."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


class CallFailed(Exception):
    """The call gets no results. `code` names the gRPC status: DEADLINE_EXCEEDED when the
    deadline passed before the request was decoded or before a process was free,
    RESOURCE_EXHAUSTED when a process died while decoding the request."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class _Done(Exception):
    """Internal: the process answered the request."""


class ScoringProcess:
    """One child process, and the request it is scoring."""

    def __init__(self, pool: "ScoringProcesses"):
        self.pool = pool
        self.process: subprocess.Popen | None = None
        self.mark: child.Mark | None = None  # what the process is doing; see child.py
        self.frames: asyncio.Queue = asyncio.Queue()
        self.writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task | None = None
        self.recycle = False  # the process asked to be replaced after its answer
        self.killed = False
        self.frozen: OSError | None = None  # why the process tree could not be listed (see kill)

    @property
    def alive(self) -> bool:
        """Whether the process is running. Asking does not reap it (see kill)."""
        if self.killed or self.process is None or self.process.returncode is not None:
            return False
        try:
            flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
            return os.waitid(os.P_PID, self.process.pid, flags) is None
        except ChildProcessError:
            return False

    async def start(self) -> dict:
        """Start the process and return its ready message. Raise StartFailed, with what the
        process said, when it cannot build its scorer or exits before it is ready."""
        self.killed, self.recycle = False, False
        ours, theirs = socket.socketpair()
        self.mark = child.Mark.create()
        # The process writes its stdout and stderr to a pipe of its own, read by logs.forward.
        # When it wrote to the server's stderr, a flood filled disks, and a reader that stopped
        # froze the server.
        output, output_end = os.pipe()
        # Start a fresh interpreter, not multiprocessing: a fork of a process that runs gRPC is
        # not safe, and multiprocessing's spawn runs the parent's __main__ again in the child.
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    # -P: do not put the working directory first on sys.path, where a
                    # `mmap.py` would run in every scoring process. functions.py looks up the
                    # reward module there itself.
                    "-P",
                    "-m",
                    "ferrule_rewards.child",
                    str(theirs.fileno()),
                    str(self.mark.fd),
                ],
                pass_fds=(theirs.fileno(), self.mark.fd),
                # A session and process group of its own: a Ctrl-C at the terminal then reaches
                # the server alone, and kill() can reach the function's children through the
                # group once the process is gone.
                start_new_session=True,
                stdout=output_end,
                stderr=output_end,
            )
        except BaseException:  # out of processes or descriptors: the pool retries, so close all
            ours.close()
            os.close(output)
            raise
        finally:
            theirs.close()
            os.close(output_end)
        logs.forward(output, f"scoring process {self.process.pid}", self.pool.max_log_bytes)
        reader, self.writer = await asyncio.open_connection(sock=ours)
        self.frames = asyncio.Queue()
        self._reading = asyncio.ensure_future(self._read(reader))
        # The pickled scorer factory goes from this process to its own child, never over the
        # network.
        self._send(b"S", None, pickle.dumps(self.pool.make_scorer))
        kind, meta, _ = await self.frames.get()
        if kind == b"R":
            return meta
        self.kill()
        if kind == b"X":
            raise StartFailed(meta[1], meta[0])
        raise StartFailed(f"the scoring process {await self._exit()} before it was ready")

    async def _read(self, reader: asyncio.StreamReader) -> None:
        """Put the process's frames into `self.frames`, then (None, None, None) once it has
        gone."""
        try:
            while True:
                (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
                if size == -1:
                    (size,) = _LONG_LENGTH.unpack(await reader.readexactly(_LONG_LENGTH.size))
                self.frames.put_nowait(child.unpack(await reader.readexactly(size)))
        except (asyncio.IncompleteReadError, ConnectionError):
            self.frames.put_nowait((None, None, None))

    def _send(self, kind: bytes, meta, body) -> None:
        head, body = child.pack(kind, meta, body)
        self.writer.write(_LENGTH.pack(len(head) + len(body)) + head)
        if body:
            self.writer.write(body)  # a memoryview or bytes: no copy of a large request

    async def score(self, body, deadline: float) -> bytes:
        """Score a serialized ScoreRequest and return the serialized ScoreResponse. Raises
        wire.InvalidRequest when `body` is not a valid request, and CallFailed when `deadline`
        (event loop time) passes before the request was decoded or a process dies while
        decoding it. Otherwise every sample has a result."""
        job = _Job()
        try:
            while True:
                pool = self.pool
                meta = {
                    "max_batch": pool.max_batch,
                    "skip": job.skip(),
                    "max_bytes": pool.max_message_bytes,
                    "max_sub_scores": pool.max_sub_scores,
                    "used": sum(map(len, job.results.values())),
                }
                self._send(b"J", meta, body)
                await self.writer.drain()
                try:
                    await self._follow(job, deadline)
                except _Done:
                    return job.response or job.in_order(self.pool.max_message_bytes)
                # The process was killed or died in a sample: a fresh process scores the rest.
                if not await self._restart_within(deadline, job):
                    return job.in_order(self.pool.max_message_bytes)
        except BaseException:  # cancelled (the client went away), or the request is invalid
            if job.running:
                self.kill()
            raise

    async def _restart_within(self, deadline: float, job: "_Job") -> bool:
        """Try once to start a fresh process before `deadline`. When that fails, the samples
        without a result fail, and the pool retries in the background once this call is done."""
        await self.stop()
        wait = deadline - asyncio.get_running_loop().time()
        try:
            await asyncio.wait_for(self.start(), max(0.0, wait))
            return True
        except (StartFailed, TimeoutError) as error:
            self.kill()
            why = str(error) or "the call's deadline passed first"
            job.fail_rest(Status.ERROR, f"no scoring process could be started: {why}"[:1000])
            return False

    async def _follow(self, job: "_Job", deadline: float) -> None:
        """Read the process's frames until it answers (raises _Done) or is gone (returns)."""
        loop = asyncio.get_running_loop()
        hang_after, tick = self.pool.hang_after, self.pool.tick
        counter, since = self.mark[0], loop.time()
        job.running = True
        while True:
            now = loop.time()
            try:
                kind, meta, body = await asyncio.wait_for(
                    self.frames.get(), max(0.0, min(tick, deadline - now))
                )
            except TimeoutError:
                now = loop.time()
                if now >= deadline:
                    await self._past_deadline(job)
                if self.mark[0] != counter:
                    counter, since = self.mark[0], now
                elif hang_after and now - since >= hang_after and self.mark[1] >= -1:
                    await self._hung(job)
                    return
                continue
            if kind == b"A":
                job.n, job.missing = meta
            elif kind in (b"D", b"E"):
                job.running = False
                self.recycle = meta["recycle"]
                if kind == b"D":
                    job.response = bytes(body)
                else:  # it wrote every result before answering and now waits: safe to read
                    job.results.update(journal.read(self.mark.fd))
                raise _Done
            elif kind == b"I":
                job.running = False
                raise wire.InvalidRequest(meta)
            else:  # the process died
                await self._died(job)
                return

    async def _past_deadline(self, job: "_Job") -> None:
        await self._recover(job)
        job.running = False
        if job.n is None:
            raise CallFailed(
                "DEADLINE_EXCEEDED", "the call's deadline passed while its request was decoded"
            )
        job.fail_rest(Status.TIMEOUT, "the call's deadline passed before this sample was scored")
        raise _Done

    async def _hung(self, job: "_Job") -> None:
        index = self.mark[1]
        await self._recover(job)
        timeout = self.pool.timeout
        log.warning(
            "%s ran past its %gs timeout (sample %d); replacing its process",
            self.pool.name,
            timeout,
            index,
        )
        if index == -1:  # the whole batch at once: a per-batch or async function
            job.fail_rest(Status.TIMEOUT, f"no rewards for the batch within {timeout:g}s")
            raise _Done
        # setdefault: the sample may have finished, and its result been written, just before
        # the kill.
        job.results.setdefault(
            index, wire.failure_chunk(Status.TIMEOUT, f"no reward within {timeout:g}s")
        )

    async def _recover(self, job: "_Job") -> None:
        """Kill the process, wait for it to be gone, and take the results it finished from
        its journal: they are never scored again."""
        self.kill()
        loop = asyncio.get_running_loop()
        with contextlib.suppress(subprocess.TimeoutExpired):
            await loop.run_in_executor(None, self.process.wait, 1.0)
        # The journal of a process that still runs is never read. A process frozen by kill()
        # (its tree could not be listed) stopped well within the wait, so its journal is read:
        # scoring stays at most once there too.
        if self.process.returncode is not None or self.frozen is not None:
            job.results.update(journal.read(self.mark.fd))

    async def _died(self, job: "_Job") -> None:
        why = await self._exit()
        if self.process.returncode is not None:
            job.results.update(journal.read(self.mark.fd))
        index = self.mark[1]
        log.warning("the scoring process %s (sample %d); replacing it", why, index)
        message = f"the reward function's process {why} while scoring this sample"
        if job.n is None:
            job.running = False
            raise CallFailed(
                "RESOURCE_EXHAUSTED",
                f"the scoring process {why} while decoding the request (out of memory?)",
            )
        if index < 0:
            job.fail_rest(Status.ERROR, message)
            raise _Done
        job.results.setdefault(index, wire.failure_chunk(Status.ERROR, message))

    async def _exit(self) -> str:
        """Say in words how the process ended. The process and what it started are killed
        first, unless the process exits by itself within EXIT_WAIT. Without that wait, an
        `os._exit(3)` would read as "killed by SIGKILL"."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(subprocess.TimeoutExpired):
            await loop.run_in_executor(None, self._wait_unreaped, EXIT_WAIT)
        self.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            await loop.run_in_executor(None, self.process.wait, 1.0)
        code = self.process.returncode
        if code is None:
            return "stopped answering"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def _wait_unreaped(self, seconds: float) -> None:
        """Wait up to `seconds` for the process to exit, without reaping it: kill() needs the
        pid, which is also its group's id, to stay unused until then."""
        deadline = time.monotonic() + seconds
        while self.alive and not self.killed and time.monotonic() < deadline:
            time.sleep(0.005)

    def kill(self) -> None:
        """Send SIGKILL, the only way to stop a call that may hold the GIL, to the process and
        to everything its function started (tree.py). Children that called setsid are reached
        through the process tree, and children orphaned when the process died are reached
        through its process group."""
        self.killed = True
        # Kill only before the process is reaped: until then its pid, which is also its
        # group's id, is not reused. So every wait for it comes after a kill.
        if self.process is None or self.process.returncode is not None:
            return
        pid = self.process.pid
        try:
            tree.kill_tree(pid)
        except OSError as error:
            # /proc could not be listed, e.g. out of descriptors (EMFILE). Freeze the process
            # and its group, which keeps the subtree in place (an orphan in it is re-parented
            # to the frozen process), and let stop() try again.
            self.frozen = error
            for send in (os.kill, os.killpg):
                with contextlib.suppress(OSError):
                    send(pid, signal.SIGSTOP)
            return
        self.frozen = None
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)

    async def _kill_for_good(self) -> None:
        """Call kill(), and call it again while the process tree cannot be listed. After
        KILL_RETRIES, send SIGKILL to the process and its group only; a descendant that left
        both with setsid is then missed."""
        self.kill()
        for delay in KILL_RETRIES:
            if self.frozen is None:
                return
            await asyncio.sleep(delay)
            self.kill()
        if self.frozen is not None:
            log.error(
                "could not list the processes of scoring process %s (%s); killed it and its "
                "process group only",
                self.process.pid,
                self.frozen,
            )
            for send in (os.kill, os.killpg):
                with contextlib.suppress(OSError):
                    send(self.process.pid, signal.SIGKILL)
            self.frozen = None

    async def stop(self) -> None:
        await self._kill_for_good()
        if self.writer is not None:
            self.writer.close()
        if self._reading is not None:
            self._reading.cancel()
        if self.process is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.process.wait)
        if self.mark is not None:
            self.mark.close()
            self.mark = None


class _Job:
    """What is known of one request while processes score it."""

    def __init__(self):
        self.n: int | None = None
        self.missing: list[int] = []
        self.results: dict[int, bytes] = {}  # index -> its result's bytes (wire.chunk)
        self.response: bytes | None = None
        self.running = False

    def skip(self) -> list[int]:
        return sorted(self.results)

    def fail_rest(self, status: Status, message: str) -> None:
        failed = wire.failure_chunk(status, message)
        for index in range(self.n):
            self.results.setdefault(index, failed)

    def in_order(self, max_bytes: int) -> bytes:
        """The ScoreResponse's bytes: the results' bytes joined in order, none decoded. Where
        the whole would be over `max_bytes`, the last results become an ERROR (wire.within)."""
        for index in self.missing:
            self.results[index] = wire.MISSING_CHUNK
        chunks = [self.results[index] for index in range(self.n)]
        return b"".join(wire.within(chunks, max_bytes))


class ScoringProcesses:
    def __init__(
        self,
        make_scorer: Callable,
        processes: int = 1,
        max_batch: int = 4096,
        *,
        max_log_bytes: int = 1 << 20,
        max_sub_scores: int = 1024,
        max_message_bytes: int = 64 << 20,
    ):
        if processes < 1:
            raise ValueError(f"scoring processes must be 1 or more, got {processes}")
        self.make_scorer, self.count, self.max_batch = make_scorer, processes, max_batch
        self.max_log_bytes = max_log_bytes  # bytes of each process's output that reach the log
        self.max_sub_scores, self.max_message_bytes = max_sub_scores, max_message_bytes
        self.name, self.timeout, self.hang_after, self.tick = "?", None, None, 1.0
        self.healthy = True
        self.on_health_change: Callable[[bool], None] | None = None  # set by the server
        self._idle: asyncio.Queue[ScoringProcess] = asyncio.Queue()
        self._all: list[ScoringProcess] = []
        self._restarts: set[asyncio.Task] = set()
        self._closed = False

    async def start(self) -> None:
        """Start every process. When one fails, stop them all and raise the first failure
        (StartFailed, with its message)."""
        processes = [ScoringProcess(self) for _ in range(self.count)]
        self._all = processes
        outcomes = await asyncio.gather(*(p.start() for p in processes), return_exceptions=True)
        failed = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        if failed:
            await asyncio.gather(*(p.stop() for p in processes))
            raise failed[0]
        ready = outcomes[0]
        self.name, self.timeout = ready["name"], ready["timeout"]
        self.hang_after = ready["hang_after"]
        if self.hang_after:  # watchdog period: a sample times out after 1-1.1x hang_after
            self.tick = self.hang_after / 10
        for process in processes:
            self._idle.put_nowait(process)

    @contextlib.asynccontextmanager
    async def process(self, deadline: float):
        """Yield a free process for one request, waiting for one up to `deadline` (loop
        time)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                process = await asyncio.wait_for(self._idle.get(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise CallFailed(
                    "DEADLINE_EXCEEDED",
                    "the call's deadline passed before a scoring process was free",
                ) from None
            if process.alive:
                break
            self._restart_later(process)  # the process died while idle (the OOM killer, say)
        try:
            yield process
        finally:
            if process.recycle or not process.alive:
                self._restart_later(process)
            else:
                self._idle.put_nowait(process)

    def _restart_later(self, process: ScoringProcess) -> None:
        task = asyncio.ensure_future(self._restart_and_free(process))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _restart_and_free(self, process: ScoringProcess) -> None:
        await self.restart(process)
        if not self._closed:
            self._idle.put_nowait(process)

    async def restart(self, process: ScoringProcess) -> None:
        """Replace `process`'s child with a new one, retrying with backoff until one starts.
        While starts fail, the pool reports itself unhealthy (NOT_SERVING). Any failure is
        retried, not only the scorer's (StartFailed), and so is stopping the old child.
        Otherwise an OSError here (out of file descriptors, say) would end the restart and lose
        the process's slot for good. Each failed child is reaped before the next try."""
        process.recycle = False
        delay = RESTART_BACKOFF[0]
        while not self._closed:
            try:
                await process.stop()  # may fail too (out of descriptors): retried with start
                await process.start()
                self._set_health(True)
                return
            except Exception as error:
                log.error("a scoring process failed to start (retry in %gs): %s", delay, error)
                self._set_health(False)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RESTART_BACKOFF[1])

    def _set_health(self, healthy: bool) -> None:
        if healthy != self.healthy:
            self.healthy = healthy
            if self.on_health_change:
                self.on_health_change(healthy)

    async def close(self) -> None:
        self._closed = True
        for task in list(self._restarts):
            task.cancel()
        await asyncio.gather(*(p.stop() for p in self._all), return_exceptions=True)
