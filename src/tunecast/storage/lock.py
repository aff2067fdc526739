"""One writer per run output.

* Local storage: an exclusive `flock`, which the kernel holds for the process and releases when it dies, so a
  lock left by a killed run is taken over at once (and said so: the lock file still names its holder).
* Object storage, and a bucket mounted without `flock` (FUSE): a lock object naming its holder and a token of
  this lock, rewritten by a background thread every refresh period for the whole life of the run (loading,
  tokenizing, evaluating and steps of any length included). Another launch takes it over only once it was not
  refreshed for STALE_PERIODS periods (a machine gone without notice), or at once when its holder is a dead
  process of the same machine. A run whose lock was taken over (it was paused, say SIGSTOPped, for longer than
  that) finds another holder in the lock object: every write to its storage checks that first
  (`Storage.guard`), and it stops with LockLost before writing anything more.

`TUNECAST_LOCK_REFRESH_S` sets the period (default 30 s, so a lock is stale after 180 s). The age of a lock is
read on the taker's clock against the holder's: machines whose clocks disagree by more than a few periods
could take a live lock over. A holder paused between reading its lock object and rewriting it (past the stale
age) may have overwritten a takeover: it cannot tell, so it stops, and a run that took over finds the other token
at its next refresh and stops too. Never two writers; the same command then resumes.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from typing import Any

from tunecast.errors import TunecastError
from tunecast.storage.store import LOCK, UNSUPPORTED, WRITE_HINT, Storage, WriteFailed

# A lock on object storage cannot be tied to a process; its holder refreshes it every period, and one not refreshed
# for STALE_PERIODS periods belongs to a machine that is gone (a spot VM reclaimed without notice). Several periods,
# so that a slow request or a busy machine never loses a live run its lock.
REMOTE_LOCK_REFRESH_S = 30.0
STALE_PERIODS = 6
REMOTE_LOCK_STALE_S = REMOTE_LOCK_REFRESH_S * STALE_PERIODS
LOCK_REFRESH_VARIABLE = "TUNECAST_LOCK_REFRESH_S"


def lock_periods() -> tuple[float, float]:
    """(refresh period, stale age) of object-storage locks, in seconds: TUNECAST_LOCK_REFRESH_S, else 30 s."""
    value = os.environ.get(LOCK_REFRESH_VARIABLE)
    if not value:
        return REMOTE_LOCK_REFRESH_S, REMOTE_LOCK_STALE_S
    try:
        refresh = float(value)
    except ValueError:
        refresh = float("nan")
    if not 0 < refresh < 86_400:
        raise TunecastError(f"{LOCK_REFRESH_VARIABLE} is {value!r}, not a number of seconds",
                            field=LOCK_REFRESH_VARIABLE, hint="unset it (30 s), or give seconds such as 10")
    return refresh, refresh * STALE_PERIODS


class LockLost(TunecastError):
    """Another run took over this run's output while this one was not refreshing its lock."""


class RunLock:
    """One writer per run output. Local: an exclusive `flock`, released by the kernel when the process dies
    (so a lock left by a killed run is taken over at once). Object storage: a lock object naming its holder
    (with a token of this lock), rewritten by a background thread every refresh period while the run lives,
    taken over once stale by STALE_PERIODS periods, or at once when its holder is a dead process on this
    machine. Once acquired on object storage, every write to the storage checks first that the lock is
    still this run's (`check`)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._handle: Any = None
        self.took_over: str | None = None
        self.fallback = False  # local storage that cannot flock: the lock file of object storage
        self.token = uuid.uuid4().hex
        self.refresh_s, self.stale_s = lock_periods()
        self.lost: str | None = None  # who holds the output now, once another run took it over
        self._confirmed = 0.0  # time.monotonic() of the last refresh that found this lock still ours
        self._written_at = 0.0  # time.time() in the lock object this run wrote last
        self._mutex = threading.Lock()  # one refresh at a time: the thread's, or a write's check
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def remote(self) -> bool:
        return not self.storage.local or self.fallback

    def acquire(self) -> None:
        if self.storage.local:
            self._acquire_local()
        else:
            self._acquire_remote()

    def _acquire_local(self) -> None:
        import fcntl

        try:
            os.makedirs(self.storage.root, exist_ok=True)
            handle = open(self.storage.path(LOCK), "a+")  # noqa: SIM115 - held open for the run's lifetime
        except OSError as error:
            raise _lock_failed(self.storage, error) from None
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno in UNSUPPORTED:  # a bucket mounted with FUSE: a lock file, as on object storage
                handle.close()
                self.fallback = True
                self._acquire_remote()
                return
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise _in_use(self.storage, holder) from None
        try:
            handle.seek(0)
            previous = handle.read().strip()
            if previous:
                self.took_over = previous
            handle.truncate(0)
            handle.write(_holder())
            handle.flush()
        except OSError as error:  # a full disk: the flock is released with the file
            handle.close()
            raise _lock_failed(self.storage, error) from None
        self._handle = handle

    def _acquire_remote(self) -> None:
        holder = _read_holder(self.storage)
        if holder is not None:
            _refuse_if_held(self.storage, holder, self.stale_s)
            self.took_over = f"pid {holder.get('pid')} on {holder.get('host')}"
        try:
            self._write_own()
        except WriteFailed as failed:
            raise TunecastError(f"cannot take the lock of {self.storage.url}: {failed.message}", field="output",
                                hint=f"{WRITE_HINT}; nothing was written") from None
        # two launches at the same instant both found the lock free or stale: the one whose lock object stands wins
        now = _read_holder(self.storage)
        if now is None or now.get("token") != self.token:
            raise _in_use(self.storage, _describe(now))
        self._confirmed = time.monotonic()
        self.storage.guard = self.check
        self._thread = threading.Thread(target=self._keep_fresh, name="tunecast-run-lock", daemon=True)
        self._thread.start()

    def _write_own(self) -> None:
        now = time.time()
        document = {"host": socket.gethostname(), "pid": os.getpid(), "token": self.token, "refreshed": now,
                    "refresh_s": self.refresh_s, "stale_s": self.stale_s}
        self.storage.write(LOCK, json.dumps(document).encode(), guarded=False)
        self._written_at = now

    def _keep_fresh(self) -> None:
        """The background refresher: the lock object rewritten every period, for as long as the lock is held."""
        while not self._stop.wait(self.refresh_s):
            try:
                self._refresh()
            except LockLost:
                return
            except Exception:  # the storage briefly unreachable: the next period tries again (the run's own
                continue  # writes report a lasting failure)

    def _refresh(self) -> None:
        """Rewrite the lock object, once it is found to be still this run's; LockLost when it is another's."""
        with self._mutex:
            if self.lost is not None:
                raise self._lost_error()
            read_at, previous = time.time(), self._written_at
            holder = _read_holder(self.storage)
            if holder is None or holder.get("token") != self.token:
                self.lost = _describe(holder)
                raise self._lost_error()
            self._write_own()
            landed = time.time()
            if landed - read_at > self.refresh_s and landed - previous > self.stale_s:
                # paused between reading the lock object and rewriting it, past the stale age: a run may have taken
                # it over in between, and this write overwritten its lock. Neither can tell; both stop (the other
                # finds this token at its next refresh), and this one's release removes the object
                self.lost = "a run that may have taken it over while this process was paused"
                raise self._lost_error()
            self._confirmed = time.monotonic()

    def check(self) -> None:
        """Before a write: raise LockLost when another run holds the output. Without I/O while the refresher
        confirmed the lock recently (another run needs it stale for STALE_PERIODS periods); after a pause of the
        process (SIGSTOP, a suspended machine) the lock object is read first."""
        if self.lost is not None:
            raise self._lost_error()
        if time.monotonic() - self._confirmed > 1.5 * self.refresh_s:
            self._refresh()

    def _lost_error(self) -> LockLost:
        return LockLost(f"this run lost the lock of {self.storage.url} to {self.lost}: it was not refreshed for "
                        f"over {self.stale_s:.0f} s (this process was paused or cut off), and another run took the "
                        "output over; this run stops without writing anything more", field="output",
                        hint="that run owns the output now: let it finish, or give this run another --output")

    def release(self) -> None:
        if not self.remote:
            if self._handle is not None:
                # an empty lock file says the last holder left cleanly; a name in it, that it was killed
                self._handle.truncate(0)
                self._handle.close()
                self._handle = None
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.storage.guard = None
        with self._mutex, contextlib.suppress(OSError, TunecastError):
            holder = _read_holder(self.storage)
            if holder is not None and holder.get("token") == self.token:  # another run's lock is left to it
                self.storage.remove(LOCK, guarded=False)


def probe_lock(storage: Storage) -> None:
    """Raise the error a run would raise on taking the lock of `storage` now, without taking it: a second launch
    into a busy output is refused at once, before the training libraries load."""
    if storage.local:
        import fcntl

        path = storage.path(LOCK)
        if not os.path.exists(path):
            return
        try:
            handle = open(path)  # noqa: SIM115 - closed below
        except OSError:
            return  # unreadable: taking the lock says why
        with handle:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                if error.errno in UNSUPPORTED:
                    pass  # a lock file, as on object storage: read below
                else:
                    raise _in_use(storage, handle.read().strip() or "another process") from None
            else:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
                return
    holder = _read_holder(storage)
    if holder is not None:
        _refuse_if_held(storage, holder, lock_periods()[1])


def _read_holder(storage: Storage) -> dict[str, Any] | None:
    try:
        holder = json.loads(storage.read(LOCK))
    except (FileNotFoundError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _refuse_if_held(storage: Storage, holder: dict[str, Any], stale_s: float) -> None:
    """Raise when `holder` (a lock object) belongs to a live run: refreshed within the stale age (the holder's
    own, when it says one), and not a dead process of this machine."""
    try:
        age = time.time() - float(holder.get("refreshed", 0))
        stale = float(holder.get("stale_s", stale_s))
        pid = int(holder.get("pid", 0))
    except (TypeError, ValueError):
        return  # a damaged lock object holds nothing
    same_host_dead = holder.get("host") == socket.gethostname() and not _alive(pid)
    if not same_host_dead and age <= stale:
        raise _in_use(storage, f"pid {holder.get('pid')} on {holder.get('host')} (lock refreshed {age:.0f} s ago)",
                      hint=f"wait for that run; a lock not refreshed for {stale:.0f} s is taken over")


def _describe(holder: dict[str, Any] | None) -> str:
    if holder is None:
        return "a run that has since finished (the lock object is gone)"
    return f"pid {holder.get('pid')} on {holder.get('host')}"


def _in_use(storage: Storage, holder: str, hint: str | None = None) -> TunecastError:
    return TunecastError(f"{storage.url} is in use by {holder}", field="output",
                         hint=hint or "wait for that run to finish, stop it, or give this run another --output")


def _lock_failed(storage: Storage, error: OSError) -> TunecastError:
    return TunecastError(f"cannot take the lock of {storage.url}: {error.strerror or error}", field="output",
                         hint=f"{WRITE_HINT}; nothing was written")


def _holder() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
