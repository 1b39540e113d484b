"""The project's OpenAI server as a child process, for the load sweep, the soak and the reliability tests.

:class:`ServerProcess` runs ``python -m vllm_treespec.tools.cli serve MODEL --host 127.0.0.1 --port P ...`` in a process
group of its own, waits for ``/health``, and on exit always stops the whole group (SIGTERM, then SIGKILL). It binds
to the loopback address only, and every client in this project talks to it there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

LOOPBACK = "127.0.0.1"


class ServerStartError(RuntimeError):
    """The server exited or never became healthy; ``log_tail`` holds the end of its output."""

    def __init__(self, message: str, returncode: int | None, log_tail: str) -> None:
        super().__init__(f"{message}\n--- server output (tail) ---\n{log_tail}")
        self.returncode = returncode
        self.log_tail = log_tail


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def serve_command(model: str, port: int, speculative_config: dict[str, Any] | None = None,
                  extra_args: Sequence[str] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "vllm_treespec.tools.cli", "serve", model, "--host", LOOPBACK, "--port", str(port)]
    if speculative_config is not None:
        cmd += ["--speculative-config", json.dumps(speculative_config)]
    return cmd + list(extra_args)


class ServerProcess:
    """``with ServerProcess(model, spec, ["--dtype", "float32"]) as server: server.url``"""

    def __init__(self, model: str, speculative_config: dict[str, Any] | None = None,
                 extra_args: Sequence[str] = (), port: int | None = None, log_path: str | os.PathLike | None = None,
                 env: dict[str, str] | None = None, startup_timeout_s: float = 600.0) -> None:
        self.port = port or free_port()
        self.command = serve_command(model, self.port, speculative_config, extra_args)
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.startup_timeout_s = startup_timeout_s
        self.env = {**os.environ, **(env or {})}
        self.env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="vllm-treespec-serve-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.process: subprocess.Popen | None = None

    # --- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> ServerProcess:
        log = open(self.log_path, "wb")
        try:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise ServerStartError(f"server exited with status {code} during startup", code, self.log_tail())
            if self.healthy(timeout_s=2.0):
                return
            time.sleep(0.5)
        raise ServerStartError(f"server not healthy after {self.startup_timeout_s:.0f} s", None, self.log_tail())

    def healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout_s) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace_s: float = 20.0) -> int | None:
        """Stop the whole process group: SIGTERM, then SIGKILL after ``grace_s``. Returns the exit status."""
        if self.process is None:
            return None
        pgid = self.process.pid  # start_new_session: the group id is the child's pid
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=wait_s)
                # the engine core and workers share the group; make sure none outlives the API server
                time.sleep(0.2)
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # --- observation ----------------------------------------------------------------------------------------------
    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def rss_by_process(self) -> dict[int, tuple[str, int]]:
        """Resident memory of the server and each of its descendants, ``pid -> (name, bytes)``: the API server,
        engine core and workers, and any short-lived helper they start (the C++ compiler behind a ``torch.compile``
        that vLLM runs on first use, say)."""
        import psutil

        if not self.alive():
            return {}
        found = {}
        for p in process_tree(self.process.pid):
            try:
                found[p.pid] = (p.name(), p.memory_info().rss)
            except psutil.NoSuchProcess:
                pass
        return found


def process_tree(root_pid: int) -> list:
    """``root_pid`` and each of its descendants as ``psutil.Process`` (empty once it has exited)."""
    import psutil

    try:
        root = psutil.Process(root_pid)
        return [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def cpu_seconds_by_process(root_pid: int) -> dict[int, tuple[int, str, float]]:
    """CPU seconds (user + system) that ``root_pid`` and each of its descendants has run, ``pid -> (parent pid, name,
    seconds)`` (vLLM names its processes: ``VLLM::EngineCore``, ``VLLM::Worker``)."""
    import psutil

    found: dict[int, tuple[int, str, float]] = {}
    for p in process_tree(root_pid):
        try:
            times = p.cpu_times()
            found[p.pid] = (p.ppid(), p.name(), times.user + times.system)
        except psutil.Error:  # exited between the listing and the reading
            pass
    return found


def _busy_seconds(times: Any) -> float:
    """A core's seconds not idle from ``psutil.cpu_times`` fields: Linux counts a guest's time in ``user`` and
    ``nice`` as well as in ``guest`` and ``guest_nice``, so those are not added twice (as ``psutil.cpu_percent``)."""
    fields = times._asdict()
    return sum(fields.values()) - sum(fields.get(name, 0.0) for name in ("idle", "iowait", "guest", "guest_nice"))


class CpuUse:
    """Where the machine's CPU time went between :meth:`start` and :meth:`stop`: each core's busy seconds, and the
    seconds of this load generator (``load generator``), of each process of the server under test (by name: its API
    server, ``VLLM::EngineCore``, ``VLLM::Worker``) and of every other process this load generator started (another
    server of an interleaved run: ``other NAME``). A server whose replies reached the client in bursts while its
    engine stepped on (the first of them finished at the engine 3 s before the client heard) is explained, or not,
    by what else ran on the CPUs."""

    def __init__(self, server_pid: int, generator_pid: int | None = None) -> None:
        self.server_pid = server_pid
        self.generator_pid = os.getpid() if generator_pid is None else generator_pid
        self._cores: list | None = None
        self._procs: dict[int, tuple[int, str, float]] = {}
        self._started = 0.0

    def start(self) -> CpuUse:
        import psutil

        self._started = time.perf_counter()
        self._cores = psutil.cpu_times(percpu=True)
        self._procs = cpu_seconds_by_process(self.generator_pid)
        return self

    def stop(self) -> dict[str, Any]:
        """``wall_s``; ``core_busy_s``: per core, its seconds not idle; ``processes``: seconds by role and name
        (processes of one name summed; one that started during the window counts from zero)."""
        import psutil

        wall = time.perf_counter() - self._started
        cores = psutil.cpu_times(percpu=True)
        procs = cpu_seconds_by_process(self.generator_pid)
        busy = [round(max(_busy_seconds(after) - _busy_seconds(before), 0.0), 3)
                for before, after in zip(self._cores or [], cores)]
        by_role: dict[str, float] = {}
        for pid, (_, name, seconds) in procs.items():
            spent = max(seconds - self._procs.get(pid, (0, name, 0.0))[2], 0.0)
            role = "load generator" if pid == self.generator_pid else (
                name if self._under_server(pid, procs) else f"other {name}")
            by_role[role] = round(by_role.get(role, 0.0) + spent, 3)
        return {"wall_s": round(wall, 3), "core_busy_s": busy, "processes": by_role}

    def _under_server(self, pid: int, procs: dict[int, tuple[int, str, float]]) -> bool:
        while pid in procs and pid != self.generator_pid:
            if pid == self.server_pid:
                return True
            pid = procs[pid][0]
        return False


#: name prefixes of a CPU worker's helper threads, which inherit its binding: torch.distributed's gloo loops (13 per
#: worker in vLLM 0.32, each waking every 10 ms) and ZeroMQ's I/O threads
WORKER_HELPER_THREADS = ("gloo", "ZMQbg")


def keep_off_worker_cpus(root_pid: int) -> set[int]:
    """Pin every thread of process ``root_pid`` and its descendants, except vLLM's CPU workers' compute threads, to
    the CPUs the workers left free; returns those CPUs (empty: nothing pinned, e.g. no CPU worker). vLLM binds each
    CPU worker to its cores and reserves the others for the engine core (a worker is a process whose affinity is
    narrower than the root's), but nothing keeps the API server, the engine core or a load generator off the
    worker's cores: on a small machine the OS moves them there, and they take turns with the worker's one thread.
    Nor its own helper threads (:data:`WORKER_HELPER_THREADS`), which inherit its binding: a served worker at 16
    requests was preempted ~38 times a step, 2.8% of its forward off the CPU, with three servers' worth of them."""
    import psutil

    root = psutil.Process(root_pid)
    everything = set(root.cpu_affinity())
    moved, workers = [], set()  # (pid, the names of its threads to move; None: every thread)
    for proc in [root] + root.children(recursive=True):
        try:
            cpus = set(proc.cpu_affinity())
        except psutil.NoSuchProcess:
            continue
        if cpus < everything:
            workers |= cpus
            moved.append((proc.pid, WORKER_HELPER_THREADS))
        else:
            moved.append((proc.pid, None))
    free = everything - workers
    if not workers or not free:
        return set()
    for pid, named in moved:
        try:
            pin_threads(pid, free, named=named)
        except (FileNotFoundError, ProcessLookupError):  # it exited meanwhile
            pass
    return free


@contextlib.contextmanager
def off_the_workers_cpus(root_pid: int) -> Iterator[set[int]]:
    """:func:`keep_off_worker_cpus` for ``root_pid``'s processes and this one (a load generator, a front end) while
    open; on exit this process's threads get back the CPUs they had, so the next engine or server starts free
    (vLLM places its worker itself). Yields the CPUs they were pinned to (empty: none)."""
    mine = os.sched_getaffinity(0)
    try:
        free = keep_off_worker_cpus(root_pid)
        if free:
            pin_threads(os.getpid(), free)
        yield free
    finally:
        pin_threads(os.getpid(), mine)


@contextlib.contextmanager
def client_priority() -> Iterator[str]:
    """The calling thread (a load generator's event loop) at real-time priority while open: ``SCHED_FIFO`` 1, with
    ``SCHED_RESET_ON_FORK`` so that no thread or process it starts inherits it; yields ``"fifo"``, or ``"normal"``
    where the system does not allow it (no ``CAP_SYS_NICE``), and restores the thread's policy on exit.

    Why: a CPU engine core waits for its worker's forward in a ``sched_yield`` loop (vLLM's message queue polls for
    a second after each read, so throughout a load level), and it shares the CPUs vLLM reserves with the API server
    and, under :func:`off_the_workers_cpus`, with this load generator. There the generator, preempted inside a
    ``send()``, went without a CPU for up to 26 s while the engine core took 92% of the reserved core: the engine
    then got each request only when the one before it had finished, and the replies reached the client in one burst
    (a level ran 45 tok/s in one round and 152 in the next; graft and no speculation alike). The generator needs
    about 2% of a core; at real-time priority it is never starved, and it cannot starve the servers (it sleeps in
    ``epoll``, and the kernel keeps 5% of each second for other tasks)."""
    policy = getattr(os, "SCHED_FIFO", None)
    try:
        previous = os.sched_getscheduler(0), os.sched_getparam(0)
        os.sched_setscheduler(0, policy | os.SCHED_RESET_ON_FORK, os.sched_param(1))
    except (AttributeError, TypeError, OSError):  # not Linux, or not permitted
        yield "normal"
        return
    try:
        yield "fifo"
    finally:
        os.sched_setscheduler(0, previous[0] & ~os.SCHED_RESET_ON_FORK, previous[1])


def pin_threads(pid: int, cpus: Iterable[int], named: tuple[str, ...] | None = None) -> None:
    """Every thread of process ``pid`` (``os.getpid()``: this one) onto ``cpus``, or only those whose name starts
    with one of ``named``; threads it starts later inherit the mask of the thread that starts them."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            if named is not None:
                with open(f"/proc/{pid}/task/{tid}/comm") as comm:
                    if not comm.read().startswith(named):
                        continue
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, FileNotFoundError):  # the thread ended meanwhile
            pass


class RssSampler:
    """Samples :meth:`ServerProcess.rss_by_process` on a background thread every ``interval_s``.

    The server's own processes are those alive at the first sample (API server, engine core, workers): a leak shows
    in them. Processes that appear later are helpers, such as the C++ compiler inductor runs when vLLM compiles a
    sampler op on its first use; they come and go, so they are reported apart rather than counted as the server's
    growth."""

    def __init__(self, server: ServerProcess, interval_s: float = 1.0) -> None:
        import threading

        self.server = server
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[int, tuple[str, int]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        start = time.monotonic()
        while not self._stop.is_set():
            self.samples.append((time.monotonic() - start, self.server.rss_by_process()))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((self.samples[-1][0] if self.samples else 0.0, self.server.rss_by_process()))

    def summary(self) -> dict[str, Any]:
        """MiB of the server's own processes at the start, middle and end of the run and at most, and the most its
        helpers held at once (``helpers_max_mib``, with their names)."""
        taken = [by_pid for _, by_pid in self.samples if by_pid]
        if not taken:
            return {"samples": 0}
        mib = 1 << 20
        server_pids = set(taken[0])
        own = [sum(size for pid, (_, size) in by_pid.items() if pid in server_pids) / mib for by_pid in taken]
        helpers = [{pid: entry for pid, entry in by_pid.items() if pid not in server_pids} for by_pid in taken]
        # the KV cache's pages count once first touched, so RSS climbs early; a leak keeps climbing after mid-run
        return {"samples": len(own), "start_mib": own[0], "mid_mib": own[len(own) // 2], "end_mib": own[-1],
                "max_mib": max(own),
                "helpers_max_mib": max(sum(size for _, size in h.values()) for h in helpers) / mib,
                "helpers": sorted({name for h in helpers for name, _ in h.values()})}


# ----------------------------------------------------------------------------------------------------------------
# Loopback HTTP client (aiohttp)


class Reply:
    """What one request got back: HTTP status, parsed body or assembled stream, and timings (seconds)."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.body: Any = None
        self.error: str | None = None
        self.text = ""
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.chunks = 0
        self.started = 0.0
        self.first_token_s: float | None = None  # TTFT
        self.chunk_gaps_s: list[float] = []  # inter-token (inter-chunk) latencies after the first
        self.elapsed_s = 0.0
        self.aborted = False

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def completion_tokens(self) -> int:
        if self.usage and self.usage.get("completion_tokens") is not None:
            return int(self.usage["completion_tokens"])
        return len(self.token_ids)


def _choice_delta(choice: dict) -> tuple[str, list[int]]:
    if "delta" in choice:  # chat stream
        text = (choice.get("delta") or {}).get("content") or ""
    elif "message" in choice:  # chat, not streamed
        text = (choice.get("message") or {}).get("content") or ""
    else:  # completions
        text = choice.get("text") or ""
    return text, list(choice.get("token_ids") or [])


def client_session(concurrency: int = 0):
    """An aiohttp session for driving a server: one TCP connection per request (``force_close``).

    With keep-alive, a pooled connection the server closes on its idle timeout (uvicorn: 5 s) can be reused at the
    same instant and the request fails with ``ServerDisconnectedError`` before the server ever read it (a known
    HTTP/1.1 race, aiohttp#3609): a soak would count it as lost. A fresh connection per request leaves "lost"
    meaning the server dropped it. A connect + close on 127.0.0.1 measured 0.17 ms here (2 CPU cores)."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency, force_close=True))


async def request(session, url: str, payload: dict, abort_after_chunks: int | None = None,
                  timeout_s: float = 300.0) -> Reply:
    """POST ``payload`` to ``url``; stream it when ``payload["stream"]``. With ``abort_after_chunks`` the client
    closes the connection after that many chunks (a client abort mid-stream). Never raises for HTTP or I/O errors:
    they land in ``reply.status`` / ``reply.error``."""
    import aiohttp

    reply = Reply()
    reply.started = time.perf_counter()
    try:
        async with session.post(url, json=payload, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            reply.status = resp.status
            if resp.status != 200:
                reply.body = await resp.text()
                return reply
            if not payload.get("stream"):
                reply.body = await resp.json()
                choice = reply.body["choices"][0]
                reply.text, reply.token_ids = _choice_delta(choice)
                reply.finish_reason = choice.get("finish_reason")
                reply.usage = reply.body.get("usage")
                reply.first_token_s = time.perf_counter() - reply.started
                return reply
            last = None
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("error"):
                    reply.error = json.dumps(event["error"])[:500]
                    break
                if event.get("usage"):
                    reply.usage = event["usage"]
                for choice in event.get("choices") or []:
                    text, ids = _choice_delta(choice)
                    if text or ids:
                        now = time.perf_counter()
                        if last is None:
                            reply.first_token_s = now - reply.started
                        else:
                            reply.chunk_gaps_s.append(now - last)
                        last = now
                        reply.text += text
                        reply.token_ids += ids
                        reply.chunks += 1
                    if choice.get("finish_reason"):
                        reply.finish_reason = choice["finish_reason"]
                if abort_after_chunks is not None and reply.chunks >= abort_after_chunks:
                    reply.aborted = True
                    resp.close()
                    break
    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, json.JSONDecodeError, KeyError, IndexError) as e:
        reply.error = f"{type(e).__name__}: {e}"
    finally:
        reply.elapsed_s = time.perf_counter() - reply.started
    return reply


def percentiles(values: Sequence[float], qs: Sequence[int] = (50, 90, 99)) -> dict[str, float | None]:
    import numpy as np

    if not values:
        return {f"p{q}": None for q in qs}
    arr = np.asarray(values, dtype=np.float64)
    return {f"p{q}": float(np.percentile(arr, q)) for q in qs}
