"""Join a weight-sync group in a separate thread, so that the caller can stop waiting for peers.

    joining = Joining(lambda: create_receiver(...))      # starts at once
    receiver = joining.wait(given_up=lambda: cancel.is_set())   # or poll joining.done()

Joining waits up to the group's timeout for the sender and every other receiver. The caller
must not hold any lock meanwhile: holding the vLLM engine's lock stopped generation for the whole
wait. The caller must also be able to leave when nobody wants the result any more, for example
when its gRPC client left or the server stops. The thread then waits out its timeout alone, and
closes the receiver if one arrives after all.
"""

import threading
from collections.abc import Callable

POLL_SECONDS = 0.05  # how often a waiting caller checks whether it should give up


class JoinAbandoned(Exception):
    """The caller gave up the join (its client left, or the server or engine is stopping)."""


class Joining:
    """Runs `connect()` in a daemon thread. It ends with a receiver, with connect()'s error, or
    abandoned by the caller."""

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
                    receiver.close()  # nobody will use the receiver, so leave the group now
                else:
                    self._receiver = receiver
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self):
        """Return the receiver, or raise the join's error. Call this only after `done()`."""
        if self._error is not None:
            raise self._error
        return self._receiver

    def abandon(self) -> None:
        """Give up the join: close the receiver now if it has arrived, or as soon as it does."""
        with self._lock:
            self._abandoned = True
            receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.close()

    def wait(self, given_up: Callable[[], bool]):
        """Wait for the join and return the receiver. Raise JoinAbandoned as soon as
        `given_up()` returns True."""
        while not self._done.wait(POLL_SECONDS):
            if given_up():
                self.abandon()
                raise JoinAbandoned("the weight-sync join was given up before it completed")
        return self.result()
