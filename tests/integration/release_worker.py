"""One rank of test_release: a real Trainer (gloo, over a FileStore), driven as its agent
drives it, whose peer stops answering inside an average.

Rank 1 forms the session and then hangs (it never enters the collective: a SIGSTOPped or
stuck process). Rank 0 gets SyncNow and blocks in the all-reduce; once it is in there, it
is told what its agent does on a DeclareDead of rank 1 (the message into the inbox, then
``release_collective``). It must answer SyncAck{failed} at once, not at the collective
timeout (60 s here), keep its parameters, and average again in a new session of one.

``forming`` instead of a rank: one rank alone, told to form a session of two whose other
member died before it wrote its address. Its agent hears the DeclareDead while it waits in
the store; the forming must end at once (not at the store's 300 s timeout), and a session
of one must then average.

Usage: python release_worker.py RANK|forming DIR   (rank 0 writes DIR/result.json)
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from worker_harness import run_config, spec

from ddpbus.codecs import messages as m
from ddpbus.worker_agent.trainer import GRAVEYARD, Trainer, TrainerSettings

COLLECTIVE_TIMEOUT_S = 60.0


def until(what: str, cond: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.001)  # poll interval of a deadline-bound wait


def waiting_in_all_reduce(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside ``averaging._all_reduce``'s wait for its collectives."""
    frame = sys._current_frames().get(thread.ident or -1)
    innermost = frame
    while frame is not None:
        if frame.f_code.co_name == "_all_reduce" and frame.f_code.co_filename.endswith(
                "averaging.py"):
            return innermost is not frame and innermost.f_code.co_name == "wait"
        frame = frame.f_back
    return False


def waiting_in_rendezvous(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside a forming session's wait for a member's address."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == "wait" and frame.f_code.co_filename.endswith(
                "rendezvous.py"):
            return True
        frame = frame.f_back
    return False


def forming(where: Path) -> None:
    sent: list[m.Message] = []
    lock = threading.Lock()

    def outbox(msg: m.Message, _durable: bool) -> None:
        with lock:
            sent.append(msg)

    trainer = Trainer(spec(), TrainerSettings(
        rank=0, device=torch.device("cpu"),
        store_factory=lambda: dist.FileStore(str(where / "store"), -1)), outbox)
    trainer.configure(replace(run_config(), backend=m.Backend.GLOO,
                              collective_timeout_s=COLLECTIVE_TIMEOUT_S), world_size=2)
    trainer.start()
    trainer.inbox.put(m.NewNcclSession(uid_bytes=b"\x03" * m.NCCL_ID_BYTES, new_rank=0,
                                       new_world_size=2, initial=True))
    until("rank 0 waiting for its peer's address", lambda: waiting_in_rendezvous(trainer))
    declared = time.perf_counter()
    trainer.inbox.put(m.DeclareDead(rank=1))  # what the agent does, in this order
    trainer.release_collective(1)
    until("the forming abandoned", lambda: trainer.abandoned_sessions == 1,
          timeout=COLLECTIVE_TIMEOUT_S)
    released_s = time.perf_counter() - declared
    sessions = trainer.sessions
    trainer.inbox.put(m.NewNcclSession(uid_bytes=b"\x04" * m.NCCL_ID_BYTES, new_rank=0,
                                       new_world_size=1))
    until("the session of one", lambda: trainer.sessions == 1)
    trainer.inbox.put(m.SyncNow())

    def acks() -> list[m.SyncAck]:
        with lock:
            return [x for x in sent if isinstance(x, m.SyncAck)]

    until("the SyncAck", acks)
    (where / "result.json").write_text(json.dumps({
        "released_s": released_s, "sessions_after_abandon": sessions,
        "ack_failed": acks()[0].failed}))
    trainer.halt("test over", clean=True)
    trainer.join(timeout=30)


def main() -> None:
    if sys.argv[1] == "forming":
        forming(Path(sys.argv[2]))
        return
    rank, where = int(sys.argv[1]), Path(sys.argv[2])
    sent: list[m.Message] = []
    lock = threading.Lock()

    def outbox(msg: m.Message, _durable: bool) -> None:
        with lock:
            sent.append(msg)

    # tests/gpu runs it on CUDA too: RELEASE_DEVICE=cuda (GPU rank % count), and
    # RELEASE_BACKEND=nccl given a GPU per rank
    device = torch.device("cuda", rank % torch.cuda.device_count()) \
        if os.environ.get("RELEASE_DEVICE") == "cuda" else torch.device("cpu")
    backend = m.Backend(os.environ.get("RELEASE_BACKEND", m.Backend.GLOO.value))
    trainer = Trainer(spec(), TrainerSettings(
        rank=rank, device=device,
        store_factory=lambda: dist.FileStore(str(where / "store"), -1)), outbox)
    trainer.configure(replace(run_config(), backend=backend,
                              collective_timeout_s=COLLECTIVE_TIMEOUT_S), world_size=2)
    trainer.start()
    trainer.inbox.put(m.NewNcclSession(uid_bytes=b"\x01" * m.NCCL_ID_BYTES, new_rank=rank,
                                       new_world_size=2, initial=True))
    until("the session of two", lambda: trainer.sessions == 1)
    if rank == 1:
        threading.Event().wait()  # hung: never enters the all-reduce; the test kills it
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.inbox.put(m.SyncNow())
    # the DeclareDead must find rank 0 blocked in the collective (its all-reduces issued,
    # waiting on their future), not before it: read off the training thread's own stack
    until("rank 0 blocked in the all-reduce", lambda: waiting_in_all_reduce(trainer))
    declared = time.perf_counter()
    trainer.inbox.put(m.DeclareDead(rank=1))  # what the agent does, in this order
    trainer.release_collective(1)

    def acks() -> list[m.SyncAck]:
        with lock:
            return [x for x in sent if isinstance(x, m.SyncAck)]

    until("SyncAck{failed}", acks, timeout=COLLECTIVE_TIMEOUT_S + 10)
    released_s = time.perf_counter() - declared
    kept = all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(),
                                                 strict=True))
    trainer.inbox.put(m.NewNcclSession(uid_bytes=b"\x02" * m.NCCL_ID_BYTES, new_rank=0,
                                       new_world_size=1))
    until("the session of one", lambda: trainer.sessions == 2)
    trainer.inbox.put(m.SyncNow())
    until("the second SyncAck", lambda: len(acks()) == 2)
    first, second = acks()
    (where / "result.json").write_text(json.dumps({
        "released_s": released_s, "first_failed": first.failed,
        "second_failed": second.failed, "parameters_kept": kept,
        "released": trainer.released, "graveyard": len(GRAVEYARD)}))
    # (returning frees the trainer, not the released group: trainer.GRAVEYARD holds it)
    trainer.halt("test over", clean=True)
    trainer.join(timeout=30)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # skip teardown: the released collective's gloo threads still wait
