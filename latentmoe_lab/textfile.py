"""Read a small text file (a config) safely: a path only, a regular file only, bounded in size.

The file is opened non-blocking and checked with fstat on the open descriptor, so a FIFO (which
would wait forever for a writer), a directory or a device is refused without reading, and nothing
can swap the file between the check and the read. The empty path is refused (Path("") is the
current directory).
"""
from __future__ import annotations

import os
import stat

MAX_TEXT_BYTES = 1 << 20  # configs are a few KB; a larger file is a mistake, not a config


def read_text_file(path, name: str = "path", max_bytes: int = MAX_TEXT_BYTES, hint: str = "") -> str:
    """The UTF-8 text of the regular file at `path` (str or os.PathLike), at most `max_bytes` long.

    Raises TypeError for a path of another type, ValueError (naming `name`, then `hint`) otherwise.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name}: expected a file path (str or pathlib.Path), got {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"{name}: expected a str path, got {type(text).__name__}")
    shown = repr(text) if len(text) <= 120 else f"{text[:120]!r}... ({len(text)} chars)"
    suffix = f" {hint}" if hint else ""
    if not text:
        raise ValueError(f"{name}: the path is empty{suffix}")
    if "\n" in text or "\0" in text:
        raise ValueError(f"{name}: {shown} is not a file path (it holds a newline or NUL){suffix}")
    try:
        fd = os.open(text, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ValueError(f"{name}: no file at {shown}{suffix}") from None
    except OSError as error:
        raise ValueError(f"{name}: cannot open {shown}: {error.strerror or error}{suffix}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size > max_bytes:
        os.close(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{name}: {shown} is not a regular file (a directory, FIFO, socket or device); "
                             f"refusing to read it")
        raise ValueError(f"{name}: {shown} has {info.st_size} bytes, more than the {max_bytes} allowed")
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"{name}: {shown} has more than the {max_bytes} bytes allowed")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{name}: {shown} is not UTF-8 text ({error.reason} at byte {error.start})") from None
