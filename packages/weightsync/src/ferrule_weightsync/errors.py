"""The errors weight sync raises. Catch `WeightSyncError` for all of them."""


class WeightSyncError(RuntimeError):
    """An update could not be completed. The error message names the peer, tensor or bucket."""


class PeerTimeoutError(WeightSyncError, TimeoutError):
    """A peer did not answer within the group's timeout: it died, it hangs, or it never joined."""


class MismatchError(WeightSyncError, ValueError):
    """A tensor's name, shape or dtype is not what the receiver expects."""


class MalformedMessageError(WeightSyncError, ValueError):
    """A control message is malformed: it is not JSON, has the wrong shape, or is out of range."""


class ForgedMessageError(WeightSyncError):
    """A control message's signature is wrong: the message was forged or replayed, or it was
    signed with another secret."""
