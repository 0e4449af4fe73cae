"""The statistics writer process: the loop that writes tedebug's file sinks for one training process.

Started by `tedebug.sinks.process_writer.ProcessWriter` (``python -c``; it imports the sinks, numpy and the
standard library, never torch), it reads messages (`tedebug.sinks.process_wire`) from its pipe and answers each:

* ``("sink", index, module, class name, kwargs)``: create the sink ``module.class(**kwargs)``; answer
  ``("sink", index, None)`` or the error's text;
* ``("job", job id, sink indices, encoded chunks, notes)``: decode the chunks and run the final formulas of their
  batches, give each listed sink its notes (`Sink.apply_writer_process_notes`: e.g. the user scalars of a
  TensorBoard sink) and every chunk (`Sink.log_scalars`), then flush it, sink by sink in order, as the
  writer thread does; answer ``("done", job id, failures, unbuilt)``: one ``(index, kind, message, errno,
  strerror)`` per sink that raised, and the error of each batch that could not be decoded or evaluated (that batch
  is not written; the others are).  With ``skip_failed`` a sink that failed once is not called again;
* ``("exit",)``: close every sink, answer ``("closed", failures)`` and end.

It ends too when its pipe reaches end-of-file or its parent process is gone (checked every `PARENT_POLL_S`), after
writing every message it received whole and closing its sinks: a training process that is killed (SIGKILL,
``os._exit``, a fatal signal) loses none of the statistics it had handed over.  It ignores SIGINT and SIGTERM,
which a terminal or a job scheduler sends to the whole process group: it finishes when its parent does.  It runs
at the lowest priority (nice 19), so that, woken by the training process's message when no core is idle, it does
not run ahead of that process on its core (on the 2-core VM with both cores busy the pipe write of a step's batch
took 1.6 ms at the default priority, the time of writing the whole batch, and 0.03 ms at nice 19).
"""

from __future__ import annotations

import importlib
import os
import select
import signal
from typing import Any, Dict, List, Optional, Set, Tuple

from tedebug.sinks.batch import ScalarBatch
from tedebug.sinks.process_wire import ChunkDecoder, MessageReader, send

#: seconds between two checks that the parent process still exists, while no message arrives
PARENT_POLL_S = 0.5

#: a sink's failure as it travels: (index, exception type name, message, errno or None, strerror or None)
Failure = Tuple[int, str, str, Optional[int], Optional[str]]


def describe(index: int, exc: BaseException) -> Failure:
    code = getattr(exc, "errno", None)
    return (
        index,
        type(exc).__name__,
        str(exc),
        code if isinstance(code, int) else None,
        getattr(exc, "strerror", None) if isinstance(code, int) else None,
    )


class _Writer:
    def __init__(self, skip_failed: bool) -> None:
        self.skip_failed = skip_failed
        self.sinks: Dict[int, Any] = {}
        self.failed: Set[int] = set()
        self.decoder = ChunkDecoder()

    def handle(self, message: Tuple[Any, ...]) -> Tuple[Any, ...]:
        kind = message[0]
        if kind == "job":
            return self.job(*message[1:])
        if kind == "sink":
            _, index, module, name, kwargs = message
            try:
                self.sinks[index] = getattr(importlib.import_module(module), name)(**kwargs)
            except Exception as exc:  # noqa: BLE001 - answered: the training process writes this sink itself
                return ("sink", index, f"{type(exc).__name__}: {exc}")
            return ("sink", index, None)
        if kind == "exit":
            return ("closed", self.close())
        raise ValueError(f"tedebug's statistics writer process: unknown message {kind!r}")

    def job(
        self, job_id: int, indices: List[int], encoded: List[Tuple[Any, ...]], notes: Dict[int, List[Any]]
    ) -> Tuple[Any, ...]:
        failures: List[Failure] = []
        chunks = []
        unbuilt = []  # the batches that could not be decoded or whose final formulas raised: lost, reported
        for entry in encoded:
            try:
                chunk = self.decoder.decode(entry)
                if type(chunk) is ScalarBatch:
                    chunk.evaluate()  # the final formulas: an error is the batch's, not the first sink's
            except Exception as exc:  # noqa: BLE001 - reported to the training process; the other batches go on
                unbuilt.append(f"{type(exc).__name__}: {exc}")
                continue
            if chunk is not None:
                chunks.append(chunk)
        for index in indices:
            sink = self.sinks.get(index)
            if sink is None or index in self.failed:
                continue
            try:
                if index in notes:  # what the training script logged through the sink's object there
                    sink.apply_writer_process_notes(notes[index])
                for chunk in chunks:
                    sink.log_scalars(chunk)
                sink.flush()
            except Exception as exc:  # noqa: BLE001 - reported to the training process, which decides
                failures.append(describe(index, exc))
                if self.skip_failed:
                    self.failed.add(index)
        return ("done", job_id, failures, unbuilt)

    def close(self) -> List[Failure]:
        failures = []
        for index, sink in self.sinks.items():
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001 - reported; the other sinks are still closed
                if index not in self.failed:
                    failures.append(describe(index, exc))
        self.sinks = {}
        return failures


def main(read_fd: int, write_fd: int, parent_pid: int, skip_failed: bool) -> None:
    """The writer process's loop (see the module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.nice(19)  # the lowest priority: woken by a message, it never takes the training process's core
    except OSError:
        pass
    writer = _Writer(skip_failed)
    reader = MessageReader()
    answering = True
    try:
        while True:
            ready, _, _ = select.select([read_fd], [], [], PARENT_POLL_S)
            if not ready:
                if os.getppid() != parent_pid:
                    return  # the parent is gone: everything it sent whole has been written
                continue
            data = os.read(read_fd, 1 << 20)
            if not data:
                return  # end of file: the parent closed the pipe (or ended)
            reader.feed(data)
            for message in reader.messages():
                reply = writer.handle(message)
                if answering:
                    try:
                        send(write_fd, reply)
                    except OSError:  # the parent is gone: go on writing what it sent
                        answering = False
                if reply[0] == "closed":
                    return
    finally:
        writer.close()


__all__ = ["PARENT_POLL_S", "main"]
