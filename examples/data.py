"""The demo's data: a deterministic, generated char-level sorting task ("3191=1139.").

Each example is `n_digits` random decimal digits, ``=``, the same digits sorted ascending, and ``.``.  A model sees
the sequence left to right and is trained to predict every next character; only the characters after ``=`` can be
predicted (the prompt digits are random), so the loss is taken on those positions only (the others carry the
`IGNORE_INDEX` target).  A model that has not learned anything sits at ln(10) ≈ 2.30 there; one that sorts
perfectly reaches 0.  Nothing is downloaded: the examples are drawn from a seeded `torch.Generator`, and the
validation examples never occur in the training set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Tuple

import torch

VOCAB = "0123456789=."
SEPARATOR = "="
END = "."
IGNORE_INDEX = -100
STOI = {ch: i for i, ch in enumerate(VOCAB)}


def encode(text: str) -> torch.Tensor:
    """Character ids of `text` (int64); ValueError naming the first character outside `VOCAB`."""
    for position, ch in enumerate(text):
        if ch not in STOI:
            raise ValueError(f"encode: character {ch!r} at position {position} of {text!r} is not in {VOCAB!r}")
    return torch.tensor([STOI[ch] for ch in text], dtype=torch.long)


def decode(ids) -> str:
    """The text of a sequence of character ids."""
    return "".join(VOCAB[int(i)] for i in ids)


def sorting_example(digits: torch.Tensor) -> torch.Tensor:
    """The full id sequence ``digits = sorted(digits) .`` for a 1-D tensor of digit ids (0..9)."""
    return torch.cat([digits, encode(SEPARATOR), torch.sort(digits).values, encode(END)])


def inputs_and_targets(sequences: torch.Tensor, n_digits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Next-character pairs: x = seq[:, :-1], y = seq[:, 1:] with the targets inside the prompt (the first
    `n_digits` positions of y, i.e. the characters that follow a prompt digit) set to `IGNORE_INDEX`."""
    x = sequences[:, :-1]
    y = sequences[:, 1:].clone()
    y[:, :n_digits] = IGNORE_INDEX
    return x, y


@dataclass
class SortingDataset:
    """Train / validation splits of the sorting task, as (inputs, targets) id tensors."""

    n_digits: int
    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor

    @property
    def seq_len(self) -> int:
        """Length of the model input (the full example length minus one)."""
        return self.train_x.shape[1]

    def batches(self, batch_size: int, *, seed: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """An endless stream of training batches, reshuffled each epoch from `seed`."""
        if not 0 < batch_size <= self.train_x.shape[0]:
            raise ValueError(f"batch_size must be in 1..{self.train_x.shape[0]} (training examples), got {batch_size}")
        generator = torch.Generator().manual_seed(seed)
        while True:
            order = torch.randperm(self.train_x.shape[0], generator=generator)
            for start in range(0, order.numel() - batch_size + 1, batch_size):
                index = order[start : start + batch_size]
                yield self.train_x[index], self.train_y[index]


def _unique_rows(rows: torch.Tensor) -> torch.Tensor:
    """The distinct rows of `rows`, in order of first occurrence."""
    seen = set()
    keep = []
    for i, row in enumerate(rows.tolist()):
        key = tuple(row)
        if key not in seen:
            seen.add(key)
            keep.append(i)
    return rows[keep]


def make_sorting_dataset(
    n_train: int = 4096, n_val: int = 512, n_digits: int = 8, *, seed: int = 1234
) -> SortingDataset:
    """Draw `n_train` + `n_val` distinct digit strings of length `n_digits` from `seed` (validation strings never
    appear in training) and build the splits."""
    if n_train < 1 or n_val < 1 or n_digits < 1:
        raise ValueError(
            f"make_sorting_dataset: n_train, n_val and n_digits must be >= 1, got {n_train}, {n_val}, {n_digits}"
        )
    if n_train + n_val > 10**n_digits:
        raise ValueError(
            f"make_sorting_dataset: only {10**n_digits} distinct strings of {n_digits} digits exist, "
            f"{n_train + n_val} requested"
        )
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.empty(0, n_digits, dtype=torch.long)
    while prompts.shape[0] < n_train + n_val:  # redraw until enough distinct strings (rarely more than one round)
        draw = torch.randint(0, 10, (n_train + n_val, n_digits), generator=generator)
        prompts = _unique_rows(torch.cat([prompts, draw]))
    prompts = prompts[: n_train + n_val]
    sequences = torch.stack([sorting_example(p) for p in prompts])
    train_x, train_y = inputs_and_targets(sequences[:n_train], n_digits)
    val_x, val_y = inputs_and_targets(sequences[n_train:], n_digits)
    return SortingDataset(n_digits, train_x, train_y, val_x, val_y)
