"""A sender that is never closed is closed when its process ends: at interpreter exit (the
program returned, called `sys.exit` or died of an exception) and on SIGTERM. Its receivers then
see the end of the stream (`receive` returns None) instead of a lost connection, and its
shared-memory segments are removed.

SIGTERM's default action ends a process without running anything at exit. So while a sender is
open, and only if SIGTERM still has its default action, this module installs its own handler.
The handler closes every open sender and segment, puts the default action back and raises the
signal again. The process then ends as SIGTERM would have ended it (killed by signal 15).

A SIGTERM that arrives during a `send` takes effect once that send returns or fails (within its
timeouts), so the stream ends between updates, never inside one. The handler is installed from
the main thread only, as Python requires. The default action comes back once the last sender
and segment have closed, unless something else took over SIGTERM meanwhile. A program's own
SIGTERM handler is never replaced: that handler decides what SIGTERM means, and if it ends the
program through `sys.exit`, the close at exit ends the stream. Python runs a signal handler
between bytecodes of the main thread, so a SIGTERM that arrives while the main thread waits in
a long call takes effect when the call returns.

A process killed outright (SIGKILL, the OOM killer) closes nothing. Its receivers get a
`WeightSyncError` saying that the sender went away.
"""

import contextlib
import signal
import threading
import weakref

_open: set[weakref.finalize] = set()  # one per sender or segment not yet closed
_sends = 0  # sends in progress, in any thread
_sends_lock = threading.Lock()
_deferred = False  # SIGTERM arrived during a send: raise it again when the last send ends


def close_at_exit(owner: object, close, *args) -> weakref.finalize:
    """Arrange for `close(*args)` to run once, at the first of these: `close_now` (called by
    the owner's `close`), `owner` being collected, interpreter exit, or SIGTERM."""
    closer = weakref.finalize(owner, _closing, close, args)
    _open.add(closer)
    if _in_main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
    return closer


def close_now(closer: weakref.finalize, **kwargs) -> None:
    """For the owner's own `close`: call the close function now, with `kwargs`, unless it has
    already run."""
    detached = closer.detach()
    if detached is not None:
        _, function, args, _ = detached
        function(*args, **kwargs)


@contextlib.contextmanager
def deferring_sigterm():
    """Wrap a sender's `send`, so that our SIGTERM handler waits until the send ends."""
    global _sends, _deferred
    with _sends_lock:
        _sends += 1
    try:
        yield
    finally:
        with _sends_lock:
            _sends -= 1
            last = _deferred and not _sends
        if last:
            _deferred = False
            signal.raise_signal(signal.SIGTERM)  # handled in the main thread, like the first one


def _closing(close, args: tuple, **kwargs) -> None:
    try:
        close(*args, **kwargs)
    finally:
        _open.difference_update([closer for closer in _open if not closer.alive])
        if not _open and _in_main_thread() and signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _on_sigterm(signum: int, frame) -> None:
    global _deferred
    if _sends:
        _deferred = True
        return
    for closer in list(_open):
        closer()
    signal.signal(signum, signal.SIG_DFL)  # the default was the action before ours
    signal.raise_signal(signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
