"""The training blocks' seeded, per-epoch shuffled order, resumable by its position; the held-out blocks;
and what the data holds (:class:`DataStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Protocol

import numpy as np

from mobius.batch import MicroBatch
from mobius.data.pack import TextBlocks
from mobius.errors import MobiusError


class Blocks(Protocol):
    """Blocks by index as micro-batches (:class:`~mobius.data.pack.TextBlocks`,
    :class:`~mobius.data.pack.ChatBlocks`)."""

    def __len__(self) -> int: ...

    def get(self, indices: np.ndarray) -> MicroBatch: ...


@dataclass(frozen=True)
class DataStats:
    """What a run's data holds, as ``mobius data`` reports it."""

    format: str  # text | chat
    records: int | None  # documents or records read (None: a text cache from before they were counted)
    tokens: int  # tokens that train or are held out (conversations: as kept, after truncation)
    target_tokens: int  # of which targets
    seq_len: int
    train_blocks: int
    val_blocks: int
    efficiency: float  # positions filled by data / (blocks x seq_len)
    conversations: int = 0  # conversations in blocks
    fewest_blocks: int = 0  # conversations: a lower bound on the blocks any packing of them takes
    left_out: dict[str, tuple[int, str]] = field(default_factory=dict)  # why -> (records, where the first was read)
    truncated: tuple[int, str] | None = None  # (conversations cut to seq_len + 1 tokens, where the first was read)
    template: str | None = None  # where the chat template came from
    train_on: str | None = None
    packing: bool = True


@dataclass
class TrainData:
    """Train / eval split of the blocks and a resumable, seeded shuffled order."""

    train: Blocks
    val: Blocks
    seed: int
    position: int = 0  # samples drawn so far (the resumable state)
    fingerprint: str = ""  # the data's content (and, for conversations, how it is packed), checked when a run resumes
    stats: DataStats | None = None

    def next_batch(self, batch_size: int) -> MicroBatch:
        """The next ``batch_size`` training blocks."""
        idx = np.array([self._index(self.position + i) for i in range(batch_size)])
        self.position += batch_size
        return self.train.get(idx)

    def peek_batches(self, batch_size: int, count: int) -> list[MicroBatch]:
        """The next ``count`` batches :meth:`next_batch` will give, without drawing them."""
        position = self.position
        try:
            return [self.next_batch(batch_size) for _ in range(count)]
        finally:
            self.position = position

    def _index(self, sample: int) -> int:
        epoch, offset = divmod(sample, len(self.train))
        if not hasattr(self, "_perm") or self._perm[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm = (epoch, rng.permutation(len(self.train)))
        return int(self._perm[1][offset])

    def eval_batches(self, batch_size: int, batches: int) -> Iterator[MicroBatch]:
        """Fixed held-out batches (the same ones at every evaluation)."""
        n = min(batches, len(self.val) // batch_size)
        for b in range(n):
            yield self.val.get(np.arange(b * batch_size, (b + 1) * batch_size))

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "train_blocks": len(self.train),
                "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        if state["train_blocks"] != len(self.train):
            raise MobiusError(f"the data changed since the checkpoint: {len(self.train)} training blocks now, "
                              f"{state['train_blocks']} then")
        self.position, self.seed = state["position"], state["seed"]


def build_data(tokens: np.ndarray, seq_len: int, val_fraction: float, seed: int, min_val_blocks: int = 1,
               fingerprint: str = "", records: int | None = None) -> TrainData:
    """Split text blocks into training blocks and a held-out tail for evaluation."""
    total = (len(tokens) - 1) // seq_len
    n_val = max(min_val_blocks, int(total * val_fraction)) if val_fraction > 0 else 0
    if total - n_val < 1:
        raise MobiusError(f"the data holds {len(tokens)} tokens, too few for one training block of "
                          f"{seq_len + 1} tokens plus {n_val} held-out blocks; lower data.seq_len or add text")
    train = TextBlocks(tokens, seq_len, 0, total - n_val)
    val = TextBlocks(tokens, seq_len, total - n_val, n_val)
    stats = DataStats("text", records, len(tokens), total * seq_len, seq_len, len(train), len(val), 1.0)
    return TrainData(train, val, seed, fingerprint=fingerprint, stats=stats)
