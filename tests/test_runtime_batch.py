"""MicroPack -> tokens, labels, loss mask, positions, THD metadata."""
import pytest
import torch

from megatron_slimpack.plan import MicroPack, Slice
from megatron_slimpack.runtime.attention.batch import InMemoryTokenSource, build_batch
from megatron_slimpack.runtime.attention.core import KVStore


def test_batch_fields():
    source = InMemoryTokenSource({7: torch.arange(100, 110), 3: torch.arange(200, 204)})
    batch = build_batch(MicroPack([Slice(7, 4, 8), Slice(3, 0, 4)]), source, KVStore())
    assert batch.tokens.tolist() == [[104, 105, 106, 107, 200, 201, 202, 203]]
    # the continuation's last label is the next slice's first token; a document's last token has none
    assert batch.labels[0, :4].tolist() == [105, 106, 107, 108]
    assert batch.labels[0, 4:7].tolist() == [201, 202, 203]
    assert batch.loss_mask.tolist() == [[1, 1, 1, 1, 1, 1, 1, 0]]
    assert batch.position_ids.tolist() == [[4, 5, 6, 7, 0, 1, 2, 3]]
    params = batch.packed_seq_params
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == [0, 4, 8]
    assert params.cu_seqlens_attn_kv.tolist() == [0, 8, 12]  # prefix + slice
    assert (params.max_seqlen_q, params.max_seqlen_attn_kv) == (4, 8)
    assert params.sample_ids == [7, 3] and params.starts == [4, 0] and params.keeps_kv == [True, False]
    assert batch.num_loss_tokens == 7


def test_source_returning_wrong_length_is_reported():
    class Broken:
        def tokens(self, sample_id, start, end):
            return list(range(start, end - 1))

    with pytest.raises(ValueError, match="token source returned"):
        build_batch(MicroPack([Slice(0, 0, 5)]), Broken(), KVStore())
