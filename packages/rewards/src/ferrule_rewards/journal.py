"""A journal of finished results, in memory that a scoring process shares with the server.
The scoring process writes each sample's result before the next sample starts. The server
reads the results once the process is gone.

    journal = Journal(mark_fd)             # in the scoring process, on the memfd of its Mark
    journal.reset(); journal.append(index, chunk)
    read(mark_fd)                          # in the server, once the process died or answered

The journal is what makes scoring at most once. A process may die or be killed in the middle
of a batch (a crash, a hang past the timeout, the call's deadline). Every sample it finished is
then in the journal, so the next process skips those samples instead of running the reward
function on them again (a function with side effects would see them twice). No finished work
is lost. Writing is a copy into shared memory, with no system call. In the memfd, the journal
follows the Mark's 16 bytes: an end offset (int64), then records of
[index: int32][length: int32][chunk].
"""

import mmap
import os
import struct

_START = 24  # records start after the Mark's counter and index and the journal's end offset
_END = struct.Struct("q")
_RECORD = struct.Struct("ii")
_FIRST_SIZE, _KEEP_SIZE = 1 << 20, 16 << 20  # bytes mapped at first; largest map a reset keeps


class Journal:
    """The scoring process's side: it appends records, and resets the journal at each
    request."""

    def __init__(self, fd: int):
        self.fd, self.end = fd, _START
        self._size = max(os.fstat(fd).st_size, _FIRST_SIZE)
        os.ftruncate(fd, self._size)
        self._map = mmap.mmap(fd, self._size)

    def reset(self) -> None:
        if self._size > _KEEP_SIZE:  # give the pages of a big batch back to the system
            self._remap(_FIRST_SIZE)
        self.end = _START
        _END.pack_into(self._map, 16, self.end)

    def append(self, index: int, chunk: bytes) -> None:
        start, end = self.end + _RECORD.size, self.end + _RECORD.size + len(chunk)
        if end > self._size:
            self._remap(max(end, 2 * self._size))
        _RECORD.pack_into(self._map, self.end, index, len(chunk))
        self._map[start:end] = chunk
        self.end = end
        _END.pack_into(self._map, 16, end)  # after the record, so all before `end` is whole

    def _remap(self, size: int) -> None:
        self._map.close()
        os.ftruncate(self.fd, size)
        self._size = size
        self._map = mmap.mmap(self.fd, size)


def read(fd: int) -> dict[int, bytes]:
    """Return {index: chunk} for every record written since the last reset. Call it only once
    the writer has stopped (exited, or answered its request): nothing orders the stores of a
    writer that still runs."""
    (end,) = _END.unpack(os.pread(fd, _END.size, 16))
    if end <= _START:
        return {}
    data = os.pread(fd, end - _START, _START)
    view, offset, records = memoryview(data), 0, {}
    while offset < len(data):
        index, length = _RECORD.unpack_from(view, offset)
        offset += _RECORD.size
        records[index] = bytes(view[offset : offset + length])
        offset += length
    return records
