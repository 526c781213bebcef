"""A continuation slice rotates with the phases its tokens have in the whole document."""
import torch

from megatron_slimpack.plan import MicroPack, Slice


def test_continuation_slice_gets_whole_document_phases(megatron_cpu):
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_slimpack.runtime import InMemoryTokenSource, KVStore, build_batch
    from megatron_slimpack.runtime.attention.rope import rotary_freqs_at, slice_positions
    from megatron_slimpack.runtime.model import tiny_config

    config = tiny_config(hidden_size=32, num_attention_heads=4)
    rotary = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)
    source = InMemoryTokenSource({0: torch.arange(40), 1: torch.arange(9)})
    # slice [25, 40) of document 0 packed after a whole document of 9 tokens
    batch = build_batch(MicroPack([Slice(1, 0, 9), Slice(0, 25, 40)]), source, KVStore())
    params = batch.packed_seq_params
    positions = slice_positions(params)
    assert positions.tolist() == list(range(9)) + list(range(25, 40))
    freqs = rotary_freqs_at(rotary, positions)

    x = torch.randn(40, 1, 4, 8)  # the whole document 0, sbhd
    whole = apply_rotary_pos_emb(x, rotary(40), config=config)
    packed = torch.cat([torch.randn(9, 4, 8), x[25:40, 0]])  # thd
    sliced = apply_rotary_pos_emb(packed, freqs, config=config, cu_seqlens=params.cu_seqlens_q)
    torch.testing.assert_close(sliced[9:], whole[25:40, 0], rtol=0, atol=1e-6)
    # megatron's own THD table would restart the slice at position 0: phases differ
    restarted = apply_rotary_pos_emb(packed, rotary(15), config=config, cu_seqlens=params.cu_seqlens_q)
    assert not torch.allclose(restarted[9:], whole[25:40, 0], atol=1e-3)


def test_rotary_tables_are_asked_for_in_power_of_two_sizes():
    """megatron caches a rotary table per length asked for: rounding up to a power of two keeps a
    run's tables at most twice the largest, whatever lengths its MicroPacks have."""
    from megatron_slimpack.runtime.attention.seq_params import SlicedSeqParams

    def rows(kv: int, padding: int = 0) -> int:
        return SlicedSeqParams(qkv_format="thd", max_seqlen_attn_kv=kv, padding=padding).rotary_rows

    assert [rows(n) for n in (1, 2, 3, 1000, 1024, 1025, 131072)] == [1, 2, 4, 1024, 1024, 2048, 131072]
    assert rows(100, padding=300) == 512
    sizes = {rows(n) for n in range(1, 5000, 7)}
    assert sum(sizes) < 2 * max(sizes)
