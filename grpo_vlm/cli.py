"""The command line's edges, shared by the trainer and scripts/: one-line errors, exit codes, clean stops.

Exit statuses (the same for every command of the project):
    0    done
    1    an internal error, a bug: Python's traceback is printed, as it should be
    2    a usage or input error (a bad flag, file, data line or reward plug-in): one message that names the
         flag or file:line:field, says what is wrong and how to fix it; no traceback. A reward plug-in that
         raises, or returns a non-number, is reported the same way (an exception with `user_message`), and
         so is a reward or tool plug-in that calls sys.exit() or raises KeyboardInterrupt (`call_plugin`)
    74   an output could not be written (no space left, permission denied, read-only filesystem, a vanished
         folder): one line naming the file and the cause; what was half-written is removed, the previous
         checkpoint is intact, and the same command (`--resume DIR`) goes on once the cause is gone
    130  stopped by Ctrl-C or SIGTERM: after the current step and a checkpoint (the message says how to
         continue), or before anything was written (nothing is left behind)

A user's mistake is a `UsageError`; code that reads the user's input (flags, files, data, plug-ins) runs
inside `user_errors()`, which turns the ValueError / OSError that data.py, rewards.py and model loading
raise with their file:line messages into one; inside `fields_as_flags()`, the field names that grpo.py's
settings raise in become the flags. Signals: `signals()` turns SIGINT / SIGTERM into `Stopped` at once
while nothing needs finishing (loading, validation, the first evaluation), and into a request that the
training loop honours after its current step once `defer()` has been called (at once again while an
`abortable` function runs: slow user code that writes nothing). A plug-in's call (a reward, a tool) goes
through `call_plugin`: bounded in time, stopped by a signal even when it swallows the stop, and never read as
a success or a user's stop when it calls sys.exit() or raises another BaseException. One writer per output:
`hold_lock` takes an exclusive lock that the operating system releases when the process ends, on a regular
file only (a lock path that is a symbolic link or a FIFO is refused, never followed or waited on).
`exit_process` ends the process without waiting for threads a plug-in left running. Stdlib only.
"""

import contextlib
import dataclasses
import json
import math
import os
import re
import signal
import socket
import stat
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_WRITE = 74  # sysexits.h's EX_IOERR
EXIT_STOPPED = 130
# Seconds a plug-in has to return once a signal stopped it; then the process exits (130) without waiting more.
STOP_GRACE_S = 10.0


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


class PluginExit(Exception):
    """A plug-in's call ended in sys.exit(), KeyboardInterrupt or another BaseException that is no Exception
    (the original is its __cause__): the plug-in's failure, neither a result nor a user's stop."""


class PluginTimeout(Exception):
    """A plug-in's call ran past its time limit, whatever it returned or raised."""


class OsExitCalled(BaseException):  # NOTE: no Exception, so a plug-in's `except Exception` cannot swallow it
    """A plug-in called os._exit() while it was imported or called (`no_os_exit`)."""


_os_exit = os._exit  # the real one: this module ends the process with it (`_exit_stuck`, `exit_process`)


def _refuse_os_exit(code: int) -> None:
    raise OsExitCalled(f"called os._exit({code!r})")


@contextmanager
def no_os_exit() -> Iterator[None]:
    """Inside, os._exit raises OsExitCalled instead of ending the process: a plug-in's os._exit(0) would end
    the run with status 0 (no checkpoint, no message), which no caller could tell from a success. Only the
    name os._exit is replaced, for the `with` block: a plug-in that holds the function itself (`posix._exit`,
    or `from os import _exit` outside a `plugin_import`) still ends the process, and run.json's
    "finished": false says so."""
    previous, os._exit = os._exit, _refuse_os_exit
    try:
        yield
    finally:
        os._exit = previous


def check(condition: bool, flag: str, message: str) -> None:
    """Raise UsageError('--flag: message') unless `condition` holds."""
    if not condition:
        raise UsageError(f"{flag}: {message}")


def flag_values(args: Any) -> Iterator[tuple[str, Any]]:
    """('--flag', value) for every value of a dataclass of flags, its nested groups flat on the command line
    and each item of a tuple flag on its own."""
    for field in dataclasses.fields(args):
        value = getattr(args, field.name)
        if dataclasses.is_dataclass(value):
            yield from flag_values(value)
            continue
        for item in value if isinstance(value, (tuple, list)) else [value]:
            yield f"--{field.name.replace('_', '-')}", item


def check_utf8(args: Any) -> None:
    """Raise UsageError('--flag: ...') for a flag whose text is not UTF-8: a byte such as 0xff in a path
    reaches Python as a lone surrogate, which no UTF-8 file (run.json records every flag) can hold. `args`
    is a dataclass of flags (`flag_values`)."""
    for flag, text in flag_values(args):
        if isinstance(text, str) and (bad := re.search("[\udc80-\udcff]", text)):
            raise UsageError(
                f"{flag}: byte 0x{ord(bad[0]) - 0xDC00:02x} at character {bad.start() + 1} is not UTF-8; "
                "rename the file or folder"
            )


# The largest a flag that enters the step's float32 arithmetic may be (a clip bound, an advantage clip, a
# reward weight): 1 + 1e30 is no clip at all, and float32's largest number is 3.4e38.
FLOAT32_FLAG_MAX = 1e30


def check_finite(args: Any) -> None:
    """Raise UsageError('--flag: ...') for a float flag that is NaN or infinite: JSON, which run.json records
    every flag in, has neither, and no setting of this project means either (a large number means "no
    limit"). `args` is a dataclass of flags (`flag_values`)."""
    for flag, number in flag_values(args):
        if isinstance(number, float) and not math.isfinite(number):
            raise UsageError(
                f"{flag}: must be a finite number (no limit: a large one, e.g. 1e9), got {number}"
            )


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
    """Inside, a plug-in that calls sys.exit() or os._exit() or raises KeyboardInterrupt while it is imported
    fails as a ValueError naming `spec` (its failure: exit 2, not the status it asked for); a signal
    (Stopped) passes."""
    try:
        with no_os_exit():
            yield
    except (SystemExit, KeyboardInterrupt, OsExitCalled) as e:
        if type(e) not in (SystemExit, KeyboardInterrupt, OsExitCalled):  # NOTE: Stopped is a SystemExit
            raise
        did = f"called sys.exit({e.code!r})" if type(e) is SystemExit else "raised KeyboardInterrupt"
        did = str(e) if type(e) is OsExitCalled else did
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

    `requests` holds the names of the signals received. A second Ctrl-C while a request is pending stops at
    once (KeyboardInterrupt), as usual. While one of the `abortable` functions runs (user code that may take
    minutes and writes nothing: `call_plugin` always, a reward or a tool), a signal raises `Stopped` at once
    even when deferred: the caller redoes that work from its last consistent state. A plug-in that swallows
    the stop gets it again when it returns (`call_plugin`); one that has not returned STOP_GRACE_S seconds
    later is not waited for: the process exits (130), the checkpoints written before intact.
    """

    def __init__(self, abortable: tuple[Callable, ...] = ()) -> None:
        self.deferred = False
        self.requests: list[str] = []
        self.abortable = {fn.__code__ for fn in (*abortable, call_plugin)}
        self.watchdog: threading.Timer | None = None  # armed while a stopped plug-in has not returned

    def defer(self) -> None:
        """From now on a signal lets the current step finish (work was written that must stay consistent)."""
        self.deferred = True

    def handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        while frame is not None and frame.f_code not in self.abortable:
            frame = frame.f_back
        in_plugin = frame is not None  # the signal interrupted an abortable function: stop it now
        if self.requests and signum == signal.SIGINT and not in_plugin:
            raise KeyboardInterrupt
        self.requests.append(name)
        if in_plugin and self.watchdog is None:
            self.watchdog = threading.Timer(STOP_GRACE_S, _exit_stuck, args=(name,))
            self.watchdog.daemon = True
            self.watchdog.start()
        if not self.deferred:
            raise Stopped(f"stopped by {name} before training started; nothing was written")
        if in_plugin:
            raise Stopped(f"stopped by {name}")
        print(f"\n{name} received: finishing the current step, then writing a checkpoint", flush=True)

    def plugin_returned(self) -> None:
        """The plug-in's call is over: the process is no longer at its mercy."""
        if self.watchdog is not None:
            self.watchdog.cancel()
            self.watchdog = None


def _exit_stuck(name: str) -> None:
    print(
        f"\nstopped by {name}: a plug-in did not return within {STOP_GRACE_S:g} s of it; exiting without a "
        "checkpoint of the current step (the checkpoints written before are intact)",
        file=sys.stderr,
        flush=True,
    )
    _os_exit(EXIT_STOPPED)


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


def _installed_signals() -> Signals | None:
    """The `Signals` whose handler is installed (`signals()`), or None: the process's own state, not ours."""
    owner = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
    return owner if isinstance(owner, Signals) else None


class _Expired(BaseException):  # NOTE: no Exception, so a plug-in's `except Exception` cannot swallow it
    pass


def _expire(signum: int, frame: Any) -> None:
    raise _Expired


@contextmanager
def _alarm(timeout: float) -> Iterator[None]:
    """Raise _Expired inside the `with` block after `timeout` seconds (SIGALRM); the previous SIGALRM handler
    and timer (less the time spent here) come back after it."""
    previous = signal.signal(signal.SIGALRM, _expire)
    started, (delay, interval) = time.monotonic(), signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if delay:  # 1 microsecond at least: a timer of 0 would be no timer at all
            signal.setitimer(signal.ITIMER_REAL, max(delay - (time.monotonic() - started), 1e-6), interval)


def check_time_limit(flag: str, seconds: float | None) -> None:
    """A ValueError naming `flag` unless `seconds` is None or a positive finite number SIGALRM can time."""
    if seconds is not None and not seconds > 0:  # NOTE: NaN fails too
        raise ValueError(f"{flag}: must be a positive number of seconds, got {seconds}")
    if seconds is not None and seconds > 1e9:  # setitimer overflows far below 1e300 (and inf)
        raise ValueError(f"{flag}: at most 1e9 seconds (no limit: leave it out), got {seconds}")
    # SIGALRM interrupts only the main thread, and Windows has none.
    main_thread = threading.current_thread() is threading.main_thread()
    if seconds is not None and not (hasattr(signal, "setitimer") and main_thread):
        raise ValueError(f"{flag}: unsupported here (it needs SIGALRM, in the main thread)")


def plugin_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The last frame of `error`'s traceback outside this module: where the plug-in raised or exited."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename != __file__]
    return frames[-1] if frames else None


def _what_it_did(error: BaseException) -> str:
    if type(error) is SystemExit:
        return f"called sys.exit({error.code!r})"
    where = f" (at {frame.filename}:{frame.lineno})" if (frame := plugin_frame(error)) else ""
    if type(error) is OsExitCalled:
        return f"{error}{where}"
    return f"raised {type(error).__name__}{f': {error}' if str(error) else ''}{where}"


def call_plugin(what: str, fn: Callable, args: tuple, kwargs: dict, *, timeout: float | None = None) -> Any:
    """fn(*args, **kwargs), the call of a plug-in (`what`: "reward function", "tool"), bounded:
    - after `timeout` seconds (None: no limit) SIGALRM interrupts it, and a call that ran longer raises
      PluginTimeout whatever it returned or raised: a bare `except:` swallows the alarm, not the clock;
    - a signal during the call stops it (`Signals`), and one the plug-in swallowed is raised when it returns;
    - sys.exit(), os._exit() (`no_os_exit`), KeyboardInterrupt or another BaseException that is no Exception
      becomes PluginExit, its message what the plug-in did (under `signals()` a real signal inside is a
      `Stopped`, so a KeyboardInterrupt is the plug-in's own; without it one passes as it is, as Python's
      Ctrl-C may).
    An Exception the plug-in raises passes as it is."""
    state = _installed_signals()
    received, started, error = len(state.requests) if state else 0, time.monotonic(), None
    try:
        with _alarm(timeout) if timeout is not None else contextlib.nullcontext(), no_os_exit():
            value = fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 (each kind is decided below, none is dropped)
        error = e
    finally:
        if state is not None:
            state.plugin_returned()
    if state is not None and len(state.requests) > received:  # a signal came during the call
        name = state.requests[received]
        message = f"stopped by {name} while a {what} ran"
        if not state.deferred:
            message = f"stopped by {name} before training started; nothing was written"
        raise Stopped(message) from None
    if timeout is not None and (isinstance(error, _Expired) or time.monotonic() - started > timeout):
        raise PluginTimeout(f"took longer than {timeout:g} s") from None
    if error is None:
        return value
    # NOTE: without our handler (state None) a KeyboardInterrupt may be Python's own for a real Ctrl-C
    if isinstance(error, Exception) or (state is None and isinstance(error, Stopped | KeyboardInterrupt)):
        raise error
    raise PluginExit(_what_it_did(error)) from error


def exit_process(code: int | str | None) -> NoReturn:
    """End the process as sys.exit(code) does, without waiting for threads that are no daemons (a plug-in's
    may run forever): those left are named on stdout, the output flushed, and os._exit ends the process."""
    if isinstance(code, str):  # as Python's own exit prints a message and returns 1
        print(code, file=sys.stderr, flush=True)
        code = 1
    code = 0 if code is None else code
    left = [t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
    if not left:
        sys.exit(code)
    print(f"exiting without waiting for {len(left)} threads left running: {', '.join(left)}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    _os_exit(code)


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
