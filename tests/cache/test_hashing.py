"""Block hashes: canonical bytes, chaining, salt and extra-key scoping, incremental extension."""

from __future__ import annotations

import struct

import pytest
import xxhash

from agentd.cache import hash_block, hash_blocks

TOKENS = list(range(100, 110))  # 10 tokens: two full blocks of 4 and a partial tail of 2


def test_hash_block_known_answer() -> None:
    digest = hash_block(None, [1, 2, 3])
    assert digest.hex() == "314bcfbba8cda5e99f59a8edb9f7a5f5"
    assert hash_block(None, [1, 2, 3], b"x").hex() == "52f9df70ed7e6e59b622ddc7b230ec30"
    assert hash_blocks([1, 2, 3, 4], 2)[1].hex() == "21633aeebfec2b706010bc914d1e5993"


def test_hash_block_is_xxh3_128_of_canonical_bytes() -> None:
    parent = bytes(range(16))
    expected = xxhash.xxh3_128_digest(parent + struct.pack("<3i", 7, -1, 2**31 - 1) + b"ex")
    assert hash_block(parent, [7, -1, 2**31 - 1], b"ex") == expected
    assert hash_block(None, [5]) == xxhash.xxh3_128_digest(bytes(16) + b"\x05\x00\x00\x00")
    assert len(hash_block(None, [5])) == 16


def test_hash_block_is_stable_and_content_sensitive() -> None:
    assert hash_block(None, TOKENS) == hash_block(None, tuple(TOKENS))
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])
    assert hash_block(None, [1, 2]) != hash_block(hash_block(None, [0]), [1, 2])
    with pytest.raises(struct.error):
        hash_block(None, [2**31])


def test_partial_block_is_not_hashed() -> None:
    assert len(hash_blocks(TOKENS, 4)) == 2
    assert hash_blocks(TOKENS[:3], 4) == []
    assert hash_blocks(TOKENS, 4) == hash_blocks(TOKENS[:8], 4)


def test_blocks_are_chained() -> None:
    first, second = hash_blocks(TOKENS, 4)
    assert second != hash_blocks(TOKENS[4:8], 4)[0]
    assert hash_blocks(TOKENS[:4] + [0, 0, 0, 0], 4)[0] == first


def test_salt_changes_the_whole_chain_from_the_first_block() -> None:
    plain = hash_blocks(TOKENS, 4)
    salted = hash_blocks(TOKENS, 4, cache_salt="tenant-a")
    other = hash_blocks(TOKENS, 4, cache_salt="tenant-b")
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    assert all(a != b for a, b in zip(salted, other, strict=True))
    assert hash_blocks(TOKENS, 4, cache_salt="") != plain
    # The salt enters block 0 only; block 1 differs solely through its parent.
    assert salted[1] == hash_blocks(TOKENS, 4, parent=salted[0], start_block=1)[0]


def test_extra_key_changes_every_block() -> None:
    plain = hash_blocks(TOKENS, 4)
    keyed = hash_blocks(TOKENS, 4, extra_key=b"model-fp")
    assert all(a != b for a, b in zip(plain, keyed, strict=True))
    # Block 1 differs even given the same parent: the key is mixed into every block.
    assert hash_blocks(TOKENS, 4, extra_key=b"k", parent=plain[0], start_block=1) != plain[1:]
    # A key and a salt never alias one another.
    assert hash_blocks(TOKENS, 4, extra_key=b"ab") != hash_blocks(
        TOKENS, 4, extra_key=b"a", cache_salt="b"
    )


@pytest.mark.parametrize("start_block", [1, 2, 3])
def test_incremental_equals_one_shot(start_block: int) -> None:
    tokens = list(range(17))
    one_shot = hash_blocks(tokens, 4, extra_key=b"fp", cache_salt="s")
    head = hash_blocks(tokens[: start_block * 4], 4, extra_key=b"fp", cache_salt="s")
    tail = hash_blocks(
        tokens, 4, extra_key=b"fp", cache_salt="s", parent=head[-1], start_block=start_block
    )
    assert head + tail == one_shot


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="block_size"):
        hash_blocks(TOKENS, 0)
    with pytest.raises(ValueError, match="parent"):
        hash_blocks(TOKENS, 4, start_block=1)


def test_a_partial_blocks_key_never_names_a_full_block() -> None:
    from agentd.cache import hash_partial_block

    tokens = list(range(40))  # 2 full blocks of 16, a tail of 8
    full = hash_blocks(tokens, 16, b"fp", "salt")
    tail = hash_partial_block(tokens, 16, b"fp", "salt", full[-1])
    assert tail is not None and tail not in full
    assert hash_partial_block(tokens[:32], 16, b"fp", "salt", full[-1]) is None  # no tail
    assert tail == hash_partial_block(tokens, 16, b"fp", "salt", full[-1])  # deterministic
    other = hash_blocks(tokens, 16, b"fp", "other")
    assert tail != hash_partial_block(tokens, 16, b"fp", "other", other[-1])  # salted (chain)
    assert hash_partial_block(tokens[:8], 16, b"fp", "salt") != hash_partial_block(
        tokens[:8], 16, b"fp", "other")  # a tail with no full block before it: salted itself
    assert tail != hash_partial_block(tokens[:39], 16, b"fp", "salt", full[-1])
    extended = hash_blocks(tokens + list(range(100, 108)), 16, b"fp", "salt")
    assert tail != extended[2]  # the tail's tokens grown to a full block: another key
