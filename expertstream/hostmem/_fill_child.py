"""A staging ring's fill process: copies byte ranges of model files into the ring's shared chunks.

Run by ``fillproc`` as a script (standard library only, so that it starts fast):

    python _fill_child.py CHUNKS_FD CHUNKS_BYTES COMMAND_FD DONE_FD SOURCE_FD...

Each command (``COMMAND``) asks for ``nbytes`` of source ``source`` at ``src_offset`` to be copied
to ``chunk_offset`` in the chunks; the process answers each, in order, with its sequence number and
the seconds the copy took (``DONE``). It reads nothing else and exits when the command pipe closes.
A copy that fails is answered with a negative time, and the process exits.
"""

from __future__ import annotations

import mmap
import os
import signal
import struct
import sys
import time

COMMAND = struct.Struct("<5q")  # seq, source, src_offset, chunk_offset, nbytes
DONE = struct.Struct("<qd")  # seq, seconds (negative: the copy failed)


def _read_exactly(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size:
        got = os.read(fd, size - len(data))
        if not got:
            return data
        data += got
    return data


def serve(chunks_fd: int, chunks_bytes: int, command_fd: int, done_fd: int, source_fds: list[int]) -> int:
    chunks = memoryview(mmap.mmap(chunks_fd, chunks_bytes))
    sources = [
        memoryview(mmap.mmap(fd, 0, prot=mmap.PROT_READ)) if os.fstat(fd).st_size else memoryview(b"")
        for fd in source_fds
    ]
    while True:
        command = _read_exactly(command_fd, COMMAND.size)
        if len(command) < COMMAND.size:
            return 0  # the ring closed the pipe
        seq, source, src_offset, chunk_offset, nbytes = COMMAND.unpack(command)
        start = time.perf_counter()
        try:
            chunks[chunk_offset : chunk_offset + nbytes] = sources[source][src_offset : src_offset + nbytes]
        except (IndexError, ValueError):
            os.write(done_fd, DONE.pack(seq, -1.0))
            return 1
        os.write(done_fd, DONE.pack(seq, time.perf_counter() - start))


if __name__ == "__main__":
    # Ctrl-C reaches the whole process group: the ring's process handles it, and this one exits
    # when the ring closes its pipe (or its process ends).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    args = [int(a) for a in sys.argv[1:]]
    sys.exit(serve(args[0], args[1], args[2], args[3], args[4:]))
