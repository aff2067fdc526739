"""The warm server: a background process that has imported tunecast's libraries and forks a fresh command for
each invocation of a quick command, so that a warm `tunecast memory` or `tunecast plan` costs its own work,
not the imports (pydantic, typer, rich and tunecast's modules: two thirds of a 0.6 s warm estimate here).

The first quick command (WARM_COMMANDS) that finds no server starts one, detached, and runs itself as usual.
A later one connects to the server's Unix socket and hands it its arguments, working directory, environment
and its standard input, output and error (the descriptors themselves): the server forks a child that runs the
command as the console script would, writing straight to the caller's terminal or pipe, and the child's exit
status is the caller's. A signal that reaches the caller (Ctrl-C, SIGTERM, SIGHUP) is passed on to the child;
a caller that dies takes its child with it. Every command is a fresh fork of a server that has run none, so
no command sees what another did; the child reads the catalog, the cache and the templates itself.

A server is keyed by the Python executable and its flags, the import path (the server is started on the
caller's) and its directories' times, tunecast's source files (name, size, modification time), and what a
child inherits from the server rather than from its caller (PYTHON* variables, groups, resource limits, CPU
affinity): after an upgrade, an edit or a change of those a new server serves, and the old one exits when idle,
after TUNECAST_WARM_IDLE seconds (default 900) without a command. A signal that ends the child (SIGTERM) ends
its caller alike. A caller gives up on a server that has not forked its command within 10 s and runs it itself
(the child runs only on the caller's go-ahead, so a command never runs twice). Its socket lies in a directory
only its user may enter ($TUNECAST_WARM_DIR, else $XDG_RUNTIME_DIR/tunecast, else tunecast-UID in the temporary
directory; on Linux the server also checks each caller's uid), with a lock holding the server's pid and a log of
the commands it served (command word, exit status, seconds; never arguments or environment). TUNECAST_WARM=0
turns it off, as the test suite does; where Python has no fork or Unix sockets (Windows) there is none.
Commands that train or prompt never go through it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import sys
from pathlib import Path
from typing import Any

from tunecast.cli import command_word

# Commands that only read the catalog and the cache and print an answer.
WARM_COMMANDS = frozenset({"memory", "plan", "breakeven", "gpus", "offers", "validate"})
OFF_ENV, DIR_ENV, IDLE_ENV = "TUNECAST_WARM", "TUNECAST_WARM_DIR", "TUNECAST_WARM_IDLE"
DEFAULT_IDLE_S = 900.0
# Imported by the server before it listens: everything a quick command imports but tunecast.cli, whose rich
# consoles read the terminal and the environment when they are made (the child imports it, in 30 ms).
PRELOAD = ("pydantic", "typer", "typer.main", "rich.console", "rich.table", "rich.text", "rich.markup", "yaml",
           "tunecast.config.spec", "tunecast.config.load", "tunecast.config.checks", "tunecast.config.yamlfile",
           "tunecast.catalog.store", "tunecast.catalog.resolve", "tunecast.estimate.answer", "tunecast.estimate.fit",
           "tunecast.plan.planner", "tunecast.plan.report", "tunecast.plan.breakeven")
_LENGTH = struct.Struct("!I")
_MAX_ADDRESS = 100  # bytes of a Unix socket's path (107 on Linux, 103 on macOS)
_LIMITS = ("RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_NOFILE", "RLIMIT_STACK", "RLIMIT_CPU", "RLIMIT_NPROC")
_PID_TIMEOUT_S = 10.0  # a server that has not forked the command by then is not waited for
# The server's start: the caller's import path first, so that it imports what the caller would.
_BOOT = ("import json, sys\nsys.path[:] = json.loads(sys.argv[1])\nfrom tunecast.cli.warm import serve\n"
         "serve(sys.argv[2], sys.argv[3])\n")
def _enabled() -> bool:
    return (os.environ.get(OFF_ENV) != "0" and hasattr(os, "fork") and hasattr(socket, "AF_UNIX")
            and hasattr(socket, "send_fds"))


def server_dir() -> Path | None:
    """The directory of the servers' sockets, made private to this user; None when it cannot be (another
    owner, open to others)."""
    chosen = os.environ.get(DIR_ENV)
    if chosen:
        path = Path(chosen)
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "tunecast"
    else:
        import tempfile

        path = Path(tempfile.gettempdir()) / f"tunecast-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        status = os.lstat(path)
    except OSError:
        return None
    import stat

    if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.getuid() or status.st_mode & 0o077:
        return None
    return path


def server_key() -> str:
    """What a server's code and process depend on: this Python and its flags, the import path (the server is
    given the caller's) and its directories' times but the first's (an install or upgrade changes one), tunecast's
    source files, and what a child inherits from the server rather than from its caller: the interpreter's start-up
    settings (PYTHON* variables), groups, resource limits and CPU affinity."""
    import hashlib
    import resource

    limits = [resource.getrlimit(getattr(resource, name)) for name in _LIMITS if hasattr(resource, name)]
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    interpreter = sorted((name, value) for name, value in os.environ.items() if name.startswith("PYTHON"))
    inherited = {"flags": repr(sys.flags), "python": interpreter, "groups": os.getgroups(), "limits": limits,
                 "affinity": affinity, "path": sys.path}
    digest = hashlib.sha256(f"{sys.executable}\0{sys.version}\0{json.dumps(inherited)}\0".encode())
    for entry in sys.path[1:]:  # the script's directory (the working one under `python -m`) changes all the time
        try:
            digest.update(f"{entry}\0{os.stat(entry or '.').st_mtime_ns}\0".encode())
        except OSError:
            continue
    package = Path(__file__).resolve().parent.parent
    for root, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", "data"))
        for name in sorted(files):
            if name.endswith(".py"):
                status = os.stat(os.path.join(root, name))
                digest.update(f"{root}/{name}\0{status.st_size}\0{status.st_mtime_ns}\0".encode())
    return digest.hexdigest()[:20]


def run_warm(argv: list[str]) -> int | None:
    """Run `argv` in the warm server and return its exit status; None when this process must run it (not a
    quick command, the server is off, or none is up yet: one is started for the next command)."""
    if command_word(argv) not in WARM_COMMANDS or not _enabled():
        return None
    directory = server_dir()
    if directory is None:
        return None
    key = server_key()
    address = str(directory / f"{key}.sock")
    if len(os.fsencode(address)) > _MAX_ADDRESS:
        return None  # no socket can be bound there
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(address)
    except OSError:
        connection.close()
        _start_server(directory, key)
        return None
    with connection:
        return _request(connection, argv)


def _start_server(directory: Path, key: str) -> None:
    import subprocess

    with contextlib.suppress(OSError):  # no server: every command runs in its own process, as without one
        subprocess.Popen([sys.executable, "-c", _BOOT, json.dumps(sys.path), str(directory), key],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True, close_fds=True, cwd="/")


def _streams() -> list[list[str | None]] | None:
    """Encoding and error handler of stdin, stdout and stderr; None when one of them is closed."""
    streams = (sys.stdin, sys.stdout, sys.stderr)
    if any(stream is None for stream in streams):
        return None
    try:
        for fd in (0, 1, 2):
            os.fstat(fd)
    except OSError:
        return None
    return [[getattr(stream, "encoding", None), getattr(stream, "errors", None)] for stream in streams]


def _request(connection: socket.socket, argv: list[str]) -> int | None:
    streams = _streams()
    try:
        cwd = os.getcwd()
    except OSError:
        return None
    if streams is None:
        return None
    umask = os.umask(0o022)
    os.umask(umask)
    payload = json.dumps({"argv": argv, "argv0": sys.argv[0], "cwd": cwd, "env": dict(os.environ), "umask": umask,
                          "streams": streams}).encode()
    replies = connection.makefile("rb")
    try:
        connection.settimeout(_PID_TIMEOUT_S)
        socket.send_fds(connection, [_LENGTH.pack(len(payload)) + payload], [0, 1, 2])
        pid = int(json.loads(replies.readline())["pid"])
        connection.settimeout(None)
        connection.sendall(b"g")  # the child runs the command only on this: a caller that gave up runs it itself
    except (OSError, ValueError, KeyError, TypeError):
        return None  # the server did not take the command (nothing ran), so this process runs it
    forwarded: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        forwarded.append(signum)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, forward)
    try:
        reply = json.loads(replies.readline() or b"{}")
    except (OSError, ValueError):
        reply = {}
    if isinstance(reply, dict) and isinstance(reply.get("exit"), int):
        return int(reply["exit"])
    if forwarded and forwarded[-1] != signal.SIGINT:  # the child died of it: so does its caller, as alone
        signal.signal(forwarded[-1], signal.SIG_DFL)
        os.kill(os.getpid(), forwarded[-1])
    if forwarded:
        return 130
    sys.stderr.write("tunecast: the command ended without an exit status (its process was killed)\n")
    return 1


# ---- the server -------------------------------------------------------------------------------------------

def _preload() -> None:
    import importlib

    for name in PRELOAD:  # one that fails to import is left to the command, which reports it as it would alone
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    from pydantic import BaseModel

    # Catalog rows build their validators on first use (catalog/rows.py): build them here, once.
    pending = list(BaseModel.__subclasses__())
    while pending:
        model = pending.pop()
        pending.extend(model.__subclasses__())
        if model.__module__.startswith("tunecast.") and not model.__pydantic_complete__:
            with contextlib.suppress(Exception):
                model.model_rebuild()
    import gc

    # What the server imported is never freed: kept out of the collector's scans, a child's collections look
    # at what its command made only (a warm estimate's template decoding ran 2× slower for them).
    gc.freeze()


def serve(where: str, key: str) -> None:
    """Serve commands on `where`/`key`.sock until idle; return at once if another server holds the key, or if
    its code is no longer what the key says (edited since the caller computed it)."""
    import fcntl
    import select
    import time

    directory = Path(where)
    lock = open(directory / f"{key}.lock", "a")  # noqa: SIM115 - held for the server's life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")  # which process serves: `kill $(cat KEY.lock)` stops it
    lock.flush()
    _preload()
    if server_key() != key:
        lock.truncate(0)
        return
    path = directory / f"{key}.sock"
    # Bound under another name and moved into place once it listens, so that a caller never finds a socket
    # that refuses it (it would run the command itself and try to start a server); one a killed server left
    # is replaced (the lock says none listens on it).
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    binding = directory / f".{os.getpid()}.binding"  # no longer than the socket's own name
    binding.unlink(missing_ok=True)
    listener.bind(str(binding))
    listener.listen(16)
    os.replace(binding, path)
    bound = os.stat(path).st_ino
    log_path = directory / f"{key}.log"
    with contextlib.suppress(OSError):
        if log_path.stat().st_size > 1 << 20:  # a line a command: started afresh past a megabyte
            log_path.unlink()
    log = open(log_path, "a", buffering=1)  # noqa: SIM115
    idle = float(os.environ.get(IDLE_ENV) or DEFAULT_IDLE_S)
    children: set[int] = set()
    last = time.monotonic()
    while True:
        ready, _, _ = select.select([listener], [], [], min(1.0, idle))
        while children:
            try:
                done, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if done == 0:
                break
            children.discard(done)
        if ready:
            connection, _ = listener.accept()
            if not _same_user(connection):
                connection.close()
                continue
            last = time.monotonic()
            pid = os.fork()
            if pid == 0:
                try:
                    listener.close()
                    lock.close()
                    _child(connection, log)
                finally:
                    os._exit(1)  # a child never returns to the server's loop
            children.add(pid)
            connection.close()
            continue
        try:
            moved = os.stat(path).st_ino != bound
        except OSError:
            moved = True
        if moved or (not children and time.monotonic() - last > idle):
            break
    listener.close()
    if not moved:
        path.unlink(missing_ok=True)
    lock.truncate(0)  # no pid left behind for a later `kill $(cat KEY.lock)` to hit


def _same_user(connection: socket.socket) -> bool:
    """Whether the caller is this server's user (Linux tells the peer's credentials; elsewhere the directory's
    permissions are the check)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return True
    try:
        _, uid, _ = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i")))
    except OSError:
        return False
    return bool(uid == os.getuid())


def _receive(connection: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)
    if len(data) < _LENGTH.size or len(fds) != 3:
        raise ValueError("not a request")
    (length,) = _LENGTH.unpack(data[:_LENGTH.size])
    body = data[_LENGTH.size:]
    while len(body) < length:
        more = connection.recv(length - len(body))
        if not more:
            raise ValueError("a request cut short")
        body += more
    request = json.loads(body)
    return request, fds


def _child(connection: socket.socket, log: Any) -> None:
    """Run one command in this forked child, as the caller's process would, and exit."""
    import threading
    import time

    started = time.monotonic()
    code, command = 1, None
    finished = threading.Event()
    try:
        request, fds = _receive(connection)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(request["env"])
        _reopen_streams(request["streams"])
        sys.argv = [request["argv0"], *request["argv"]]
        command = command_word(request["argv"])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
    except BaseException:  # the caller gets no pid and runs the command itself
        os._exit(1)
    try:
        connection.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
        if connection.recv(1) != b"g":  # the caller gave up waiting and runs the command itself
            os._exit(1)

        def watch() -> None:  # the caller went away (killed) before the command ended: stop as Ctrl-C would
            with contextlib.suppress(OSError):
                connection.recv(1)
            if not finished.is_set():
                os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=watch, daemon=True).start()
        log.write(f"{os.getpid()} {command} started\n")
        code = _run(request["argv"])
    except BaseException:
        code = 1
    finally:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # nothing stops the status from being sent
        finished.set()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        with contextlib.suppress(OSError):
            connection.sendall(json.dumps({"exit": code}).encode() + b"\n")
        with contextlib.suppress(OSError):
            log.write(f"{os.getpid()} {command} exit {code} in {time.monotonic() - started:.2f} s\n")
        os._exit(0)


def _reopen_streams(streams: list[list[str | None]]) -> None:
    """stdin, stdout and stderr on the caller's descriptors, with its encodings; buffered as Python buffers
    them (line by line on a terminal, stderr always)."""
    opened = []
    for fd, (encoding, errors) in enumerate(streams):
        line = fd == 2 or os.isatty(fd)
        opened.append(open(fd, "r" if fd == 0 else "w", encoding=encoding, errors=errors,  # noqa: SIM115
                           closefd=False, buffering=1 if line and fd else -1))
    sys.stdin, sys.stdout, sys.stderr = opened  # sys.__stdout__ and the others write to the same descriptors


def _run(argv: list[str]) -> int:
    from tunecast.cli.app import main

    try:
        main(argv)
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            return done.code or 0
        sys.stderr.write(f"{done.code}\n")
        return 1
    except KeyboardInterrupt:  # before the command's own handler was in place (while it imported)
        sys.stderr.write("interrupted\n")
        return 130
    return 0


