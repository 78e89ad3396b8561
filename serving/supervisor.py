"""``recserve serve``: one engine process per GPU, N front-end processes on one port, and this supervisor.

    clients --gRPC--> front end 1..N --(shared memory: request blocks and rings, serving/ipc.py)--> engine 0..G-1 --> GPU

- Each engine (serving/engine/core.py) owns its GPU (engine 0 sees every GPU, for models sharded over
  them) and ONE copy of each model version it serves; it batches the requests of all front ends.
- Each front end (serving/frontend/main.py) runs gRPC, reads and checks requests, and writes responses.
- This process starts them (engines first: front ends answer health NOT_SERVING while they load),
  serves ONE /metrics endpoint for all of them (prometheus_client's multiprocess mode), and keeps
  them together: if any of them exits on its own, the others are stopped and the server exits with
  that one's code (3: the device failed; restart the server).

SIGTERM/SIGINT: front ends go NOT_SERVING at once, refuse new requests with UNAVAILABLE, and give
in-flight requests up to the grace period; then the engines stop; exit code 0. A second SIGTERM or
SIGINT (Ctrl-C twice) kills every process at once instead: what is in flight fails; still exit 0.
The children act on this process's SIGTERM alone (Ctrl-C's SIGINT reaches them too, and is ignored
there), and stop when it dies, the last of them removing its working folder (serving/child.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import multiprocessing as mp
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from typing import Callable, Iterable, List, NoReturn, Optional, Tuple

from recserve.errors import UserError
from serving.child import hold_workdir
from serving.config import ServerConfig, default_frontends

log = logging.getLogger("serving.supervisor")
START_TIMEOUT_S = 120  # for a process to come up (models load after that, with health NOT_SERVING)
# A killed process is gone within milliseconds, or within a second or two where it holds tens of GiB (an
# H100 engine with 40 GiB on the GPU and 8 GiB page-locked: 1.2-1.6 s); one stuck in the kernel (a GPU
# driver call) may never be. The stop within the grace period waits this long for it, then goes on without it.
KILL_WAIT_S = 0.25
AT_ONCE_KILL_WAIT_S = 5.0  # the same wait on a second signal, which has no grace period to keep
WAIT_SLICE_S = 0.05  # a stop waits for its children in slices this long: a second signal acts within one
SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path: sockaddr_un's 108, less the terminating NUL
# Working folders of servers whose processes hold theirs (serving/child.py hold_workdir) from the moment
# it is made: one that no process holds is left behind. Versions before named theirs "recserve-" and
# mkdtemp's 8 characters, and held them later (once a child had started) or not at all: one of those
# unheld may be a live server's.
WORKDIR_PREFIX = "recserve-held-"
WORKDIR_NAME = re.compile(r"recserve-held-[a-z0-9_]{8}")  # tempfile.mkdtemp's names
STALE_WORKDIR_S = 60  # and not changed for this long (a folder just made is not held for a moment)


class StartFailed(Exception):
    """A child died (or went silent) before it was ready: not the user's doing, so exit 1 (3 where an engine
    failed on its device meanwhile), in one line."""


class StoppedWhileStarting(Exception):
    """SIGTERM or SIGINT came before every process was up: stop at once, not after starting the rest."""


class Supervisor:
    def __init__(self, config: ServerConfig, log_level: str) -> None:
        self.config = config
        self.log_level = log_level
        self.frontends = config.frontends or default_frontends()
        self.workdir = tempfile.mkdtemp(prefix=WORKDIR_PREFIX)
        self._workdir_lock = hold_workdir(self.workdir)  # for this process's life: the folder is in use (see _remove_stale)
        self.ctx = mp.get_context("spawn")
        self.engines: List[mp.Process] = []
        self.fronts: List[mp.Process] = []
        self.port = config.port
        self.http_port = config.http_port
        self._stopping = False
        self._at_once = False  # a second SIGTERM/SIGINT: kill the children now, not after the grace period

    def _start(self, target, args, name: str) -> Tuple[mp.Process, Connection]:
        parent, child = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=target, args=(*args, child), name=name, daemon=False)
        # Started with the first child otherwise, and it unblocks SIGINT once up: a Ctrl-C then was lost.
        resource_tracker.ensure_running()
        with _sigint_ignored():
            proc.start()
        child.close()
        return proc, parent

    def _await_ready(self, proc: mp.Process, conn: Connection) -> tuple:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._stopping:
                raise StoppedWhileStarting()
            if conn.poll(0.1):
                try:
                    message = conn.recv()
                except EOFError:
                    break
                if message[0] == "error":
                    raise UserError(message[1])
                return message
            if proc.exitcode is not None:
                break
            gone = next((other for other in (*self.engines, *self.fronts)
                         if other is not proc and other.exitcode is not None), None)
            if gone is not None:  # an engine the front ends are connecting to: they would wait for it in vain
                raise StartFailed(f"{gone.name} exited with code {gone.exitcode} while {proc.name} started; its "
                                  "error, if it had time to say one, is above")
        proc.join(1.0)  # the pipe closes a moment before the process has exited
        if proc.exitcode is None:
            raise StartFailed(f"{proc.name} did not start within {START_TIMEOUT_S} s")
        raise StartFailed(f"{proc.name} did not start (exit code {proc.exitcode}); its error, if it had time "
                          "to say one, is above")

    def start(self) -> None:
        from serving.engine import core as engine
        from serving.frontend import main as frontend

        if self.config.metrics_port:  # before anything starts: a busy port is one line, not a traceback
            frontend.check_free(self.config.host, self.config.metrics_port, "--metrics-port")
        metrics_dir = os.path.join(self.workdir, "metrics")
        os.makedirs(metrics_dir)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # before any child imports prometheus_client
        gpus = visible_gpus(self.config.device)
        count = max(1, min(self.config.replicas or len(gpus), len(gpus))) if gpus else max(1, self.config.replicas)
        paths = [os.path.join(self.workdir, f"engine-{i}.sock") for i in range(count)]
        if len(os.fsencode(paths[-1])) > SOCKET_PATH_MAX:  # else the engine's bind: a traceback, exit 1
            raise UserError(f"the engines' sockets would be {paths[-1]}, {len(os.fsencode(paths[-1]))} bytes, beyond "
                            f"the {SOCKET_PATH_MAX} bytes of a Unix socket's path: set TMPDIR to a shorter directory "
                            "(as TMPDIR=/tmp)")
        for i, path in enumerate(paths):
            # One engine per GPU. Engine 0 sees every GPU (a model sharded over them is its alone);
            # engine i > 0 sees only GPU i. Each holds one copy of every model it serves.
            config = dataclasses.replace(self.config, replicas=1, engine_index=i, engines=count) if count > 1 \
                else self.config
            with _visible(gpus[i] if i > 0 and gpus else None):
                proc, conn = self._start(engine.main, (config, path, self.log_level), f"recserve-engine-{i}")
            self.engines.append(proc)
            self._await_ready(proc, conn)
        for i in range(self.frontends):
            config = self.config if i == 0 else dataclasses.replace(self.config, port=self.port,
                                                                     http_port=self.http_port)
            proc, conn = self._start(frontend.main, (config, paths, i, self.frontends, self.log_level),
                                     f"recserve-frontend-{i}")
            self.fronts.append(proc)
            _, self.port, self.http_port = self._await_ready(proc, conn)
        if self.config.metrics_port:
            from serving.metrics import multiprocess_registry, serve_metrics

            try:
                serve_metrics(self.config.metrics_port, self.config.host, multiprocess_registry(self._processes))
            except OSError:  # taken while the models loaded: say so in one line
                frontend.check_free(self.config.host, self.config.metrics_port, "--metrics-port")
                raise
        host = self.config.host
        http = "" if self.http_port is None else f"; HTTP/REST on {frontend.host_port(host, self.http_port)}"
        print(f"recserve: listening on {frontend.host_port(host, self.port)} ({_counted(self.frontends, 'frontend')}, "
              f"{_counted(count, 'engine')}){http}", flush=True)

    def _processes(self) -> List[Tuple[str, int]]:
        """(role, pid) of each process of the server, for their process_* metrics."""
        engines = [("engine", p.pid) for p in self.engines] if len(self.engines) == 1 else \
            [(f"engine-{i}", p.pid) for i, p in enumerate(self.engines)]
        return [("supervisor", os.getpid()), *engines,
                *((f"frontend-{i}", p.pid) for i, p in enumerate(self.fronts))]

    def request_stop(self, signum=None, frame=None) -> None:
        """SIGTERM or SIGINT: stop (front ends drain, then the engines). A second one while stopping (Ctrl-C
        pressed again): stop at once; the drain in progress is cut short within WAIT_SLICE_S."""
        self._at_once = self._stopping
        self._stopping = True

    def run(self) -> int:
        """Until a signal or until a process exits on its own; returns the exit code."""
        procs = [*self.engines, *self.fronts]
        while not self._stopping:
            ended = [p for p in procs if p.exitcode is not None]
            if ended:
                return self._take_down(ended[0])
            wait([p.sentinel for p in procs], timeout=0.2)
        log.info("shutting down: NOT_SERVING, refusing new requests, %.1fs grace", self.config.grace_period_s)
        code = self._stop_all()
        log.info("stopped")
        return code

    def _take_down(self, first: mp.Process) -> int:
        """One process ended on its own: the server goes down with it, never half-alive. The exit
        code is the engine's if it failed (3: its device failed), else that process's, never 0."""
        log.critical("%s exited with code %s: stopping the server", first.name, first.exitcode)
        self._stop_all()
        for code in (*(p.exitcode for p in self.engines), first.exitcode):
            if code and code > 0:
                return code
        return 1

    def _stop_all(self) -> int:
        """Front ends first (they stop taking requests and drain them through the engine), then the
        engine; everything is down within the grace period plus one second, whatever hangs."""
        deadline = time.monotonic() + self.config.grace_period_s + 1.0
        at_once = lambda: self._at_once  # noqa: E731
        codes = _terminate(self.fronts, deadline - 0.5, at_once)
        codes += _terminate(self.engines, deadline - KILL_WAIT_S, at_once)
        shutil.rmtree(self.workdir, ignore_errors=True)
        if self._at_once:  # killed on the operator's word, not for failing to stop: 0, unless one would not die
            log.warning("stopped at once on a second signal; requests in flight were not answered")
            return 1 if self.stuck() else 0
        failed = [c for c in codes if c != 0]  # None: it would not die
        return (failed[0] if failed[0] is not None and failed[0] > 0 else 1) if failed else 0

    def kill_all(self) -> None:
        procs = [*self.fronts, *self.engines]
        for p in procs:
            if p.exitcode is None:
                p.kill()
        _reap_killed(procs)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def stuck(self) -> List[mp.Process]:
        """The children still running after a stop: they would not die of SIGKILL."""
        return [p for p in (*self.fronts, *self.engines) if p.exitcode is None]


def _counted(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def visible_gpus(device: str) -> List[str]:
    """The GPUs the engines may use (as CUDA_VISIBLE_DEVICES names them), none for a CPU server."""
    if device == "cpu":
        return []
    import torch  # the device count only (NVML): no CUDA context in the supervisor

    count = torch.cuda.device_count()
    names = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return (names or [str(i) for i in range(count)])[:count]


@contextlib.contextmanager
def _visible(gpu: Optional[str]):
    """Start a child that sees only ``gpu`` (None: what this process sees); spawn copies the
    environment at start."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


@contextlib.contextmanager
def _sigint_ignored():
    """Start a child that ignores SIGINT from its first instruction (the disposition survives exec,
    and Python then installs no KeyboardInterrupt): Ctrl-C reaches the whole group, and a child still
    importing (torch: seconds) before child_setup died of it, failing the server's start with a
    traceback. One that arrives meanwhile waits, blocked, for this process's own handler."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _never() -> bool:
    return False


def _terminate(procs: List[mp.Process], deadline: float, at_once: Callable[[], bool] = _never) -> List[int]:
    """SIGTERM, then SIGKILL for those still running at ``deadline``, or as soon as ``at_once()``."""
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    while not at_once():
        running = [p for p in procs if p.exitcode is None]
        left = deadline - time.monotonic()
        if not running or left <= 0:
            break
        running[0].join(min(left, WAIT_SLICE_S))
    killed = [p for p in procs if p.exitcode is None]
    for p in killed:
        if not at_once():
            log.error("%s did not stop within the grace period; killing it", p.name)
        p.kill()
    _reap_killed(killed, AT_ONCE_KILL_WAIT_S if at_once() else KILL_WAIT_S)
    return [p.exitcode for p in procs]


def _reap_killed(procs: List[mp.Process], wait_s: float = KILL_WAIT_S) -> None:
    """Wait for killed processes, at most ``wait_s``: the server is down within the grace period plus
    one second even if one of them never dies."""
    deadline = time.monotonic() + wait_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            log.critical("%s (pid %d) did not exit after SIGKILL within %g s (stuck in the kernel, as in a GPU "
                         "driver call, or still freeing much memory); the server exits without it", p.name, p.pid,
                         wait_s)


def _remove_stale(directory: str) -> None:
    """Remove this user's working folders that no process holds any more: those of servers killed whole
    (the supervisor with its children: a container's OOM kill takes every process of it), which no
    process of theirs was left to remove. Each in use is held (serving/child.py :func:`hold_workdir`); those of servers of
    earlier versions, which may be in use unheld, are never named WORKDIR_NAME and are left alone."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        try:
            if not (WORKDIR_NAME.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)):
                continue
            info = entry.stat(follow_symlinks=False)
            if info.st_uid != os.geteuid() or time.time() - info.st_mtime < STALE_WORKDIR_S:
                continue
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # refused: a process of its server still holds it
        except OSError:
            os.close(fd)
            continue
        shutil.rmtree(entry.path, ignore_errors=True)  # does not follow symlinks inside it
        os.close(fd)
        log.info("removed %s, the working folder of a server that was killed", entry.path)


def serve(config: ServerConfig, log_level: str = "INFO") -> NoReturn:
    """Run the server until a signal or a failure, then end this process with its exit code (a start
    refused for the user's error raises it, for the command's one line)."""
    _remove_stale(tempfile.gettempdir())
    supervisor = Supervisor(config, log_level)
    # Signals only set a flag here; the children get their own SIGTERM from the supervisor in order.
    signal.signal(signal.SIGTERM, supervisor.request_stop)
    signal.signal(signal.SIGINT, supervisor.request_stop)
    try:
        supervisor.start()
    except StartFailed as e:
        supervisor.kill_all()
        log.critical("%s", e)
        # An engine may have failed on its own meanwhile (3: its device, in a load while the front ends started)
        code = next((c for c in (p.exitcode for p in supervisor.engines) if c and c > 0), 1)
    except StoppedWhileStarting:
        supervisor._stop_all()  # what started stops as on any SIGTERM; one still importing dies of it
        log.info("stopped while starting")
        code = 1 if supervisor.stuck() else 0  # one that SIGKILL did not end is left behind: not a clean stop
    except BaseException:
        supervisor.kill_all()
        _forget(supervisor.stuck())  # the command prints its error and exits: never waiting for these
        raise
    else:
        code = supervisor.run()
    # The server is down: a later signal must not kill the exit itself.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit(code)


def _forget(procs: Iterable[mp.Process]) -> None:
    """multiprocessing joins every child it started when the interpreter exits, with no time limit: a
    child that SIGKILL did not end (serving.supervisor._reap_killed) would keep this process forever."""
    children = getattr(mp.process, "_children", None)
    for p in procs:
        if children is not None:
            children.discard(p)


def _exit(code: int) -> NoReturn:
    """End the supervisor now, its output flushed: the interpreter's own exit (torch's modules torn down,
    multiprocessing joining its children: forever for one that SIGKILL did not end) took 0.5-1 s more
    after the children had stopped, past the grace period plus one second the stop promises."""
    from recserve.logs import restore_stderr

    sys.stdout.flush()
    restore_stderr()
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)
