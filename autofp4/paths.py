"""Paths the user names (options, variables, arguments): one check of the names no file can have.

A path is refused, naming where it came from, when it is empty or only whitespace, holds a NUL
byte or another control character (a line break pasted with it) or a name longer than file
systems allow, or, for a file, begins or ends with whitespace or ends in a path separator (it
names a folder). A leading ``~`` is expanded.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable


#: the longest file or folder name (bytes) the file systems autofp4 meets allow, and path
NAME_MAX = 255
PATH_MAX = 4096
#: how much longer than a path it writes are the names autofp4 and SQLite derive from it (a
#: staging folder ``.<name>.partial-XXXXXXXX``, a temporary file, SQLite's ``<name>-journal``,
#: the misses file ``<name>.misses.json``)
DERIVED = 24
#: the bytes of a path left for the names of files in or beside it (index files, shards,
#: staging folders)
PATH_ROOM = 64


def unusable_path(path: str | os.PathLike) -> str | None:
    """Why no file can have the name ``path`` (empty, only whitespace, a NUL byte), or None.
    ``TypeError`` for anything that is not a path (``os.fspath``'s)."""
    text = os.fsdecode(os.fspath(path))
    if "\0" in text:
        return "the path holds a NUL byte; give the path without it"
    if not text.strip():
        return "the path is empty or only whitespace; give a path"
    return None


def path_problem(path: str | os.PathLike, file: bool = False, example: str = "tuning.db",
                 written: bool = False) -> str | None:
    """Why ``path`` names nothing its user meant (see the module's list), or None. ``example`` is
    the file name suggested where a ``file`` path names a folder. ``written``: autofp4 writes
    ``path`` and files named after it (:data:`DERIVED` bytes longer at most), so its last name
    leaves room for those."""
    why = unusable_path(path)
    if why is not None:
        return why
    text = os.fsdecode(os.fspath(path))
    if bad := re.search(r"[\x00-\x1f\x7f]", text):
        return (f"it holds a control character ({bad.group()!r} at position {bad.start()}; a line break pasted "
                "with it?); give the path without it")
    if file and text != text.strip():
        return (f"it begins or ends with whitespace ({text!r:.80}), which would name a file nobody meant; "
                "give the path without it")
    full = os.path.abspath(os.path.expanduser(text))
    room = PATH_MAX - (2 if written else 1) * PATH_ROOM
    if len(os.fsencode(full)) > room:
        return (f"it is {len(os.fsencode(full))} bytes long as an absolute path, more than the {room} autofp4 takes "
                f"(the files it reads or writes in or beside it need the rest of the system's {PATH_MAX}); give a "
                "shorter path")
    given = len(os.fsencode(os.path.expanduser(text)))
    if given > room:  # the system takes the path as written ('a/../a/..' counts), not normalized
        return (f"it is {given} bytes long as written, more than the {room} autofp4 takes (the system's limit is "
                f"{PATH_MAX}, and the files read or written in or beside it need some of it); give a shorter path")
    long = next((part for part in text.split(os.sep) if len(os.fsencode(part)) > NAME_MAX), None)
    if long is not None:
        return (f"its part {long[:24]!r}... is {len(os.fsencode(long))} bytes long, more than the {NAME_MAX} a file "
                "or folder name may have; give a shorter name")
    last = os.path.basename(full)
    if written and len(os.fsencode(last)) > NAME_MAX - DERIVED:
        return (f"its name {last[:24]!r}... is {len(os.fsencode(last))} bytes long; autofp4 (and SQLite) write files "
                f"named after it, up to {DERIVED} bytes longer, and a name may have {NAME_MAX}: give a name of at most "
                f"{NAME_MAX - DERIVED} bytes")
    if file and os.path.basename(text) in ("", ".", ".."):  # 'x/', 'x/.', 'x/..'
        tail = os.path.basename(text) or text[-1]
        return f"it ends in {tail!r}, so it names a folder; name the file in it (such as {os.path.join(text, example)})"
    return None


def expand_path(path: str | os.PathLike, what: str, file: bool = False, example: str = "tuning.db",
                error: type[Exception] = ValueError,
                first: Callable[[str], str | None] | None = None, written: bool = False) -> Path:
    """``path`` with a leading ``~`` or ``~user`` expanded; ``error`` naming ``what`` (the option
    or variable it came from) where :func:`path_problem` finds one, or where ``first`` (checks of
    the caller's own, run before the rest once the path is not empty) does, or where the ``~``
    cannot be expanded (no such user, no home)."""
    why = unusable_path(path)
    text = os.fsdecode(os.fspath(path))
    if why is None and first is not None:
        why = first(text)
    if why is None:
        why = path_problem(text, file, example, written)
    if why is not None:
        raise error(f"{what}={text!r:.80}: {why}")
    try:
        return Path(path).expanduser()
    except RuntimeError:  # Path.expanduser: "Could not determine home directory."
        raise error(f"{what}={str(path)!r}: cannot expand its leading '~' (no such user, or no home "
                    "directory); give the path without it") from None


def arg_type(file: bool = False, example: str = "", written: bool = False) -> Callable[[str], str]:
    """An argparse ``type`` for a path option: the text as given, or argparse's usage error (exit
    2, the option named) where :func:`path_problem` finds one."""
    import argparse

    def parse(text: str) -> str:
        why = path_problem(text, file, example, written)
        if why is not None:
            raise argparse.ArgumentTypeError(why)
        return text

    parse.__name__ = "path"  # argparse's "invalid path value" line
    return parse


#: what :func:`kind_of` says of a symbolic link whose target cannot be reached
DANGLING_LINK = ("a symbolic link to nothing reachable (its target is missing, or the links loop or chain through "
                 "more than 40 links)")
REGULAR = "a regular file"


def kind_of(path: str | os.PathLike) -> str | None:
    """What is at ``path``, for messages: :data:`REGULAR`, ``"a directory"``, ``"a FIFO (named
    pipe)"``, ``"a socket"``, ``"a character device"``, ``"a block device"``,
    :data:`DANGLING_LINK`, or None where nothing is there. Links are followed."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return DANGLING_LINK if os.path.islink(path) else None
    except OSError as e:
        if os.path.islink(path):
            return DANGLING_LINK  # ELOOP
        return f"unreadable ({e.strerror or e})"
    for test, kind in ((stat.S_ISREG, REGULAR), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "not a regular file"


def not_regular(path: str | os.PathLike, kind: str | None) -> str:
    """``"<path> is ..."`` for a ``path`` whose :func:`kind_of` is ``kind`` (not a regular file)."""
    if kind == DANGLING_LINK:
        return f"{path} is {DANGLING_LINK}"
    return f"{path} is not a regular file: it is {kind or 'gone'}"
