"""Erasure coding of snapshot shards across nodes, with rotating parity (RAID-5 for ``parity=1``, RAID-6-like beyond).

Nodes are split into groups of ``group_size`` = k data + m parity. Each node keeps its own shard whole (a restarted
trainer on a live node reads it back directly) and the group's parity is spread evenly: for every codeword
``p = 0 .. g-1`` the parity is held by the m nodes ``p, p+1, .., p+m-1 (mod g)``, and the other k nodes each
contribute one piece of their shard. A node is a data node in k codewords, so its shard is cut into k pieces, and it
holds m parity blocks of one piece each: ``m / k`` extra memory per node. Every codeword has one symbol per node, so
losing any m nodes of a group loses at most m symbols of each codeword, which the code recovers.

The code is XOR for m = 1 and zfec's Reed-Solomon (the maintained library Tahoe-LAFS uses) for m >= 2. Shards of
different lengths: each codeword's pieces are zero-padded to its longest; the true lengths travel in the manifests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np


class UnrecoverableError(RuntimeError):
    """More nodes of a group were lost than its parity covers."""


def _as_array(buf) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8)


@dataclass(frozen=True)
class ErasureCode:
    """The rotating-parity code of one group of ``group_size`` nodes tolerating ``parity`` lost nodes."""

    group_size: int
    parity: int = 1

    def __post_init__(self):
        if not isinstance(self.group_size, int) or not isinstance(self.parity, int):
            raise TypeError("ErasureCode group_size and parity must be ints.")
        if self.parity < 1:
            raise ValueError(f"ErasureCode parity must be >= 1 (the number of lost nodes to survive), got "
                             f"{self.parity}.")
        if self.group_size < self.parity + 1:
            raise ValueError(f"ErasureCode group_size must be at least parity + 1 = {self.parity + 1} (k >= 1 data "
                             f"nodes per codeword), got {self.group_size}; use fewer parity nodes or larger groups.")

    @property
    def k(self) -> int:
        return self.group_size - self.parity

    def parity_holders(self, codeword: int) -> list[int]:
        """The group positions holding codeword ``codeword``'s parity blocks, block ``l`` on the ``l``-th."""
        return [(codeword + l) % self.group_size for l in range(self.parity)]

    def data_nodes(self, codeword: int) -> list[int]:
        """The group positions whose pieces make up codeword ``codeword``, in code order."""
        holders = set(self.parity_holders(codeword))
        return [n for n in range(self.group_size) if n not in holders]

    def codewords_of(self, node: int) -> list[int]:
        """The codewords ``node`` contributes data to, in the order of its pieces."""
        return [p for p in range(self.group_size) if node in self.data_nodes(p)]

    def piece_size(self, shard_bytes: int) -> int:
        """Bytes per piece of a node's shard of ``shard_bytes`` (its k pieces cover it)."""
        return max(1, -(-shard_bytes // self.k))

    def block_size(self, codeword: int, shard_bytes: Mapping[int, int]) -> int:
        """A codeword's symbol length: its data pieces are zero-padded to the longest (shards may differ)."""
        return max(self.piece_size(shard_bytes[n]) for n in self.data_nodes(codeword))

    def piece(self, node: int, shard, codeword: int, pad_to: Optional[int] = None) -> bytes:
        """Node ``node``'s piece of ``codeword``, zero-padded to ``pad_to`` (the codeword's block size)."""
        size = self.piece_size(len(shard))
        index = self.codewords_of(node).index(codeword)
        data = _as_array(shard)[index * size:(index + 1) * size]
        pad_to = size if pad_to is None else pad_to
        if len(data) == pad_to:
            return data.tobytes()
        out = np.zeros(pad_to, dtype=np.uint8)
        out[:len(data)] = data
        return out.tobytes()

    def encode(self, pieces: Sequence) -> list[bytes]:
        """The ``parity`` blocks of one codeword from its k data pieces (in ``data_nodes`` order)."""
        if len(pieces) != self.k:
            raise ValueError(f"encode needs the codeword's k = {self.k} data pieces, got {len(pieces)}.")
        sizes = {len(p) for p in pieces}
        if len(sizes) != 1:
            raise ValueError(f"All pieces of a codeword must have the same length, got {sorted(sizes)}.")
        if self.parity == 1:
            acc = _as_array(pieces[0]).copy()
            for p in pieces[1:]:
                np.bitwise_xor(acc, _as_array(p), out=acc)
            return [acc.tobytes()]
        import zfec

        blocks = zfec.Encoder(self.k, self.group_size).encode(tuple(bytes(p) for p in pieces),
                                                              tuple(range(self.k, self.group_size)))
        return [bytes(b) for b in blocks]

    def decode(self, symbols: Mapping[int, bytes]) -> list[bytes]:
        """The k data pieces of one codeword from any k of its symbols: ``{i: block}`` with ``i < k`` the i-th data
        piece and ``k + l`` the l-th parity block. Raises ``UnrecoverableError`` with fewer than k."""
        if len(symbols) < self.k:
            raise UnrecoverableError(f"a codeword needs {self.k} of its {self.group_size} symbols, only "
                                     f"{len(symbols)} survive")
        if all(i in symbols for i in range(self.k)):
            return [symbols[i] for i in range(self.k)]
        if self.parity == 1:
            missing = next(i for i in range(self.k) if i not in symbols)
            acc = _as_array(symbols[self.k]).copy()
            for i in range(self.k):
                if i != missing:
                    np.bitwise_xor(acc, _as_array(symbols[i]), out=acc)
            return [acc.tobytes() if i == missing else symbols[i] for i in range(self.k)]
        import zfec

        nums = tuple(sorted(symbols)[:self.k])
        out = zfec.Decoder(self.k, self.group_size).decode(tuple(bytes(symbols[i]) for i in nums), nums)
        return [bytes(b) for b in out]

    def rebuild(self, lost: Sequence[int], shards: Mapping[int, bytes], parity_blocks: Mapping[tuple[int, int], bytes],
                shard_bytes: Mapping[int, int]) -> dict[int, bytes]:
        """Rebuild the shards of the ``lost`` group positions.

        ``shards``: the surviving nodes' shards; ``parity_blocks``: ``{(codeword, l): block}`` held by survivors;
        ``shard_bytes``: every node's true shard length (from the replicated manifests)."""
        lost = sorted(set(lost))
        if len(lost) > self.parity:
            raise UnrecoverableError(f"{len(lost)} nodes of a group of {self.group_size} were lost ({lost}); its "
                                     f"parity covers {self.parity}")
        rebuilt = {n: bytearray(self.k * self.piece_size(shard_bytes[n])) for n in lost}
        for p in range(self.group_size):
            data = self.data_nodes(p)
            if not any(n in rebuilt for n in data):
                continue
            block = self.block_size(p, shard_bytes)
            symbols = {i: self.piece(n, shards[n], p, block) for i, n in enumerate(data) if n in shards}
            for l, holder in enumerate(self.parity_holders(p)):
                if (p, l) in parity_blocks and holder not in lost:
                    symbols[self.k + l] = parity_blocks[(p, l)]
            pieces = self.decode(symbols)
            for i, n in enumerate(data):
                if n in rebuilt:
                    size = self.piece_size(shard_bytes[n])
                    index = self.codewords_of(n).index(p)
                    rebuilt[n][index * size:(index + 1) * size] = pieces[i][:size]
        return {n: bytes(buf[:shard_bytes[n]]) for n, buf in rebuilt.items()}


def node_groups(num_nodes: int, group_size: int) -> list[list[int]]:
    """Consecutive nodes in groups of ``group_size``; ``num_nodes`` must be a multiple of it."""
    if group_size < 2 or num_nodes % group_size:
        raise ValueError(f"erasure group_size must be >= 2 and divide the number of nodes ({num_nodes}), got "
                         f"{group_size}; pick a divisor of {num_nodes}.")
    return [list(range(s, s + group_size)) for s in range(0, num_nodes, group_size)]
