"""`moet supervise NAME`: the main process of moet@NAME.service, and systemd's only informant.

It starts vLLM's OpenAI server (the command from moet.serving) in a process group of its own and
tells systemd what is true: loading (EXTEND_TIMEOUT_USEC while the load makes progress), READY=1
once /health answers and a warm-up completion came back, WATCHDOG=1 only while /health stays
healthy, STOPPING=1 on SIGTERM. It stops the whole group (SIGTERM, then SIGKILL after a grace
shorter than TimeoutStopSec) and exits non-zero when vLLM dies, so Restart=on-failure applies.

`moet serve` runs the same `ServerRun` in the foreground (`console=True`): the same phases, printed
as `moet:` lines, with vLLM's output passed through `moet.serving.VllmOutput`.

A model under `nodes:` is one vLLM across hosts (its multiprocess executor, `--nnodes`): the head
(rank 0) is supervised as above; a worker host runs vLLM headless and has no /health of its own, so
its supervisor holds a connection to the head's rendezvous port (`HeadLink`): READY=1 once it is
open, WATCHDOG=1 while it stays open, and exit 1 when it closes, because vLLM's headless workers
wait for a stopped head forever and a restarted head needs fresh workers.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moet.config import Located, ModelSpec, load_config, preflight, read_api_key
from moet.errors import ConfigError
from moet.sdnotify import Notifier
from moet.serving import VllmOutput, check_placement, health, on_cpu, server_argv, server_env
from moet.status import ENGINE_FILE, PHASE_FILE, STATUS_ENV, write_status

TICK_S = 0.25
HEALTH_EVERY_S = 1.0  # while loading; once serving, every watchdog interval (or this × 5)
EXTEND_EVERY_S = 5.0
EXTEND_USEC = 60_000_000  # each sign of load progress buys a minute
WARMUP_TIMEOUT_S = 600.0
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
# A head host that vanishes without closing the connection (power, network) is given up after
# KEEPALIVE_IDLE_S + KEEPALIVE_COUNT × KEEPALIVE_EVERY_S seconds of silence.
KEEPALIVE_IDLE_S, KEEPALIVE_EVERY_S, KEEPALIVE_COUNT = 5, 5, 3


def supervise(config_path: Path | None, name: str, notifier: Notifier) -> int:
    """Run model `name` until SIGTERM/SIGINT (exit 0) or until vLLM dies (exit 1)."""
    notifier.send(STATUS=f"checking {name}")
    try:
        located = load_config(config_path)
        model_dir = preflight(located, name)
        dirs = _prepare_dirs(located, name)
        api_key = read_api_key(located.config.models[name])
    except (ConfigError, OSError) as exc:
        notifier.send(echo=False, STATUS=f"configuration error: {exc}")  # the CLI prints it once
        raise
    spec = located.config.models[name]
    argv, env = vllm_command(located, name, model_dir, dirs, api_key)
    nodes = spec.nodes
    worker = nodes is not None and not nodes.is_head
    launch = Launch(
        name, model_dir, argv, env, connect_url(nodes.head if worker else spec.host, spec.port), dirs["state"],
        located.config.settings.stop_grace_s, head=(nodes.head, nodes.port) if worker else None,
    )
    return ServerRun(launch, notifier).run()


def _prepare_dirs(located: Located, name: str) -> dict[str, Path]:
    dirs = located.config.model_dirs(name)
    keys = {"state": "state_dir", "packs": "pack_dir", "staging": "staging_dir"}
    for role, path in dirs.items():
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / f".moet-write-test.{os.getpid()}"
            probe.touch()
            probe.unlink()
        except OSError as exc:
            raise located.error(("settings", keys[role]), f"{path} is not writable ({exc.strerror})") from None
    return dirs


def vllm_command(located: Located, name: str, model_dir: Path, dirs: dict[str, Path], api_key: str | None) -> tuple[list[str], dict[str, str]]:
    """vLLM's argv and environment for model `name`; the API key travels in the environment only."""
    spec = located.config.models[name]
    knobs = located.config.knobs_for(name)
    args = list(spec.args)
    if spec.nodes is not None:
        if spec.nodes.split == "pipeline" and on_cpu():
            raise located.error(
                ("models", name, "nodes", "split"),
                "pipeline parallelism fails at the first request on vLLM's CPU build in eager mode, which moet "
                "serves CPU models in (0.32 allocates the pipeline's buffers only in a compile-mode warm-up); set split: tensor",
            )
        args = multinode_args(spec) + args
    elif spec.gpus and len(spec.gpus) > 1 and not any(a.split("=")[0] in ("--tensor-parallel-size", "-tp") for a in args):
        args += ["--tensor-parallel-size", str(len(spec.gpus))]
    try:
        check_placement(knobs)
    except ConfigError as exc:
        raise located.error(("models", name), str(exc)) from None
    worker = spec.nodes is not None and not spec.nodes.is_head
    argv = server_argv(model_dir, spec.host, spec.port, args, served_name=name, w2=knobs.w2, headless=worker)
    base = {"HF_HUB_CACHE": str(dirs["staging"]), **os.environ, **spec.env}
    env = server_env(knobs, base)
    env[STATUS_ENV] = str(dirs["state"] / ENGINE_FILE)
    if spec.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, spec.gpus))
    if spec.nodes is not None and spec.nodes.address is not None:
        env["VLLM_HOST_IP"] = spec.nodes.address
    if api_key is not None and not worker:
        env["VLLM_API_KEY"] = api_key
    return argv, env


def multinode_args(spec: ModelSpec) -> list[str]:
    """vLLM's flags for one host of a model under `nodes`: its multiprocess executor across hosts
    (vLLM's own multi-node backend; Ray is not needed), one rank per GPU of `gpus` on every host.
    `split: pipeline` is vLLM's advice for several hosts (tensor parallel inside a host, pipeline
    stages across them); `tensor` makes one tensor-parallel group of every host's ranks."""
    assert spec.nodes is not None
    nodes, per_host = spec.nodes, spec.ranks_per_node()
    tp, pp = (per_host * nodes.count, 1) if nodes.split == "tensor" else (per_host, nodes.count)
    return [
        "--distributed-executor-backend", "mp", "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
        "--nnodes", str(nodes.count), "--node-rank", str(nodes.rank), "--master-addr", nodes.head, "--master-port", str(nodes.port),
    ]


@dataclass(frozen=True)
class Launch:
    """One vLLM server to start and watch: from the model list (`moet supervise`) or from the
    command line (`moet serve`)."""

    name: str  # the served model name: in every message and in the warm-up request
    model_dir: Path
    argv: list[str]
    env: dict[str, str]  # carries MOET_STATUS_FILE, and VLLM_API_KEY when clients need a key
    base_url: str
    run_dir: Path  # where the phase is written (PHASE_FILE), for `moet status`
    grace_s: float
    head: tuple[str, int] | None = None  # a worker host of a multi-node model: the head's rendezvous address


class ServerRun:
    """One vLLM process group, from start to exit. `console`: run for a person at a terminal
    (`moet serve`): vLLM's output goes through VllmOutput, and a death is not left to systemd."""

    def __init__(self, launch: Launch, notifier: Notifier, console: bool = False) -> None:
        self.name, self.model_dir, self.notify, self.console = launch.name, launch.model_dir, notifier, console
        self.grace_s, self.base_url = launch.grace_s, launch.base_url
        self.argv, self.env = launch.argv, launch.env
        self.api_key = launch.env.get("VLLM_API_KEY")
        self.state_file = launch.run_dir / PHASE_FILE
        self.stop_requested = False
        self.output: threading.Thread | None = None
        self.head = HeadLink(*launch.head) if launch.head is not None else None

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        # Orphans of vLLM (engine workers whose parent died) are re-parented to us and reaped here.
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        Path(self.env[STATUS_ENV]).unlink(missing_ok=True)
        piped = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT} if self.console else {}
        self.child = subprocess.Popen(self.argv, env=self.env, start_new_session=True, preexec_fn=_die_with_parent, **piped)
        self.pgid = self.child.pid
        if self.console:
            assert self.child.stdout is not None
            self.output = threading.Thread(target=VllmOutput(sys.stdout).copy, args=(self.child.stdout,), daemon=True)
            self.output.start()
        self._phase("loading", f"loading {self.model_dir} (vLLM pid {self.pgid})")
        try:
            return self._loop()
        finally:
            self._stop_group()

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stop_requested = True

    def _phase(self, phase: str, status: str, **extra: object) -> None:
        self.phase = phase
        self.notify.send(STATUS=status, **extra)
        write_status(
            {
                "state": phase, "status": status, "pid": os.getpid(), "vllm_pid": self.pgid, "since": time.time(),
                "name": self.name, "url": self.base_url, "started_by": "moet serve" if self.console else "moet supervise",
            },
            self.state_file,
        )

    def _loop(self) -> int:
        """One tick at a time: stop on request, fail when vLLM died, else advance the phase."""
        self.started = self.next_health = time.monotonic()
        self.next_extend = self.started + EXTEND_EVERY_S
        self.work = _group_work(self.pgid)
        self.healthy = False
        self.warmup: _Warmup | None = None
        ticks = {"loading": self._tick_loading, "warming up": self._tick_warming_up, "serving": self._tick_serving}
        if self.head is not None:
            ticks = {"loading": self._tick_joining, "serving": self._tick_worker}
        while True:
            if self.stop_requested:
                self._phase("stopping", f"stopping {self.name}: SIGTERM to vLLM, SIGKILL after {self.grace_s:g} s", STOPPING=1)
                self._stop_group()
                self._phase("stopped", f"stopped {self.name}")
                return 0
            code = self.child.poll()
            if code is not None:
                how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
                then = "its output above says why" if self.console else f"exiting so systemd restarts {self.name}"
                self._phase("failed", f"vLLM {how} while {self.phase}; {then}")
                return 1
            if not ticks[self.phase](time.monotonic()):
                return 1
            time.sleep(TICK_S)

    def _extend_if_progressing(self, now: float) -> None:
        """EXTEND_TIMEOUT_USEC, but only when vLLM's CPU time or bytes read grew since the last look:
        a hung load runs into TimeoutStartSec instead of being extended forever."""
        if now < self.next_extend:
            return
        self.next_extend = now + EXTEND_EVERY_S
        work = _group_work(self.pgid)
        if work > self.work:
            self.notify.send(EXTEND_TIMEOUT_USEC=EXTEND_USEC, STATUS=f"{self.phase} {self.name} ({now - self.started:.0f} s)")
        self.work = work

    def _tick_loading(self, now: float) -> bool:
        self._extend_if_progressing(now)
        if now >= self.next_health:
            self.next_health = now + HEALTH_EVERY_S
            if health(self.base_url) == 200:
                self._phase("warming up", f"warming up {self.name}: first completion")
                self.warmup = _Warmup(self._warmup)
        return True

    def _tick_warming_up(self, now: float) -> bool:
        self._extend_if_progressing(now)
        assert self.warmup is not None
        if not self.warmup.done.is_set():
            return True
        if self.warmup.error is not None:
            self._phase("failed", f"warm-up completion failed: {self.warmup.error}")
            return False
        self.healthy = True
        self._phase("serving", f"serving {self.name} on {self.base_url}/v1: ready after {now - self.started:.0f} s", READY=1)
        self.next_health = now
        return True

    def _tick_serving(self, now: float) -> bool:
        """WATCHDOG=1 after each healthy /health, nothing while unhealthy (systemd's watchdog then
        restarts a server that stays sick); STATUS says when health comes and goes."""
        if now < self.next_health:
            return True
        self.next_health = now + (self.notify.watchdog_interval_s or HEALTH_EVERY_S * 5)
        if health(self.base_url) == 200:
            if self.notify.watchdog_interval_s:
                self.notify.send(WATCHDOG=1)
            if not self.healthy:
                self.notify.send(STATUS=f"serving {self.name} on {self.base_url} (healthy again)")
            self.healthy = True
        elif self.healthy:
            self.healthy = False
            self.notify.send(STATUS=f"unhealthy: {self.base_url}/health does not answer 200; no watchdog ping")
        return True

    def _tick_joining(self, now: float) -> bool:
        """A worker host: loading until the head's rendezvous port takes the link's connection."""
        assert self.head is not None
        self._extend_if_progressing(now)
        if now >= self.next_health:
            self.next_health = now + HEALTH_EVERY_S
            if self.head.connect():
                self.healthy = True
                self.next_watchdog = now
                self._phase("serving", f"worker of {self.name}: vLLM headless, connected to the head at {self.head.where}", READY=1)
        return True

    def _tick_worker(self, now: float) -> bool:
        """A worker host: WATCHDOG=1 while the head's connection stays open; exit 1 (systemd restarts
        the worker, which then joins the head's next vLLM) once the head closed it."""
        assert self.head is not None
        if now < self.next_health:
            return True
        self.next_health = now + HEALTH_EVERY_S
        if self.head.lost():
            self._phase("failed", f"the head at {self.head.where} is gone (its vLLM stopped); exiting so systemd restarts this worker to rejoin")
            return False
        if self.notify.watchdog_interval_s and now >= self.next_watchdog:
            self.next_watchdog = now + self.notify.watchdog_interval_s
            self.notify.send(WATCHDOG=1)
        return True

    def _warmup(self) -> None:
        body = json.dumps({"model": self.name, "prompt": "Hello", "max_tokens": 1, "temperature": 0}).encode()
        request = urllib.request.Request(f"{self.base_url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
        if self.api_key is not None:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        with urllib.request.urlopen(request, timeout=WARMUP_TIMEOUT_S) as response:
            if not json.load(response).get("choices"):
                raise RuntimeError("the completion had no choices")

    def _stop_group(self) -> None:
        """SIGTERM to vLLM's API server first (it stops its engine and workers in order); SIGTERM to
        the whole group once the server is gone or half the grace has passed (uvicorn otherwise
        waits for streams in flight, and SIGTERM lets the engine free its shared memory); SIGKILL
        to whatever is left when the grace runs out. Everything is reaped."""
        if self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)
        start = time.monotonic()
        group_termed = False
        while self._reap() and time.monotonic() - start < self.grace_s:
            if not group_termed and (self.child.returncode is not None or time.monotonic() - start >= self.grace_s / 2):
                group_termed = _signal_group(self.pgid, signal.SIGTERM)
            time.sleep(0.1)
        if self._reap():
            self.notify.send(STATUS=f"vLLM did not stop within {self.grace_s:g} s; SIGKILL to its process group")
            _signal_group(self.pgid, signal.SIGKILL)
            while self._reap():
                time.sleep(0.05)
        if self.output is not None:
            self.output.join(timeout=5)  # vLLM's last lines before ours
        if self.head is not None:
            self.head.close()

    def _reap(self) -> bool:
        """Collect exited members of the group; True while any member is still alive."""
        self.child.poll()
        if self.child.returncode is not None:
            try:
                while os.waitpid(-self.pgid, os.WNOHANG)[0] > 0:
                    pass
            except ChildProcessError:
                pass
        return _signal_group(self.pgid, 0)


class HeadLink:
    """A worker host's TCP connection to the head's rendezvous port: the torch.distributed store that
    the head's rank 0 serves for as long as the head's vLLM runs. It carries nothing; its end says the
    head stopped (keepalive probes notice a head host that vanished without closing it)."""

    def __init__(self, host: str, port: int) -> None:
        self.address = (host, port)
        self.where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.sock: socket.socket | None = None

    def connect(self) -> bool:
        """Open the connection; False while the head's store does not listen yet."""
        try:
            sock = socket.create_connection(self.address, timeout=1)
        except OSError:
            return False
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_EVERY_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)
        sock.setblocking(False)
        self.sock = sock
        return True

    def lost(self) -> bool:
        """True once the head closed the connection or keepalive gave it up."""
        assert self.sock is not None
        try:
            return self.sock.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class _Warmup:
    """The warm-up request on a daemon thread, so that signals and vLLM's death are still seen
    while it runs, and a stuck request never holds up the supervisor's exit."""

    def __init__(self, request: Callable[[], None]) -> None:
        self.error: Exception | None = None
        self.done = threading.Event()
        threading.Thread(target=self._run, args=(request,), daemon=True).start()

    def _run(self, request: Callable[[], None]) -> None:
        try:
            request()
        except Exception as exc:  # reported as the phase's failure
            self.error = exc
        finally:
            self.done.set()


_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    """In vLLM's server, before exec: SIGTERM when the supervisor dies, even by SIGKILL (outside
    systemd nobody else would stop it). Runs before any thread of ours exists."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def _group_work(pgid: int) -> int:
    """CPU ticks plus bytes read by the members of process group `pgid` (monotone while loading)."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:
                continue
            total += int(fields[11]) + int(fields[12])
            io = Path(entry.path, "io").read_text().split()
            total += int(io[io.index("rchar:") + 1])
        except (OSError, ValueError, IndexError):
            continue
    return total


def connect_url(host: str, port: int) -> str:
    """Where to reach a server bound to host:port (a wildcard bind is reached over loopback)."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
