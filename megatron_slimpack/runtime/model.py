"""A megatron-core GPTModel that runs SlimPack MicroPacks.

Two changes to `GPTModel`: for a sliced THD batch (`SlicedSeqParams`) the rotary table is
built from each token's absolute position (see rope.py) instead of restarting per segment, and
handed to the SlimPack core attention, which applies it; and
under sequence parallelism torch norms are swapped for ones that support it (norm.py), and with
`tp_overlap` the local spec's linears for ones that hide their TP collectives (tp_overlap.py).
Everything else, weights and state-dict keys included, is megatron's, so a checkpoint moves
freely between this model and a stock one.
"""
from __future__ import annotations

from typing import Optional

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from .attention.core import SlicedSeqParams, slimpack_layer_spec
from .attention.rope import rotary_freqs_at, slice_positions
from .norm import sequence_parallel_spec


class SlimPackGPTModel(GPTModel):
    def __init__(self, config: TransformerConfig, transformer_layer_spec, *args, tp_overlap: bool = False, **kwargs):
        spec = sequence_parallel_spec(transformer_layer_spec, config, vp_stage=kwargs.get("vp_stage"),
                                      tp_overlap=tp_overlap)
        super().__init__(config, spec, *args, **kwargs)

    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                    packed_seq_params=None, **kwargs):
        outputs = super()._preprocess(input_ids, position_ids, decoder_input=decoder_input,
                                      inference_context=inference_context,
                                      packed_seq_params=packed_seq_params, **kwargs)
        if self.position_embedding_type == "rope" and isinstance(packed_seq_params, SlicedSeqParams):
            if self.config.apply_rope_fusion:
                raise ValueError("SlimPack needs apply_rope_fusion=False: the fused THD RoPE restarts at 0 per slice")
            # The core attention applies RoPE (rope.py): megatron's THD RoPE reads every segment's
            # boundaries back to the host, in every layer.
            packed_seq_params.rotary_freqs = rotary_freqs_at(self.rotary_pos_emb, slice_positions(packed_seq_params),
                                                             packed_seq_params.rotary_rows)
            outputs = (outputs[0], None, *outputs[2:])
        return outputs


def build_gpt_model(
    config: TransformerConfig,
    *,
    vocab_size: int,
    max_sequence_length: int,
    position_embedding_type: str = "rope",
    backend: str = "auto",
    pre_process: bool = True,
    post_process: bool = True,
    layer_spec=None,
    tp_overlap: bool = False,
    **gpt_kwargs,
) -> SlimPackGPTModel:
    """A `SlimPackGPTModel` with the SlimPack layer spec (or `layer_spec`); `tp_overlap`: the
    local spec's linears hide their sequence-parallel collectives (tp_overlap.py)."""
    if layer_spec is None:
        normalization = getattr(config, "normalization", "LayerNorm")
        layer_spec = slimpack_layer_spec(backend, normalization=normalization, config=config)
    return SlimPackGPTModel(
        config, layer_spec, vocab_size=vocab_size, max_sequence_length=max_sequence_length,
        position_embedding_type=position_embedding_type, pre_process=pre_process,
        post_process=post_process, tp_overlap=tp_overlap, **gpt_kwargs,
    )


def build_stage_chunks(config: TransformerConfig, *, vpp: int = 1, **build_kwargs) -> list[SlimPackGPTModel]:
    """This pipeline stage's model chunks, one per virtual stage it holds (interleaved 1F1B, as
    `slimpack_forward_backward(model=chunks)` runs them). Chunk c is virtual stage c * pp + pp_rank
    (pp: `config.pipeline_model_parallel_size`; pp_rank: megatron's `parallel_state`, which
    megatron-core's layer offsets read too):
    built with `vp_stage=c`, so megatron-core gives it its own layers, numbered globally (the KV
    store keys K/V by layer number); the embedding only on the first virtual stage, the output
    layer and loss only on the last. `build_kwargs`: as `build_gpt_model`. vpp=1: one chunk, the
    stage's whole model."""
    pp = config.pipeline_model_parallel_size
    if vpp > 1 and config.virtual_pipeline_model_parallel_size != vpp:
        raise ValueError(f"build_stage_chunks(vpp={vpp}) needs config.virtual_pipeline_model_parallel_size={vpp} "
                         f"(megatron-core numbers the chunks' layers by it), not "
                         f"{config.virtual_pipeline_model_parallel_size}")
    from megatron.core import parallel_state

    pp_rank = parallel_state.get_pipeline_model_parallel_rank() if pp > 1 else 0
    return [build_gpt_model(config, pre_process=pp_rank == 0 and chunk == 0,
                            post_process=pp_rank == pp - 1 and chunk == vpp - 1,
                            vp_stage=chunk if vpp > 1 else None, **build_kwargs)
            for chunk in range(vpp)]


def tiny_config(
    *, num_layers: int = 2, hidden_size: int = 64, num_attention_heads: int = 4,
    num_query_groups: Optional[int] = None, ffn_hidden_size: Optional[int] = None, **overrides,
) -> TransformerConfig:
    """A Llama-style fp32 config (RMSNorm, SwiGLU, no biases, dropout off, no fusions) for CPU
    tests, demos and profiling."""
    import torch.nn.functional as F

    options = dict(
        num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups, ffn_hidden_size=ffn_hidden_size or 2 * hidden_size,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        apply_rope_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
    )
    options.update(overrides)
    return TransformerConfig(**options)
