"""Bounds on an HTTP message's header block, shared by `asyncflow serve`, the agent proxy and the
HTTP client (a leaf: it imports nothing of theirs).

A header block is counted line by line as it is read, so a peer sending endless headers is refused
after `MAX_HEADERS` lines or `MAX_HEADER_BYTES` bytes, whichever comes first, without keeping more.
"""

from __future__ import annotations

MAX_HEADERS = 100  # header lines of one message (the standard library's http.server takes as many)
MAX_HEADER_BYTES = 64 * 1024  # all header lines of one message together


class HeaderLimitError(ValueError):
    """A header block past `MAX_HEADERS` lines or `MAX_HEADER_BYTES` bytes (the message names which)."""


class HeaderBudget:
    """Counts the header lines of one message as they are read: `take(line)` raises
    `HeaderLimitError` once the lines or their bytes pass the limits (the blank line ending the
    block counts toward neither)."""

    def __init__(self, max_headers: int = MAX_HEADERS, max_bytes: int = MAX_HEADER_BYTES) -> None:
        self.max_headers, self.max_bytes = max_headers, max_bytes
        self.lines = self.bytes = 0

    def take(self, line: bytes) -> None:
        if line in (b"\r\n", b"\n", b""):
            return
        self.lines += 1
        self.bytes += len(line)
        if self.lines > self.max_headers:
            raise HeaderLimitError(f"headers: more than {self.max_headers} header lines")
        if self.bytes > self.max_bytes:
            raise HeaderLimitError(f"headers: more than {self.max_bytes} bytes of header lines")
