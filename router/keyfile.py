"""Reading a secret from a file: the router's API key, a named key's, an upstream server's."""

from __future__ import annotations

from pathlib import Path


def read_key_file(path: str | Path) -> str:
    """The file's content without surrounding whitespace ('' when empty: the caller says why that is an
    error, in its own terms). Raises OSError, an undecodable file included."""
    try:
        return Path(path).read_text().strip()
    except UnicodeDecodeError as e:
        raise OSError(f"not UTF-8 text: {e}") from None
