"""Deterministic, per-rank disjoint batches of token windows (byte text or token files: any
1-D array that slices, a memory map or tokens.ConcatTokens included, is read window by window).

The training split is cut into one contiguous shard per rank, so no two ranks
ever read the same token. Within a shard, each epoch visits every
non-overlapping window once in an order drawn from (seed, rank, epoch); the
reading position (epoch, index) is the loader's whole state, so a resumed run
continues exactly where it stopped.
"""
from __future__ import annotations

import numpy as np
import torch

from ..errors import UsageError


def split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    n_val = max(1, int(len(tokens) * val_fraction))
    return tokens[:-n_val], tokens[-n_val:]


def check_sizes(tokens: np.ndarray, val_fraction: float, seq_len: int, world: int, label: str) -> None:
    """UsageError if a rank's shard or the validation split of `tokens` cannot hold one sequence."""
    check_split(*split(tokens, val_fraction), seq_len, world, label)


def check_split(train, val, seq_len: int, world: int, label: str) -> None:
    """UsageError if a rank's shard of `train` or `val` cannot hold one sequence."""
    shard = len(train) // world
    if shard < seq_len + 1:
        raise UsageError(
            f"seq_len {seq_len} is longer than the data: {label} gives each of {world} "
            f"worker(s) only {shard} training tokens")
    if len(val) < seq_len + 1:
        raise UsageError(
            f"seq_len {seq_len} is longer than the validation split of {label} "
            f"({len(val)} tokens); use a shorter sequence or more data")


def _windows(x: np.ndarray, idx: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([x[i:i + seq_len + 1] for i in idx]).astype(np.int64)
    t = torch.from_numpy(rows)
    return t[:, :-1], t[:, 1:]


class ShardedBatches:
    """Rank `rank` of `world` reads its shard. Replica groups: `rank` and `world` are the replica
    and the replica count, and the replica's `positions` processes split each batch of
    positions·micro_batch windows that one worker would read, `position` taking its part."""

    def __init__(self, train: np.ndarray, rank: int, world: int, seq_len: int,
                 micro_batch: int, seed: int, position: int = 0, positions: int = 1):
        size = len(train) // world
        self.shard = train[rank * size:(rank + 1) * size]
        self.seq_len, self.micro_batch = seq_len, micro_batch
        self.seed, self.rank = seed, rank
        self.position, self.positions = position, positions
        self.starts = np.arange(0, len(self.shard) - seq_len, seq_len)
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.rank, epoch])
        return self.starts[rng.permutation(len(self.starts))]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        idx, want = [], self.micro_batch * self.positions
        while len(idx) < want:
            if self.index >= len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(want - len(idx), len(self._order) - self.index)
            idx.extend(self._order[self.index:self.index + take])
            self.index += take
        mine = idx[self.position * self.micro_batch:(self.position + 1) * self.micro_batch]
        return _windows(self.shard, np.asarray(mine), self.seq_len)

    __call__ = next

    def seek(self, draw: int) -> None:
        """Read draw number `draw` (0: the first) next: the epochs' orders laid end to end, a
        draw is the next micro_batch·positions windows of them."""
        epoch, self.index = divmod(draw * self.micro_batch * self.positions, len(self.starts))
        if epoch != self.epoch:
            self.epoch, self._order = epoch, self._permutation(epoch)

    def state_dict(self) -> dict:
        """The reading position, and the seed that orders each epoch's windows."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.index = int(sd["epoch"]), int(sd["index"])
        self.seed = int(sd.get("seed", self.seed))
        self._order = self._permutation(self.epoch)


class StreamBatches:
    """The run's draws as one stream, dealt to whichever members there are (an elastic run).

    Draw g of the stream is draw g // shards of shard g % shards, read as ShardedBatches reads
    it in a plain run of `shards` ranks. A membership of `members` that begins at draw `start`
    gives its member `member` the draws start + member, start + member + members, ... So a
    membership of the run's size from draw 0 reads what a plain run reads, rank by rank, and a
    membership formed after a fault or a join goes on from the stream's committed position:
    within an epoch no window is read twice whatever the memberships (a member lost mid-round
    takes its draws with it: those windows are skipped, not read again)."""

    def __init__(self, train: np.ndarray, shards: int, seq_len: int, micro_batch: int, seed: int,
                 start: int, member: int, members: int, position: int = 0, positions: int = 1):
        self.readers = [ShardedBatches(train, s, shards, seq_len, micro_batch, seed, position, positions)
                        for s in range(shards)]
        self.start, self.member, self.members, self.drawn = start, member, members, 0
        self.committed = start  # the stream's position at the last commit point (set by the member)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.start + self.drawn * self.members + self.member
        reader = self.readers[g % len(self.readers)]
        reader.seek(g // len(self.readers))
        self.drawn += 1
        return reader.next()

    __call__ = next

    def frontier(self, drawn: int | None = None) -> int:
        """The stream's next unread draw once every member has drawn `drawn` (default: as many
        as this one has)."""
        return self.start + (self.drawn if drawn is None else drawn) * self.members

    def state_dict(self) -> dict:
        return {"start": self.start, "drawn": self.drawn, "member": self.member, "members": self.members,
                "committed": self.committed}

    def load_state_dict(self, sd: dict) -> None:
        """A state saved by a StreamBatches (a plain loader's, of an older elastic checkpoint,
        leaves the stream where it is)."""
        if "start" in sd:
            self.start, self.drawn, self.committed = int(sd["start"]), int(sd["drawn"]), int(sd["committed"])
            self.member, self.members = int(sd["member"]), int(sd["members"])


def stream_position(loader_state: dict | None) -> int:
    """The stream's committed draw in a member's saved loader state (0: none saved)."""
    return int(loader_state.get("committed", 0)) if loader_state else 0


def val_batches(val: np.ndarray, rank: int, world: int, seq_len: int, micro_batch: int,
                max_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's fixed share of validation windows (round-robin over ranks)."""
    starts = np.arange(0, len(val) - seq_len, seq_len)[rank::world][: max_batches * micro_batch]
    return [_windows(val, starts[i:i + micro_batch], seq_len) for i in range(0, len(starts), micro_batch)]
