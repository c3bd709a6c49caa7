"""Joining a weight-sync group in a thread of its own, so that the wait for peers can be given up.

    joining = Joining(lambda: create_receiver(...))      # starts at once
    receiver = joining.wait(given_up=lambda: cancel.is_set())   # or poll joining.done()

Joining waits for the sender (and every other receiver) for up to the group's timeout. The
caller must not hold anything meanwhile (the vLLM engine's lock: generation stopped for the
whole wait), and must be able to leave when nobody wants the result any more (its gRPC client
left, the server stops): the thread then runs out its timeout alone and closes the receiver
if one comes after all.
"""

import threading
from collections.abc import Callable

POLL_SECONDS = 0.05  # how often a waiting caller checks whether it should give up


class JoinAbandoned(Exception):
    """The caller gave up the join (its client left, or the server or engine is stopping)."""


class Joining:
    """`connect()` running in a daemon thread; its receiver, its error, or abandoned."""

    def __init__(self, connect: Callable[[], object]):
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._receiver = None
        self._error: BaseException | None = None
        self._abandoned = False
        self._thread = threading.Thread(
            target=self._run, args=(connect,), name="weight-sync-join", daemon=True
        )
        self._thread.start()

    def _run(self, connect: Callable[[], object]) -> None:
        try:
            receiver = connect()
        except BaseException as err:  # handed to whoever asks for the result
            self._error = err
        else:
            with self._lock:
                if self._abandoned:
                    receiver.close()  # nobody will use it: leave the group at once
                else:
                    self._receiver = receiver
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self):
        """The receiver once joined (raises the join's error); call after `done()`."""
        if self._error is not None:
            raise self._error
        return self._receiver

    def abandon(self) -> None:
        """Nobody wants the receiver: close it if it came, or as soon as it comes."""
        with self._lock:
            self._abandoned = True
            receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.close()

    def wait(self, given_up: Callable[[], bool]):
        """The receiver, once joined; JoinAbandoned as soon as `given_up()` says so."""
        while not self._done.wait(POLL_SECONDS):
            if given_up():
                self.abandon()
                raise JoinAbandoned("the weight-sync join was given up before it completed")
        return self.result()
