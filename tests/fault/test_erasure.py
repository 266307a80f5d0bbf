"""Rotating-parity erasure code: any ``parity`` lost nodes of a group are rebuilt byte for byte (XOR for one,
zfec Reed-Solomon for more), one more is a clear error, and parity is spread evenly."""

import itertools

import numpy as np
import pytest

from hf_dtrain.fault.erasure import ErasureCode, UnrecoverableError, node_groups


def _group(code, seed=0):
    rng = np.random.default_rng(seed)
    shards = {
        n: rng.integers(0, 256, size=int(rng.integers(1000, 5000)), dtype=np.uint8).tobytes()
        for n in range(code.group_size)
    }
    lengths = {n: len(s) for n, s in shards.items()}
    parity = {}
    for p in range(code.group_size):
        pieces = [shards[n][slice(*code.piece_range(n, p, lengths[n]))] for n in code.data_nodes(p)]
        block = max(len(x) for x in pieces)
        padded = [x + bytes(block - len(x)) for x in pieces]  # the reference: the code on zero-padded pieces
        for l, b in enumerate(code.encode(padded)):
            assert len(b) == block
            parity[(p, l)] = b
    return shards, parity


@pytest.mark.parametrize("group_size,parity", [(2, 1), (4, 1), (5, 2), (6, 3)])
def test_any_tolerated_loss_is_rebuilt_exactly(group_size, parity):
    code = ErasureCode(group_size, parity)
    shards, blocks = _group(code)
    lengths = {n: len(s) for n, s in shards.items()}
    for lost in itertools.combinations(range(group_size), parity):
        survivors = {n: s for n, s in shards.items() if n not in lost}
        held = {(p, l): b for (p, l), b in blocks.items() if code.parity_holders(p)[l] not in lost}
        rebuilt = code.rebuild(lost, survivors, held, lengths)
        assert rebuilt == {n: shards[n] for n in lost}
    too_many = tuple(range(parity + 1))
    with pytest.raises(UnrecoverableError, match=rf"{parity + 1} nodes of a group of {group_size} were lost"):
        code.rebuild(too_many, {n: s for n, s in shards.items() if n not in too_many}, blocks, lengths)


def test_parity_is_spread_evenly_and_each_codeword_has_one_symbol_per_node():
    code = ErasureCode(5, 2)
    held = [0] * 5
    for p in range(5):
        holders, data = code.parity_holders(p), code.data_nodes(p)
        assert sorted(holders + data) == list(range(5))  # every node exactly once per codeword
        for h in holders:
            held[h] += 1
    assert held == [2] * 5  # m parity blocks per node: m / k extra memory each
    assert all(len(code.codewords_of(n)) == code.k for n in range(5))


def test_a_corrupted_parity_block_gives_a_different_shard():
    """The code does not hide corruption: the rebuilt bytes change, which the manifest checksums then catch."""
    code = ErasureCode(3, 1)
    shards, blocks = _group(code, seed=1)
    lengths = {n: len(s) for n, s in shards.items()}
    bad = dict(blocks)
    key = next(k for k in bad if code.parity_holders(k[0])[0] != 0 and 0 in code.data_nodes(k[0]))
    flipped = bytearray(bad[key])
    flipped[0] ^= 1
    bad[key] = bytes(flipped)
    rebuilt = code.rebuild([0], {1: shards[1], 2: shards[2]}, bad, lengths)
    assert rebuilt[0] != shards[0]


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError, match="parity must be >= 1"):
        ErasureCode(4, 0)
    with pytest.raises(ValueError, match="group_size must be at least parity \\+ 1"):
        ErasureCode(2, 2)
    with pytest.raises(ValueError, match="divide the number of nodes"):
        node_groups(5, 2)
    assert node_groups(4, 2) == [[0, 1], [2, 3]]


@pytest.mark.parametrize("group_size,parity", [(3, 1), (4, 2)])
def test_unpadded_pieces_encode_and_decode_as_their_zero_padded_form(group_size, parity):
    """The exchange sends each piece at its true length (no padded copy); the parity and the decoded piece equal
    the padded code's."""
    code = ErasureCode(group_size, parity)
    rng = np.random.default_rng(3)
    pieces = [rng.integers(0, 256, size=n, dtype=np.uint8).tobytes() for n in (700, 1000, 420)[: code.k]]
    block = max(len(p) for p in pieces)
    padded = [p + bytes(block - len(p)) for p in pieces]
    blocks = code.encode(pieces)
    assert [bytes(b) for b in blocks] == [bytes(b) for b in code.encode(padded)]
    for lost in range(code.k):
        symbols = {i: p for i, p in enumerate(pieces) if i != lost}
        symbols.update({code.k + l: b for l, b in enumerate(blocks)})
        out = np.full(len(pieces[lost]), 7, dtype=np.uint8)
        code.decode_into(out, lost, symbols)
        assert out.tobytes() == pieces[lost]
