"""Leader and followers: one process per rank, the step's host metadata handed out each step.

The leader (rank 0) owns the scheduler and sampler. It spawns ranks 1..world-1 as followers on this host,
each told its rank at spawn (DEEPINFER_LOCAL_RANK), and publishes every step's `StepInputs` into a shared
memory record, ringing one doorbell byte per follower through a pipe. Followers run the same graphs on
their own weights and KV shard, skip the sampler, and acknowledge each record once read. Across hosts
(torchrun) the same record goes over a torch.distributed broadcast instead.

Failure handling: a follower that exits is noticed by a monitor thread within a fraction of a second, one
that stops acknowledging within `ack_timeout`; either way the leader raises RankFailure naming the rank,
kills the other followers and never leaves orphans (followers also die with their parent).
"""

from __future__ import annotations

import ctypes
import math
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import torch

from ..common.errors import OptionError, RankFailure
from ..common.manifest import DECODE, PREFILL, Manifest
from .model_runner import StepInputs

_KINDS = {DECODE: 0, PREFILL: 1}
_STOP = 2
_HEADER = 8   # kind, T, C, R, B, L, num_logits, step


def record_size(m: Manifest) -> int:
    """int64 slots of the largest step record this artifact can produce."""
    cc = m.compile
    T = max(cc.decode_buckets + cc.prefill_buckets)
    B = cc.context_limit // cc.block_size
    return _HEADER + 4 * T + T * B + T


def _part_sizes(T: int, R: int, B: int, L: int) -> tuple[int, ...]:
    """Slots of a record's arrays after its header, in order: token ids, positions, slots, block tables [R, B],
    logit indices, context starts."""
    return T, T, T, R * B, L, T


def record_length(header: np.ndarray) -> int:
    """int64 slots a step record fills, from its header (what the step needs, not the largest record)."""
    kind, T, _, R, B, L = (int(x) for x in header[:6])
    return _HEADER if kind == _STOP else _HEADER + sum(_part_sizes(T, R, B, L))


def pack(si: StepInputs | None, step: int, out: np.ndarray) -> None:
    if si is None:
        out[:_HEADER] = [_STOP, 0, 0, 0, 0, 0, 0, step]
        return
    T = si.tokens
    R, B = si.block_tables.shape
    L = len(si.logit_indices)
    out[:_HEADER] = [_KINDS[si.kind], T, si.context, R, B, L, si.num_logits, step]
    o = _HEADER
    for arr in (si.token_ids, si.positions, si.slot_mapping, si.block_tables.reshape(-1), si.logit_indices,
                si.context_starts):
        out[o:o + arr.size] = arr
        o += arr.size


def unpack(buf: np.ndarray) -> tuple[StepInputs | None, int]:
    kind, T, C, R, B, L, n_logits, step = (int(x) for x in buf[:_HEADER])
    if kind == _STOP:
        return None, step
    o = _HEADER
    parts = []
    for size in _part_sizes(T, R, B, L):
        parts.append(buf[o:o + size].copy())
        o += size
    tok, pos, slots, tables, logit_idx, starts = parts
    return StepInputs("decode" if kind == 0 else "prefill", T, C, tok, pos, slots, tables.reshape(R, B),
                      logit_idx, n_logits, starts), step


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(rank: int, world: int, device: str, addr: str, port: int, timeout_s: float) -> None:
    import torch.distributed as dist
    dist.init_process_group(process_group_backend(device), init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def collective_timeout_env(default: float | None) -> float | None:
    """DEEPINFER_COLLECTIVE_TIMEOUT in seconds (`default` where unset); anything but a positive number is refused
    naming the variable (it reached float() bare)."""
    raw = os.environ.get("DEEPINFER_COLLECTIVE_TIMEOUT", "")
    if not raw.strip():
        return default
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not (math.isfinite(seconds) and seconds > 0):
        raise OptionError(f"DEEPINFER_COLLECTIVE_TIMEOUT={raw!r} is not a positive number of seconds")
    return seconds


def join_process_group(followers: "Followers", device: str, timeout_s: float) -> None:
    """The leader's init_process_group, watching the followers meanwhile: one that dies before it joins fails the
    start at once, naming its rank (the rendezvous alone waits out its timeout, then blames the store). The
    abandoned rendezvous thread waits out its timeout; a failed start leaves torch.distributed unable to start
    another group in this process either way (its group counter has moved on), so the process is done."""
    done = threading.Event()
    error: list[BaseException] = []

    def join() -> None:
        try:
            init_process_group(0, followers.world, device, "127.0.0.1", followers.port, timeout_s)
        except BaseException as e:     # noqa: BLE001  handed to the caller
            error.append(e)
        finally:
            done.set()

    threading.Thread(target=join, name="deepinfer-rendezvous", daemon=True).start()
    while not done.wait(0.1):
        if followers.failure is not None:
            raise followers.failure
    if error:
        raise followers.failure or error[0]


def process_group_backend(device: str) -> str:
    """NCCL for the graphs' collectives on GPUs, and gloo beside it for CPU tensors (torchrun's step record,
    a CPU buffer broadcast each step: NCCL alone has no CPU backend and refused it)."""
    return "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"


def claim_device(rank: int, world: int, device: str) -> str:
    """A follower's share of the machine: its GPU, or a slice of the CPU cores and as many threads."""
    if device.startswith("cuda"):
        torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
        return f"cuda:{torch.cuda.current_device()}"
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    per = max(1, len(cores) // world)
    mine = cores[(rank * per) % len(cores):][:per] or cores[:1]
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))
    return "cpu"


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the leader dies, so no follower outlives it."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except OSError:
        pass


# -- leader side -------------------------------------------------------------------------------------
class Followers:
    """Spawns, feeds and watches ranks 1..world-1 on this host."""

    def __init__(self, artifact: Path, manifest: Manifest, device: str = "cpu", ack_timeout: float = 60.0,
                 collective_timeout: float = 60.0):
        self.world = manifest.layout.world
        self.ack_timeout = ack_timeout
        self.step = 0
        self.failure: RankFailure | None = None
        n = record_size(manifest)
        self.shm = shared_memory.SharedMemory(create=True, size=n * 8)
        self.record = np.ndarray((n,), dtype=np.int64, buffer=self.shm.buf)
        self.port = free_port()
        self.procs: dict[int, subprocess.Popen] = {}
        self.bells: dict[int, int] = {}
        self.acks: dict[int, int] = {}
        for rank in range(1, self.world):
            bell_r, bell_w = os.pipe()
            ack_r, ack_w = os.pipe()
            env = {**os.environ, "DEEPINFER_LOCAL_RANK": str(rank), "DEEPINFER_WORLD_SIZE": str(self.world),
                   "DEEPINFER_ARTIFACT": str(artifact), "DEEPINFER_SHM": self.shm.name,
                   "DEEPINFER_DOORBELL_FD": str(bell_r), "DEEPINFER_ACK_FD": str(ack_w),
                   "DEEPINFER_MASTER": f"127.0.0.1:{self.port}", "DEEPINFER_DEVICE": device,
                   "DEEPINFER_COLLECTIVE_TIMEOUT": str(collective_timeout)}
            self.procs[rank] = subprocess.Popen(
                [sys.executable, "-c", "from deepinfer.runtime.distributed import follower_main; follower_main()"],
                env=env, pass_fds=(bell_r, ack_w))
            os.close(bell_r)
            os.close(ack_w)
            self.bells[rank], self.acks[rank] = bell_w, ack_r
        self._monitor = threading.Thread(target=self._watch, name="deepinfer-followers", daemon=True)
        self._monitor.start()

    def _watch(self) -> None:
        while self.failure is None:
            for rank, p in self.procs.items():
                code = p.poll()
                if code is not None:
                    self._fail(RankFailure(f"follower rank {rank} exited with code {code}"
                                           f"{' (' + signal.Signals(-code).name + ')' if code < 0 else ''}"))
                    return
            time.sleep(0.1)

    def _fail(self, err: RankFailure) -> None:
        if self.failure is None:
            self.failure = err
            self.kill()

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Each follower writes one byte once its weights and graphs are loaded."""
        self._wait_acks(timeout, "load its artifact")

    def _wait_acks(self, timeout: float, what: str) -> None:
        pending = dict(self.acks)
        deadline = time.monotonic() + timeout
        while pending:
            if self.failure is not None:
                raise self.failure
            ready, _, _ = select.select(list(pending.values()), [], [], min(0.2, max(0.0, deadline - time.monotonic())))
            for rank, fd in list(pending.items()):
                if fd in ready:
                    if os.read(fd, 1) == b"":
                        self._fail(RankFailure(f"follower rank {rank} closed its channel (it died)"))
                        raise self.failure
                    del pending[rank]
            if pending and time.monotonic() > deadline:
                self._fail(RankFailure(f"follower rank(s) {sorted(pending)} did not {what} within {timeout:.0f}s"))
                raise self.failure

    def publish(self, si: StepInputs | None) -> None:
        """Hand a step to every follower (None: stop). Raises RankFailure if a rank is gone."""
        if self.failure is not None:
            raise self.failure
        self.step += 1
        pack(si, self.step, self.record)
        for rank, fd in self.bells.items():
            try:
                os.write(fd, b"s")
            except BrokenPipeError:
                self._fail(RankFailure(f"follower rank {rank} is gone (its doorbell pipe is closed)"))
                raise self.failure from None
        # Followers acknowledge reading the record before we may overwrite it with the next step.
        self._wait_acks(self.ack_timeout, f"take step {self.step}")

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def close(self) -> None:
        if self.failure is None and all(p.poll() is None for p in self.procs.values()):
            try:
                self.publish(None)
            except RankFailure:
                pass
            for p in self.procs.values():
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        self.failure = self.failure or RankFailure("followers stopped")
        self.kill()
        for fd in list(self.bells.values()) + list(self.acks.values()):
            try:
                os.close(fd)
            except OSError:
                pass
        self.bells.clear()
        self.acks.clear()
        try:
            self.shm.close()
            self.shm.unlink()
        except FileNotFoundError:
            pass

    def kill(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass


# How long a torchrun follower waits for the leader's next step: a server may sit idle for days. (A rank that dies is
# torchrun's to notice: its agent stops the others.)
IDLE_WAIT = timedelta(days=365)


class BroadcastChannel:
    """torchrun / multi-host: the leader broadcasts each step record from rank 0, over a gloo group of its own whose
    timeout is IDLE_WAIT: on the default group's (torch's 30 minutes, or DEEPINFER_COLLECTIVE_TIMEOUT), a follower
    waiting through an idle half hour timed out and took the job down. Every rank makes it, in the same order."""

    def __init__(self, manifest: Manifest):
        import torch.distributed as dist
        self.group = dist.new_group(backend="gloo", timeout=IDLE_WAIT)
        self.buf = torch.zeros(record_size(manifest), dtype=torch.int64)
        self.step = 0

    def publish(self, si: StepInputs | None) -> None:
        self.step += 1
        pack(si, self.step, self.buf.numpy())
        self._transfer()

    def receive(self) -> StepInputs | None:
        self._transfer()
        return unpack(self.buf.numpy())[0]

    def _transfer(self) -> None:
        """The header, then only the slots this step fills: the buffer holds the largest record the artifact can
        make (a 671B artifact's: tens of MB of block tables), a decode step's is a few KB."""
        import torch.distributed as dist
        dist.broadcast(self.buf[:_HEADER], src=0, group=self.group)
        n = record_length(self.buf.numpy())
        if n > _HEADER:
            dist.broadcast(self.buf[_HEADER:n], src=0, group=self.group)

    def check(self) -> None:
        pass

    def close(self) -> None:
        self.publish(None)


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """The leader owns the segment; without this, Python's resource tracker would unlink it when a follower exits."""
    try:
        from multiprocessing import resource_tracker
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:
        pass


# -- follower side -----------------------------------------------------------------------------------
def run_follower(art_path: Path, rank: int, world: int, device: str, receive, ack=None) -> None:
    """Load this rank's graphs and weights, then run every step the leader publishes until told to stop."""
    from .artifact import open_artifact
    from .engine import freeze_loaded_objects, make_runner
    art = open_artifact(art_path)
    if art.manifest.layout.world != world:
        raise RankFailure(f"rank {rank}: artifact world is {art.manifest.layout.world}, launched with {world}")
    runner = make_runner(art, rank=rank, device=device)
    freeze_loaded_objects()
    if ack is not None:
        ack()
    while True:
        si = receive()
        if si is None:
            return
        runner.run(si)


def exit_without_teardown(code: int = 0) -> None:
    """End a rank's process once its work is done: flush, then leave without the process group's, the
    interpreter's and C++ static teardown. Under torchrun, tearing down gloo on two ranks that finish together
    sometimes aborted one of them at exit ("terminate called without an active exception", SIGABRT: 2 of 4 CI
    runs on 2 loaded cores; with only the follower skipping it, the leader then aborted in 2 of 6 isolated
    runs), failing the job though every step had run and every output was written. Nothing is left to release
    that the OS does not: the leader owns the shared memory, results are flushed first."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def follower_main() -> None:
    """Entry point of a spawned follower (environment set by `Followers`)."""
    _die_with_parent()
    # Ctrl-C and a service manager's SIGTERM reach the whole process group: the leader drains its requests and
    # then stops the followers (a STOP record, a closed doorbell, or its death); a follower that died at the
    # signal failed every request at once instead
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank = int(os.environ["DEEPINFER_LOCAL_RANK"])
    world = int(os.environ["DEEPINFER_WORLD_SIZE"])
    bell = int(os.environ["DEEPINFER_DOORBELL_FD"])
    ack_fd = int(os.environ["DEEPINFER_ACK_FD"])
    addr, port = os.environ["DEEPINFER_MASTER"].rsplit(":", 1)
    device = claim_device(rank, world, os.environ.get("DEEPINFER_DEVICE", "cpu"))
    shm = shared_memory.SharedMemory(name=os.environ["DEEPINFER_SHM"])
    _untrack(shm)
    record = np.ndarray((shm.size // 8,), dtype=np.int64, buffer=shm.buf)
    init_process_group(rank, world, device, addr, int(port), collective_timeout_env(60.0))

    def ack() -> None:
        os.write(ack_fd, b"a")

    def receive() -> StepInputs | None:
        if os.read(bell, 1) == b"":       # the leader is gone
            return None
        si, _ = unpack(record)
        ack()
        return si

    try:
        run_follower(Path(os.environ["DEEPINFER_ARTIFACT"]), rank, world, device, receive, ack)
    except Exception as e:
        print(f"deepinfer follower rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        exit_without_teardown(1)
    finally:
        shm.close()
    exit_without_teardown(0)
