"""What travels between a training process and its statistics writer process (`tedebug.sinks.process_writer`).

Framing: a message is one pickled tuple, preceded by its length (8 bytes, little-endian): `pack` makes it, `write`
writes it to a pipe (a loop of ``os.write``; `send` does both), and the other end reads it back whole with
`MessageReader`, or not at all: a message cut short by the death of its sender is dropped, never half-used.

Chunks (what `MetricLogger` queues for its writers: `ScalarBatch`es and lists of records) are encoded by
`ChunkEncoder` in the training process and decoded by `ChunkDecoder` in the writer process, so that the sinks there
receive what the writer thread's sinks receive, record for record and bit for bit:

* a `ScalarBatch` travels as its merged rows (one ``array('d')`` of bytes, or the bytes of the float64 array of a
  `ScalarBatch.from_packed` batch, the same bytes; and each row's length) and its
  iteration(s), plus, when its layout differs from the last batch's, the layout itself: per row the ``(name, stat)``
  pairs, the layer, the tensor and the source of its final formulas (`tedebug.compiled_formulas`), which the decoder
  compiles, so the formulas run in the writer process, on the same floats with the same code.  A batch whose rows
  do not all have such a source (emitters made by other code), or whose rows are not all floats, travels as its
  final values instead (``batch.values``, evaluated in the training process).  The decoder keeps one `Emitters`
  per layout row, so consecutive batches of one layout are again batches of the same layout for the sinks' caches;
* a list of records travels as it is, each value converted to a float (what every file sink writes of it; a 0-d
  CUDA tensor logged by user code waits for the GPU here, in the training process); a value that is no number
  travels as it is, for the sinks there to fail on it as they would in the training process.
"""

from __future__ import annotations

import os
import pickle
import struct
from array import array
from itertools import chain
from typing import Any, Dict, List, Optional, Sequence, Tuple

from tedebug.sinks.batch import Emitters, ScalarBatch
from tedebug.compiled_formulas import compiled, source_of

_HEADER = struct.Struct("<Q")


def pack(message: Tuple[Any, ...]) -> bytes:
    """`message` as it travels: its length, then its pickle."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


def write(fd: int, packed: bytes) -> None:
    """Write a `pack`ed message to the pipe `fd` (BrokenPipeError when the other end is gone)."""
    data = memoryview(packed)
    while data:
        written = os.write(fd, data)
        data = data[written:]


def send(fd: int, message: Tuple[Any, ...]) -> None:
    """`write(fd, pack(message))`."""
    write(fd, pack(message))


class MessageReader:
    """Reads whole messages from a pipe: `feed` what ``os.read`` returned, then take the complete messages."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def messages(self) -> List[Tuple[Any, ...]]:
        """The complete messages received so far, in order (a partial one stays buffered)."""
        out = []
        buffer = self._buffer
        start = 0
        while len(buffer) - start >= _HEADER.size:
            (length,) = _HEADER.unpack_from(buffer, start)
            end = start + _HEADER.size + length
            if len(buffer) < end:
                break
            out.append(pickle.loads(bytes(buffer[start + _HEADER.size : end])))
            start = end
        del buffer[:start]
        return out

    @property
    def partial(self) -> bool:
        """True while part of a message is buffered."""
        return bool(self._buffer)


# ------------------------------------------------------------------------------------------------ chunks
#: an encoded chunk: ("layout", id, rows) | ("batch", layout id, iteration, row iterations or None, values bytes) |
#: ("records", records)
Encoded = Tuple[Any, ...]


class ChunkEncoder:
    """Encodes the chunks of one training process's jobs (it remembers the last batch layout it sent)."""

    def __init__(self) -> None:
        self._layout: Optional[Tuple[Any, ...]] = None
        self._layout_id = 0
        self._rows_travel = False  # every row of the layout has the source of its formulas

    def forget_layout(self) -> None:
        """Send the layout again with the next batch (the last encoding may not have reached the decoder)."""
        self._layout = None

    def encode(self, chunk: Sequence[Any]) -> List[Encoded]:
        """The encoded form of `chunk` (a `ScalarBatch` or a sequence of records): one or two entries."""
        if type(chunk) is not ScalarBatch:
            return [("records", [(n, _number(v), it, layer, tensor, stat) for n, v, it, layer, tensor, stat in chunk])]
        out: List[Encoded] = []
        if not chunk.same_layout(self._layout):
            parts = chunk.row_parts()
            sources = [source_of(emitters.values_of) for emitters, _, _ in parts]
            self._layout = chunk.layout
            self._layout_id += 1
            self._rows_travel = None not in sources
            rows = [(e.names, layer, tensor, source) for (e, layer, tensor), source in zip(parts, sources)]
            out.append(("layout", self._layout_id, rows))
        iteration = chunk.iteration
        iterations = None if iteration is not None else chunk.row_iterations()
        lengths: Optional[List[int]] = None
        packed = chunk.packed_rows() if self._rows_travel else None
        if packed is not None:  # float64 rows of one length: their bytes as they are (the bytes of the floats)
            data = packed.tobytes()
            lengths = [packed.shape[1]] * packed.shape[0]
        elif self._rows_travel:
            rows = chunk.merged_rows()
            try:
                data = array("d", chain.from_iterable(rows)).tobytes()
                lengths = list(map(len, rows))
            except (TypeError, ValueError):  # a row that is not floats: its final values instead
                lengths = None
        if lengths is None:
            data = array("d", chunk.values).tobytes()
        out.append(("batch", self._layout_id, iteration, iterations, data, lengths))
        return out


def _number(value: Any) -> Any:
    """`value` as a float when it is a number (a Python number, a numpy scalar, a one-element tensor), else as it is."""
    if type(value) is float:
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def _given(row: Any) -> Any:
    """`Emitters.values_of` of a decoded row: its values are already final."""
    return row


class ChunkDecoder:
    """Decodes the chunks a `ChunkEncoder` encoded, in the order they were encoded."""

    def __init__(self) -> None:
        #: layout id -> per row (emitters of final values, emitters of the formulas or None, layer, tensor)
        self._layouts: Dict[int, List[Tuple[Emitters, Optional[Emitters], Any, Any]]] = {}

    def decode(self, encoded: Encoded) -> Optional[Sequence[Any]]:
        """The chunk of one encoded entry (None for a layout entry, which only defines a layout)."""
        kind = encoded[0]
        if kind == "records":
            return encoded[1]
        if kind == "layout":
            _, layout_id, rows = encoded
            self._layouts = {
                layout_id: [
                    (Emitters(names, _given), Emitters(names, compiled(source)) if source else None, layer, tensor)
                    for names, layer, tensor, source in rows
                ]
            }
            return None
        _, layout_id, iteration, iterations, data, lengths = encoded
        values = array("d")
        values.frombytes(data)
        flat = values.tolist()
        batch_rows = []
        offset = 0
        for index, (given, formulas, layer, tensor) in enumerate(self._layouts[layout_id]):
            row_iteration = iteration if iterations is None else iterations[index]
            if lengths is None:  # final values
                emitters, count = given, len(given.names)
            elif formulas is not None:  # merged rows: the formulas run here
                emitters, count = formulas, lengths[index]
            else:
                raise ValueError(f"merged rows for layout {layout_id}, whose row {index} has no formulas")
            batch_rows.append((emitters, flat[offset : offset + count], row_iteration, layer, tensor))
            offset += count
        return ScalarBatch(batch_rows)


__all__ = ["ChunkDecoder", "ChunkEncoder", "MessageReader", "pack", "send", "write"]
