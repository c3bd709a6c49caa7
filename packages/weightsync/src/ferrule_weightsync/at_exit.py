"""A sender that is never closed closes when its process ends: at interpreter exit (the program
returned, called `sys.exit` or died of an exception) and on SIGTERM. Its receivers then see the
end of the stream (`receive` returns None), not a lost connection, and its shared-memory
segments go.

SIGTERM's default action ends a process without running anything at exit. So while a sender is
open, and only where SIGTERM still has its default action, this module's handler stands in for
it: it closes every open sender, then puts the default action back and raises the signal again,
which ends the process as SIGTERM would have (killed by signal 15). A SIGTERM that comes during
a `send` takes effect once that send returns or fails (within its timeouts): the stream ends
between updates, never inside one. The handler is installed from the main thread only
(Python's rule), and the default action comes back once the last sender closed, unless
something else took SIGTERM meanwhile. A program's own SIGTERM handler is never replaced: it
decides what SIGTERM means, and where it ends the program through `sys.exit`, the close at exit
ends the stream. Python runs a handler between bytecodes of the main thread, so a SIGTERM that
comes while that thread waits in a long call takes effect when the call returns. A process
killed outright (SIGKILL, the OOM killer) closes nothing: its receivers get a `WeightSyncError`
saying that the sender went away.
"""

import contextlib
import signal
import threading
import weakref

_open: set[weakref.finalize] = set()  # one per sender or segment not yet closed
_sends = 0  # sends in progress, in any thread
_sends_lock = threading.Lock()
_deferred = False  # SIGTERM came during a send: raised again once the last one ends


def close_at_exit(owner: object, close, *args) -> weakref.finalize:
    """Call `close(*args)` once: through `close_now` (the owner's `close`), or when `owner` is
    collected, the interpreter exits or SIGTERM comes, whichever is first."""
    closer = weakref.finalize(owner, _closing, close, args)
    _open.add(closer)
    if _in_main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
    return closer


def close_now(closer: weakref.finalize, **kwargs) -> None:
    """The owner's own close: call its close function now, with `kwargs`, unless it ran."""
    detached = closer.detach()
    if detached is not None:
        _, function, args, _ = detached
        function(*args, **kwargs)


@contextlib.contextmanager
def deferring_sigterm():
    """Around a sender's `send`: our SIGTERM handler waits for it to end."""
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
            signal.raise_signal(signal.SIGTERM)  # handled in the main thread, as it came


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
    signal.signal(signum, signal.SIG_DFL)  # the action that was there before ours
    signal.raise_signal(signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
