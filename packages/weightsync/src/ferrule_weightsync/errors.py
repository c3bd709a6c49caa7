"""The errors weight sync raises. Catch `WeightSyncError` for all of them."""


class WeightSyncError(RuntimeError):
    """An update could not be completed; the message says which peer, tensor or bucket."""


class PeerTimeoutError(WeightSyncError, TimeoutError):
    """A peer did not answer within the group's timeout: it died, hangs or never joined."""


class MismatchError(WeightSyncError, ValueError):
    """A tensor's name, shape or dtype is not what the receiver expects."""


class MalformedMessageError(WeightSyncError, ValueError):
    """A control message is not what it must be: not JSON, the wrong shape, out of range."""


class ForgedMessageError(WeightSyncError):
    """A control message's signature does not check out: forged, replayed, or another secret."""
