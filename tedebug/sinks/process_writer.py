"""`ProcessWriter`: tedebug's statistics files written by a separate process, not by the training process.

Why: evaluating, formatting and writing a step's statistics is pure host work: about 1.5 µs per value
on a GPU host, 8-12 µs per logged tensor of eight statistics.  On a writer thread it still holds the training
process's GIL, so a training loop bound by its host's Python pays it in full; a process of its own runs on another
core.  The training process sends the step's merged rows in one pipe write; the writer process runs the final
formulas (`tedebug.sinks.process_wire`).

Which sinks: those that say how to make their twin in another process (`Sink.writer_process_spec`: tedebug's text
statistics file and JSONL file, and a TensorBoard sink that owns its writer).  The twin opens the same file for
appending (the TensorBoard twin an event file of its own in the same directory); the sink object in the training
process is not given the statistics, but what the training script logs through it (`Sink.writer_process_notes`:
a TensorBoard sink's user scalars) travels to the twin with each job.  Every other sink is written as in
background mode (writer thread or caller's thread), in the same order of records.

Protocol (`tedebug.sinks.process_wire`, `tedebug.sinks.writer_child`): `add` starts the process on first use and has
it create each sink (a failure there is returned: the caller then writes that sink itself).  `submit(sinks, chunks)`
first waits until the process has written the previous job (one job in flight: memory stays bounded, and a failure
is known one step later), then sends the chunks and returns.  `wait()` waits for every job, `stop()` also closes
the sinks and ends the process.  Errors come back as `BackgroundSinkError`s from `take_error()`, naming the sink
(its errno kept), as from the writer thread; with ``skip_failed`` a sink that failed once is not written again.

What is on disk when (background_logging="process"): when `debug_api.step()` returns for iteration N, iteration
N-2 (and everything before it) is on disk and iteration N-1 is in the writer process, which writes it whatever
happens to the training process afterwards (a crash, SIGKILL, ``os._exit``: it finishes what it received, then
ends); the last iterations are handed over and written by `end_debug()` or the atexit handler, as in background
mode.  If the writer process itself dies,
the statistics it had not yet written are lost: each of its sinks then fails once (reported and stopped with
``on_sink_error="warn"``, naming the iterations handed over and not written), and training goes on.

After ``os.fork()`` the child starts a writer process of its own when it first writes (the parent's stays the
parent's).
"""

from __future__ import annotations

import builtins
import os
import select
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from tedebug.sinks.background import BackgroundSinkError, iterations_text, merged_errors, sink_failure_error
from tedebug.sinks.process_wire import ChunkEncoder, MessageReader, pack, send, write

#: seconds between two checks that the writer process is alive while the training process waits for it
_LIVENESS_POLL_S = 0.5
_WHERE = "tedebug's statistics writer process"
#: (module, class name, keyword arguments): how the writer process makes a sink (`Sink.writer_process_spec`)
Spec = Tuple[str, str, Dict[str, Any]]


class WriterProcessGone(RuntimeError):
    """The writer process ended before it wrote what it was given."""


class ProcessWriter:
    """The training process's end of one writer process (see the module docstring)."""

    def __init__(self, *, skip_failed: bool = False) -> None:
        self.skip_failed = skip_failed
        #: index -> (the sink object in this process, its spec), in the order they were added
        self._sinks: Dict[int, Tuple[Any, Spec]] = {}
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._process: Optional[subprocess.Popen] = None
        self._to_child = self._from_child = -1
        self._reader = MessageReader()
        self._encoder = ChunkEncoder()
        self._next_job = 0
        self._in_flight: Dict[int, str] = {}  # job id -> its iterations (text), until the process answers
        self._errors: List[BackgroundSinkError] = []
        self._gone: Optional[str] = None  # why the process is no longer usable

    # ------------------------------------------------------------------------------------------- caller side
    def add(self, sink: Any, spec: Spec) -> Optional[str]:
        """Have the writer process write `sink` (re-created there from `spec`); None, or why it cannot."""
        self._check_fork()
        if os.name != "posix":
            return "a writer process needs a POSIX system (its pipes are waited on with select)"
        index = len(self._sinks)
        try:
            self._ensure_started()
            answer = self._request(("sink", index) + tuple(spec), "sink")
        except Exception as exc:  # noqa: BLE001 - any reason it cannot start is answered: the caller writes the sink
            return f"{type(exc).__name__}: {exc}"
        if answer[2] is not None:
            return answer[2]
        self._sinks[index] = (sink, spec)
        return None

    def submit(self, sinks: Sequence[Any], chunks: List[Any]) -> None:
        """Wait until the previous job is written, then send `chunks` for `sinks` (sinks `add` accepted)."""
        self._check_fork()
        self._collect(wait_all=True)
        indices = [index for index, (sink, _) in self._sinks.items() if any(sink is s for s in sinks)]
        notes = {}  # taken even when they cannot be sent: nothing piles up in the sinks
        for index in indices:
            taken = self._sinks[index][0].writer_process_notes()
            if taken:
                notes[index] = taken
        if self._gone is not None:
            if not self.skip_failed:  # "raise": every batch that cannot be written is an error
                self._fail_all(self._gone, iterations_text(chunks), sinks)
            return
        job = self._next_job
        try:
            encoded: List[Any] = []
            for chunk in chunks:
                encoded += self._encoder.encode(chunk)
            message = pack(("job", job, indices, encoded, notes))
        except Exception as exc:  # noqa: BLE001 - e.g. a value that cannot be pickled: that batch is lost, reported
            error = BackgroundSinkError(
                f"{_WHERE} could not be given the statistics of iteration(s) {iterations_text(chunks)}: "
                f"{type(exc).__name__}: {exc}",
                None,
            )
            error.__cause__ = exc
            self._errors.append(error)
            self._encoder.forget_layout()  # the process may not have the layout this encoding assumed
            return
        self._next_job += 1
        self._in_flight[job] = iterations_text(chunks)
        try:
            self._ensure_started()
            write(self._to_child, message)
        except (OSError, WriterProcessGone):
            self._collect(wait_all=True)  # the process is gone: report what it had not written

    def wait(self) -> None:
        """Block until the writer process has written every job sent (errors kept for `take_error`)."""
        self._check_fork()
        self._collect(wait_all=True)

    def take_error(self) -> Optional[BackgroundSinkError]:
        """The first error not yet taken (later ones attached as notes), or None."""
        errors, self._errors = self._errors, []
        return merged_errors(errors)

    def stop(self) -> None:
        """Wait for every job, have the process close its sinks, and end it."""
        self._check_fork()
        if self._process is None:
            return
        try:
            self._collect(wait_all=True)
            if self._gone is None:
                send(self._to_child, ("exit",))
                answer = self._answer("closed")
                self._failed(answer[1], "at close")
        except (OSError, WriterProcessGone):
            pass  # already reported by `_collect`, or nothing was left to write
        finally:
            process, self._process = self._process, None
            for fd in (self._to_child, self._from_child):
                os.close(fd)
            self._to_child = self._from_child = -1
            process.wait()

    # ------------------------------------------------------------------------------------------- internals
    def _check_fork(self) -> None:
        if os.getpid() != self._pid:  # a forked child: the parent's process and pipes are the parent's
            for fd in (self._to_child, self._from_child):
                if fd >= 0:
                    os.close(fd)
            self._reset()

    def _ensure_started(self) -> None:
        if self._process is not None:
            if self._gone is not None:
                raise WriterProcessGone(self._gone)
            return
        import tedebug

        root = os.path.dirname(os.path.dirname(os.path.abspath(tedebug.__file__)))
        child_read, to_child = os.pipe()
        from_child, child_write = os.pipe()
        code = (
            f"import sys; sys.path.insert(0, {root!r}); from tedebug.sinks.writer_child import main; "
            f"main({child_read}, {child_write}, {os.getpid()}, {self.skip_failed!r})"
        )
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", code],
                pass_fds=(child_read, child_write),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
        except BaseException:
            for fd in (to_child, from_child):
                os.close(fd)
            raise
        finally:
            os.close(child_read)
            os.close(child_write)
        self._to_child, self._from_child = to_child, from_child
        for index, (_, spec) in self._sinks.items():  # a restart after fork: the same sinks again, appending
            self._request(("sink", index) + tuple(spec), "sink")

    def _request(self, message: Tuple[Any, ...], kind: str) -> Tuple[Any, ...]:
        send(self._to_child, message)
        return self._answer(kind)

    def _answer(self, kind: str) -> Tuple[Any, ...]:
        """The next answer of `kind`, the jobs' answers read on the way."""
        while True:
            for message in self._read(block=True):
                if message[0] == kind:
                    return message
                self._done(message)

    def _collect(self, wait_all: bool) -> None:
        """Read the answers of the jobs in flight (all of them with `wait_all`, else those already there)."""
        if self._process is None or self._gone is not None:
            return
        try:
            while self._in_flight:
                for message in self._read(block=wait_all):
                    self._done(message)
                if not wait_all:
                    return
        except (OSError, WriterProcessGone) as exc:
            self._gone = f"{_WHERE} ended (exit code {self._process.poll()}) before writing what it was given ({exc})"
            lost = ", ".join(self._in_flight.values()) or "none"
            self._in_flight.clear()
            self._fail_all(self._gone, lost, [sink for sink, _ in self._sinks.values()])

    def _read(self, block: bool) -> List[Tuple[Any, ...]]:
        process = self._process
        assert process is not None
        while True:
            ready, _, _ = select.select([self._from_child], [], [], _LIVENESS_POLL_S if block else 0.0)
            if ready:
                data = os.read(self._from_child, 1 << 16)
                if not data:
                    raise WriterProcessGone("its pipe closed")
                self._reader.feed(data)
                messages = self._reader.messages()
                if messages or not block:
                    return messages
            elif not block:
                return []
            elif process.poll() is not None:
                raise WriterProcessGone(f"exit code {process.returncode}")

    def _done(self, message: Tuple[Any, ...]) -> None:
        if message[0] != "done":
            raise WriterProcessGone(f"an unexpected answer {message[0]!r}")
        _, job, failures, unbuilt = message
        iterations = self._in_flight.pop(job, "?")
        for problem in unbuilt:  # reported as the writer thread reports a batch it could not build
            self._errors.append(
                BackgroundSinkError(
                    f"{_WHERE} could not build a batch of statistics of iteration(s) {iterations}: {problem}", None
                )
            )
        self._failed(failures, iterations)

    def _failed(self, failures: List[Tuple[Any, ...]], iterations: str) -> None:
        """Keep the error of the failures the process reported (sinks named by their objects in this process)."""
        known = [(self._sinks[index][0], _rebuilt(*rest)) for index, *rest in failures if index in self._sinks]
        if known:
            self._errors.append(sink_failure_error(known, iterations, _WHERE))

    def _fail_all(self, reason: str, iterations: str, sinks: Sequence[Any]) -> None:
        failures = [(sink, WriterProcessGone(reason)) for sink in sinks]
        if failures:
            self._errors.append(sink_failure_error(failures, iterations, _WHERE))


def _rebuilt(kind: str, message: str, code: Optional[int], strerror: Optional[str]) -> BaseException:
    """The exception a sink raised in the writer process, as this process can have it: an OSError with its errno
    (its subclass, as Python picks it: PermissionError, ...), a built-in exception type with its message, else a
    RuntimeError naming the original type."""
    if code is not None:
        return OSError(code, strerror or message)
    builtin = getattr(builtins, kind, None)
    if isinstance(builtin, type) and issubclass(builtin, Exception) and not issubclass(builtin, OSError):
        try:
            return builtin(message)
        except Exception:  # noqa: BLE001 - a type whose constructor wants more: named in a RuntimeError instead
            pass
    return RuntimeError(f"{kind}: {message}")


__all__ = ["ProcessWriter", "Spec", "WriterProcessGone"]
