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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import zfec


class UnrecoverableError(RuntimeError):
    """More nodes of a group were lost than its parity covers. (Not a ``UserError`` subclass: this module runs in
    the snapshot process, which is started by path and must not import the ``hf_dtrain`` package, torch or
    transformers; the CLI still prints it as one line, since hf_dtrain raises it itself.)"""


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
            raise ValueError(
                f"ErasureCode parity must be >= 1 (the number of lost nodes to survive), got {self.parity}."
            )
        if self.group_size < self.parity + 1:
            raise ValueError(
                f"ErasureCode group_size must be at least parity + 1 = {self.parity + 1} (k >= 1 data "
                f"nodes per codeword), got {self.group_size}; use fewer parity nodes or larger groups."
            )

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

    def piece_range(self, node: int, codeword: int, shard_bytes: int) -> tuple[int, int]:
        """Where node ``node``'s piece of ``codeword`` lies in its shard of ``shard_bytes``: ``(start, end)``; the
        last piece may be shorter than the others (a shorter piece counts as zero-padded to its codeword's block)."""
        size = self.piece_size(shard_bytes)
        j = self.codewords_of(node).index(codeword)
        return min(j * size, shard_bytes), min((j + 1) * size, shard_bytes)

    def encode(self, pieces: Sequence) -> list:
        """The ``parity`` blocks of one codeword from its k data pieces (in ``data_nodes`` order), each as long as
        the longest piece: a shorter piece counts as zero-padded to it (no padded copy is made). With k = 1 and
        parity 1 the block is the piece itself (no copy)."""
        if len(pieces) != self.k:
            raise ValueError(f"encode needs the codeword's k = {self.k} data pieces, got {len(pieces)}.")
        block = max(len(p) for p in pieces)
        if self.parity == 1:
            if self.k == 1:
                return [pieces[0]]
            acc = np.zeros(block, dtype=np.uint8)
            for p in pieces:
                a = _as_array(p)
                np.bitwise_xor(acc[: len(a)], a, out=acc[: len(a)])
            return [acc]

        padded = tuple(bytes(p) + bytes(block - len(p)) for p in pieces)
        blocks = zfec.Encoder(self.k, self.group_size).encode(padded, tuple(range(self.k, self.group_size)))
        return [bytes(b) for b in blocks]

    def decode_into(self, out: np.ndarray, index: int, symbols: Mapping[int, object]) -> None:
        """Data piece ``index`` of one codeword written into ``out`` (its true length) from the other symbols:
        ``{i: buffer}``, ``i < k`` the i-th data piece and ``k + l`` the l-th parity block, each possibly shorter
        than the block (the rest is zeros). Parity 1 XORs straight into ``out``; Reed-Solomon pads and decodes.
        Raises ``UnrecoverableError`` with fewer than k symbols."""
        if len(symbols) < self.k:
            raise UnrecoverableError(
                f"a codeword needs {self.k} of its {self.group_size} symbols, only {len(symbols)} survive"
            )
        if index in symbols:
            a = _as_array(symbols[index])[: len(out)]
            out[: len(a)] = a
            out[len(a) :] = 0
            return
        if self.parity == 1:
            first, *rest = symbols.values()  # the first copied in, the others XORed into it
            a = _as_array(first)[: len(out)]
            out[: len(a)] = a
            out[len(a) :] = 0
            for s in rest:
                a = _as_array(s)[: len(out)]
                np.bitwise_xor(out[: len(a)], a, out=out[: len(a)])
            return

        block = max(len(s) for s in symbols.values())
        nums = tuple(sorted(symbols)[: self.k])
        pieces = zfec.Decoder(self.k, self.group_size).decode(
            tuple(bytes(symbols[i]) + bytes(block - len(symbols[i])) for i in nums), nums
        )
        a = _as_array(pieces[index])[: len(out)]  # a block shorter than the slot: the piece's tail is padding
        out[: len(a)] = a
        out[len(a) :] = 0

    def rebuild(
        self,
        lost: Sequence[int],
        shards: Mapping[int, bytes],
        parity_blocks: Mapping[tuple[int, int], bytes],
        shard_bytes: Mapping[int, int],
    ) -> dict[int, bytes]:
        """Rebuild the shards of the ``lost`` group positions.

        ``shards``: the surviving nodes' shards; ``parity_blocks``: ``{(codeword, l): block}`` held by survivors;
        ``shard_bytes``: every node's true shard length (from the replicated manifests)."""
        lost = sorted(set(lost))
        if len(lost) > self.parity:
            raise UnrecoverableError(
                f"{len(lost)} nodes of a group of {self.group_size} were lost ({lost}); its parity covers {self.parity}"
            )
        return {
            n: self.rebuild_shard(n, shard_bytes[n], lambda p: self.symbols(p, shards, parity_blocks, lost))[
                : shard_bytes[n]
            ].tobytes()
            for n in lost
        }

    def symbols(
        self,
        codeword: int,
        shards: Mapping[int, object],
        parity_blocks: Mapping[tuple[int, int], object],
        lost: Sequence[int] = (),
    ) -> dict[int, object]:
        """A codeword's surviving symbols (unpadded): the survivors' pieces and the parity blocks survivors hold."""
        out = {}
        for i, n in enumerate(self.data_nodes(codeword)):
            if n in shards and n not in lost:
                start, end = self.piece_range(n, codeword, len(shards[n]))
                out[i] = _as_array(shards[n])[start:end]
        for l, holder in enumerate(self.parity_holders(codeword)):
            if (codeword, l) in parity_blocks and holder not in lost:
                out[self.k + l] = parity_blocks[(codeword, l)]
        return out

    def rebuild_shard(self, node: int, shard_bytes: int, symbols_of) -> np.ndarray:
        """Node ``node``'s shard (at least ``shard_bytes`` long; a view of a received symbol or a new array), each of
        its pieces decoded in place from ``symbols_of(codeword)``, the codeword's surviving symbols. With one data
        node per codeword and XOR parity the one surviving symbol is the shard: it is returned, not copied."""
        size = self.piece_size(shard_bytes)
        if self.k == 1 and self.parity == 1:
            (codeword,) = self.codewords_of(node)
            symbols = symbols_of(codeword)
            if not symbols:
                raise UnrecoverableError(f"a codeword needs {self.k} of its {self.group_size} symbols, none survive")
            symbol = _as_array(next(iter(symbols.values())))
            if len(symbol) >= shard_bytes:
                return symbol
        shard = np.empty(self.k * size, dtype=np.uint8)
        for j, p in enumerate(self.codewords_of(node)):
            self.decode_into(shard[j * size : (j + 1) * size], self.data_nodes(p).index(node), symbols_of(p))
        return shard


def node_groups(num_nodes: int, group_size: int) -> list[list[int]]:
    """Consecutive nodes in groups of ``group_size``; ``num_nodes`` must be a multiple of it."""
    if group_size < 2 or num_nodes % group_size:
        raise ValueError(
            f"erasure group_size must be >= 2 and divide the number of nodes ({num_nodes}), got "
            f"{group_size}; pick a divisor of {num_nodes}."
        )
    return [list(range(s, s + group_size)) for s in range(0, num_nodes, group_size)]
