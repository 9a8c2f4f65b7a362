"""Shape algebra of shards (passes/reshapes.py) and shard slicing (passes/placement.py)."""

import sympy
import torch
from autotp.passes.placement import (
    Shard,
    assemble,
    assemble_blocks,
    local_blocks,
    local_shard,
)
from autotp.passes.reshapes import map_reshape

B, T = sympy.symbols("B T")


def test_split_hidden_into_heads_shards_the_heads():
    assert map_reshape((B, T, 64), (B, T, 4, 16), Shard(2, (64,)), tp=2) == Shard(2, (4,))


def test_merge_heads_back_into_features():
    assert map_reshape((B, T, 4, 16), (B, T, 64), Shard(2, (4,)), tp=2) == Shard(2, (64,))


def test_fused_qkv_viewed_as_three_parts_shards_heads_not_the_three():
    assert map_reshape((B, T, 192), (B, T, 3, 4, 16), Shard(2, (64, 64, 64)), tp=2) == Shard(3, (4,))


def test_heads_merged_with_a_fused_outer_dim_become_segments():
    assert map_reshape((B, T, 3, 4, 16), (B, T, 192), Shard(3, (4,)), tp=2) == Shard(2, (64, 64, 64))


def test_flatten_batch_and_time_keeps_feature_shard():
    assert map_reshape((B, T, 64), (B * T, 64), Shard(2, (64,)), tp=2) == Shard(1, (64,))
    assert map_reshape((B * T, 192), (B, T, 192), Shard(1, (64, 64, 64)), tp=2) == Shard(2, (64, 64, 64))


def test_repeat_kv_expansion_keeps_contiguous_heads():
    # (B, kv=2, rep=2, T, D) -> (B, 4, T, D): rank r's KV heads expand into its contiguous query heads.
    assert map_reshape((B, 2, 2, T, 16), (B, 4, T, 16), Shard(1, (2,)), tp=2) == Shard(1, (4,))


def test_heads_folded_into_the_batch_are_a_split_repeated_over_blocks():
    folded = map_reshape((B, 4, T, 16), (B * 4, T, 16), Shard(1, (4,)), tp=2)
    assert folded == Shard(0, (4,), blocks=B)
    assert map_reshape((T, B, 64), (T, B * 4, 16), Shard(2, (64,)), tp=2) == Shard(1, (4,), blocks=B)
    assert map_reshape((B * 4, T, 16), (B, 4, T, 16), folded, tp=2) == Shard(1, (4,))
    assert map_reshape((B * 4, T, 16), (B * 4, T * 16), folded, tp=2) == folded  # that dim untouched


def test_blocked_shards_round_trip():
    full = torch.arange(24.0).reshape(12, 2)  # 3 blocks of 4 heads
    shards = [local_blocks(full, 0, (4,), rank=r, tp=2) for r in range(2)]
    assert shards[1][:, 0].tolist() == [4, 6, 12, 14, 20, 22]
    assert torch.equal(assemble_blocks(shards, 0, (4,)), full)


def test_local_shard_takes_each_segment_in_turn():
    full = torch.arange(12.0)
    assert local_shard(full, 0, (4, 4, 4), rank=1, tp=2).tolist() == [2, 3, 6, 7, 10, 11]


def test_assemble_inverts_local_shard():
    full = torch.randn(6, 5)
    for segments in [(6,), (2, 2, 2), (4, 2)]:
        shards = [local_shard(full, 0, segments, r, 2) for r in range(2)]
        assert torch.equal(assemble(shards, 0, segments), full)
