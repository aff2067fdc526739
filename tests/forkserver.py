"""A warm process that forks a fresh `tunecast` command per request, for tests that start many runs.

Importing torch, transformers and peft costs 8-10 s a process on the CI machine; a kill/resume test starts
dozens of runs. This server imports them once (and runs no torch operation, so no thread pool exists to be
broken by fork), then for each request forks a child that runs `tunecast.cli.main(args)` exactly as the
console script would. The child is a real process: it can be sent SIGTERM or SIGKILL by its pid.

Protocol, one JSON object per line: a request {"args", "cwd", "env", "log", "kill_in_write"} on stdin; the
server answers {"pid"} once the child is forked, then {"pid", "code"} when it has ended (code: the exit
status, or minus the signal number that killed it). `kill_in_write: N` makes the child SIGKILL itself
half-way through its N-th file write to the run's storage (a kill while a checkpoint is being written).
`slow_load_s: S` holds the child S seconds where it starts loading the model (a slow disk or download), after
printing "forkserver: loading held" to its log.

A request with `"script": PATH` runs that Python file in the child instead of a command (with `"args"` as its
sys.argv[1:]), for checks that need the warm libraries (loading a run's result with diffusers). Modules named on
the server's command line are imported too before it is ready (`forkserver.py diffusers`).

A request with `"ranks": N` forks N children at once, the workers of one run, each with the variables
torchrun sets (tunecast.launch.local.rank_env) and its own log (`log` with `.rankR` appended); the server
answers {"pids": [...]} and then {"codes": [...]}.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn


def _warm(extra: list[str]) -> None:
    import importlib

    import accelerate  # noqa: F401
    import peft  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch
    import torch.distributed.checkpoint
    import torch.distributed.fsdp  # noqa: F401
    import transformers  # noqa: F401

    import tunecast.cli.app
    import tunecast.train.run
    import tunecast.train.session  # noqa: F401

    for name in extra:
        importlib.import_module(name)


def _kill_in_write(count: int) -> None:
    """Patch the store so that the `count`-th local file write (small files written from memory, and large
    ones copied from a scratch folder alike) stops the process half-way through that file."""
    from pathlib import Path

    from tunecast.storage import store

    writes = 0
    write_local, copy_local = store._write_local, store._copy_local

    def due() -> bool:
        nonlocal writes
        writes += 1
        return writes == count

    def die_half_written(target: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(f"{target}.tmp-{os.getpid()}", "wb") as handle:
            handle.write(data[: len(data) // 2])
            handle.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def write(target: str, data: bytes) -> None:
        if due():
            die_half_written(target, data)
        write_local(target, data)

    def copy(source: Path, target: str) -> None:
        if due():
            die_half_written(target, Path(source).read_bytes())
        copy_local(source, target)

    store._write_local = write
    store._copy_local = copy


def _slow_load(seconds: float) -> None:
    """Patch the session so that loading the base model first waits `seconds`."""
    import time

    from tunecast.train import session

    load = session.load_base

    def slow(*args: object, **kwargs: object) -> object:
        print(f"forkserver: loading held for {seconds:g} s", flush=True)
        time.sleep(seconds)
        return load(*args, **kwargs)

    session.load_base = slow


def _child(request: dict) -> None:
    os.chdir(request["cwd"])
    os.environ.update(request.get("env", {}))
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    endpoint = os.environ.get("TUNECAST_TEST_S3_ENDPOINT")
    if endpoint:  # the test's S3 server (tests/s3server.py), as its fixture points fsspec at it
        import fsspec

        fsspec.config.conf["s3"] = {"endpoint_url": endpoint}
    if request.get("kill_in_write"):
        _kill_in_write(int(request["kill_in_write"]))
    if request.get("slow_load_s"):
        _slow_load(float(request["slow_load_s"]))
    if request.get("script"):
        import runpy

        sys.argv = [request["script"], *request["args"]]
        _exit_after(lambda: runpy.run_path(request["script"], run_name="__main__"))
    from tunecast.cli import main
    from tunecast.train.signals import PROCESS_FLAG

    PROCESS_FLAG.install()  # as tunecast/cli/__init__.py does at the start of `tunecast train`
    _exit_after(lambda: main(request["args"]))


def _exit_after(run: Callable[[], object]) -> NoReturn:
    """Run `run`, then end the child with its exit status (0 when it returns) without the interpreter's teardown."""
    code = 1
    try:
        run()
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 0
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _fork(request: dict) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            _child(request)
        finally:
            os._exit(1)
    return pid


def _ranks(request: dict) -> None:
    from tunecast.launch.local import free_port, rank_env

    count, port = int(request["ranks"]), free_port()
    pids = []
    for rank in range(count):
        env = rank_env(rank, count, port, request.get("env", {}))
        pids.append(_fork({**request, "env": env, "log": f"{request['log']}.rank{rank}"}))
    print(json.dumps({"pids": pids}), flush=True)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    print(json.dumps({"codes": codes}), flush=True)


def main() -> None:
    from tunecast.train.determinism import fix_cpu_threads

    fix_cpu_threads()  # before torch loads MKL, as `tunecast train` does
    _warm(sys.argv[1:])
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        if request.get("ranks"):
            _ranks(request)
            continue
        pid = _fork(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"pid": pid, "code": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
