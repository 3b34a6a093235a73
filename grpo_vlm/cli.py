"""The command line's edges, shared by train.py and scripts/: one-line errors, exit codes, clean stops.

Exit statuses (the same for every command of the project):
    0    done
    1    an internal error, a bug: Python's traceback is printed, as it should be
    2    a usage or input error (a bad flag, file, data line or reward plug-in): one message that names the
         flag or file:line:field, says what is wrong and how to fix it; no traceback. A reward plug-in that
         raises, or returns a non-number, is reported the same way (an exception with `user_message`)
    74   an output could not be written (no space left, permission denied, read-only filesystem, a vanished
         folder): one line naming the file and the cause; what was half-written is removed, the previous
         checkpoint is intact, and the same command (train.py: `--resume DIR`) goes on once the cause is gone
    130  stopped by Ctrl-C or SIGTERM: after the current step and a checkpoint (the message says how to
         continue), or before anything was written (nothing is left behind)

A user's mistake is a `UsageError`; code that reads the user's input (flags, files, data, plug-ins) runs
inside `user_errors()`, which turns the ValueError / OSError that data.py, rewards.py and model loading
raise with their file:line messages into one; inside `fields_as_flags()`, the field names that grpo.py's
settings raise in become the flags. Signals: `signals()` turns SIGINT / SIGTERM into `Stopped` at once
while nothing needs finishing (loading, validation, the first evaluation), and into a request that the
training loop honours after its current step once `defer()` has been called (at once again while an
`abortable` function runs: slow user code that writes nothing). One writer per output: `hold_lock` takes
an exclusive lock that the operating system releases when the process ends, on a regular file only (a lock
path that is a symbolic link or a FIFO is refused, never followed or waited on). Stdlib only.
"""

import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import stat
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_WRITE = 74  # sysexits.h's EX_IOERR
EXIT_STOPPED = 130


class UsageError(ValueError):
    """A mistake of the user's: printed as one line without a traceback, exit status 2. A ValueError, so a
    caller that calls a command's `main` from Python catches it as the bad value it is."""


class WriteFailed(Exception):
    """An output could not be written (`writing`): printed as one line without a traceback, exit status 74."""


@contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Inside, an OSError (ENOSPC, EACCES, EROFS, ENOENT, ...) becomes WriteFailed naming `path` and the
    cause. The caller removes what it half-wrote (an exception passes through its own `finally`/`except`)."""
    try:
        yield
    except OSError as e:
        cause = e.strerror or str(e) or type(e).__name__
        where = e.filename if e.filename is not None else path
        raise WriteFailed(f"cannot write {where}: {cause}") from e


class Stopped(SystemExit):
    """A clean stop by signal (nothing half-written): printed as one line, exit status 130. A SystemExit, so
    that even outside `run` it ends the program without a traceback."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = EXIT_STOPPED


def check(condition: bool, flag: str, message: str) -> None:
    """Raise UsageError('--flag: message') unless `condition` holds."""
    if not condition:
        raise UsageError(f"{flag}: {message}")


@contextmanager
def user_errors(prefix: str = "") -> Iterator[None]:
    """Inside, the errors that bad input raises (ValueError with file:line, missing files, unreadable
    folders, a plug-in module that fails to import) become UsageError, with `prefix` before the message."""
    try:
        yield
    except UsageError:
        raise
    except (ValueError, OSError, ImportError) as e:
        message = str(e) or type(e).__name__
        if isinstance(e, OSError) and e.filename is not None and str(e.filename) not in message:
            message = f"{e.filename}: {message}"
        raise UsageError(f"{prefix}{message}") from e


@contextmanager
def plugin_import(spec: str) -> Iterator[None]:
    """Inside, a plug-in that calls sys.exit() or raises KeyboardInterrupt while it is imported fails as a
    ValueError naming `spec` (its failure: exit 2, not the status it asked for); a signal (Stopped) passes."""
    try:
        yield
    except (SystemExit, KeyboardInterrupt) as e:
        if type(e) not in (SystemExit, KeyboardInterrupt):  # NOTE: exactly these: Stopped is a SystemExit
            raise
        did = f"called sys.exit({e.code!r})" if type(e) is SystemExit else "raised KeyboardInterrupt"
        raise ValueError(f"{spec}: the plug-in file {did} while it was imported") from e


@contextmanager
def fields_as_flags(*groups: Any) -> Iterator[None]:
    """Inside, a ValueError that names settings of the dataclass instances `groups` by field, as the reference
    modules' configs do (`clip_eps_low: must be in [0, 1), got 1.5`), becomes a UsageError that names them
    by flag (`--clip-eps-low: ...`) wherever in the message they stand; the rest of the message unchanged."""
    names = sorted(
        {field.name for group in groups for field in dataclasses.fields(group)}, key=len, reverse=True
    )
    pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, names)) + r")(?![\w-])")
    try:
        yield
    except ValueError as e:
        raise UsageError(pattern.sub(lambda m: "--" + m[1].replace("_", "-"), str(e))) from e


def open_lock_file(path: str | os.PathLike, what: str):
    """The lock file `path` (created if missing) open for reading and writing, or UsageError naming it and
    `what` it locks when it is a symbolic link or not a regular file: O_NOFOLLOW never writes through a link
    onto another file, and O_NONBLOCK opens a FIFO at once, to be refused, instead of waiting for a writer."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError:
        if os.path.islink(path):  # O_NOFOLLOW's ELOOP
            raise UsageError(
                f"{path} (the lock of {what}) is a symbolic link; a lock file must be a regular file: remove "
                "the link"
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError(
            f"{path} (the lock of {what}) is not a regular file; a lock file must be one: remove it"
        )
    os.set_blocking(fd, True)
    return open(fd, "r+", encoding="utf-8")


def hold_lock(path: str | os.PathLike, what: str):
    """Take the exclusive lock on the file `path` (created if missing) for the rest of this process's life, or
    raise UsageError naming `what` and the holder (pid, host, start time). Keep the returned file open: the
    lock is flock(2)'s, released by the kernel when the process ends however it ends (kill -9 included), so a
    dead run never leaves a stale lock. The file then holds the holder's record; it is never deleted, because
    a process could lock the unlinked file while a newcomer locks a new one at the same path."""
    import fcntl  # POSIX; imported here so that the rest of this module imports everywhere

    handle = open_lock_file(path, what)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = "holder unknown"  # it may not have written its record yet
        with contextlib.suppress(ValueError, KeyError, TypeError):
            record = json.loads(handle.read())
            holder = f"pid {record['pid']} on {record['host']}, started {record['started']}"
        handle.close()
        raise UsageError(
            f"{what} is in use by another process ({holder}); one writer at a time: wait for it to end, "
            f"stop it, or choose another output"
        ) from None
    started = time.strftime("%Y-%m-%d %H:%M:%S %z")
    handle.seek(0)
    handle.truncate(0)
    handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}) + "\n")
    handle.flush()
    return handle


class Signals:
    """SIGINT / SIGTERM as `Stopped` (before `defer()`) or as a request honoured after the step (after).

    `requests` holds the names of the signals received while deferred. A second Ctrl-C while a request is
    pending stops at once (KeyboardInterrupt), as usual. While one of the `abortable` functions runs (user
    code that may take minutes and writes nothing, e.g. scoring with a reward plug-in), a signal raises
    `Stopped` at once even when deferred: the caller redoes that work from its last consistent state.
    """

    def __init__(self, abortable: tuple[Callable, ...] = ()) -> None:
        self.deferred = False
        self.requests: list[str] = []
        self.abortable = {fn.__code__ for fn in abortable}

    def defer(self) -> None:
        """From now on a signal lets the current step finish (work was written that must stay consistent)."""
        self.deferred = True

    def handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if not self.deferred:
            raise Stopped(f"stopped by {name} before training started; nothing was written")
        if self.requests and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requests.append(name)
        while frame is not None and frame.f_code not in self.abortable:
            frame = frame.f_back
        if frame is not None:  # the signal interrupted an abortable function: stop it now
            raise Stopped(f"stopped by {name}")
        print(f"\n{name} received: finishing the current step, then writing a checkpoint", flush=True)


@contextmanager
def signals(abortable: tuple[Callable, ...] = ()) -> Iterator[Signals]:
    """Install the handlers for the `with` block; the previous ones come back after it (calling a command's
    `main` from Python changes nothing global)."""
    state = Signals(abortable)
    previous = {sig: signal.signal(sig, state.handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield state
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def run(main: Callable[[Any], Any], args: Any) -> None:
    """Call main(args) as a command: exit 0, or print the user error / write failure / clean stop and exit
    2 / 74 / 130."""
    try:
        main(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)
    except WriteFailed as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_WRITE)
    except Stopped as e:
        print(f"\n{e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_STOPPED)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr, flush=True)
        sys.exit(EXIT_STOPPED)
    except Exception as e:
        # NOTE: a failure in the user's own code (a reward plug-in) carries `user_message` (scoring.score sets
        # it): one line naming the reward, the sample and the plug-in's file:line. Anything else is a bug.
        message = getattr(e, "user_message", None)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)
    sys.exit(0)
