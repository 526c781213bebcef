"""A megatron-core GPTModel that runs SlimPack MicroPacks.

Two changes to `GPTModel`: for a sliced THD batch (`SlicedSeqParams`) the rotary table is
built from each token's absolute position (see rope.py) instead of restarting per segment; and
under sequence parallelism torch norms are swapped for ones that support it (norm.py).
Everything else, weights and state-dict keys included, is megatron's, so a checkpoint moves
freely between this model and a stock one.
"""
from __future__ import annotations

from typing import Optional

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from .attention import SlicedSeqParams, slimpack_layer_spec
from .norm import sequence_parallel_spec
from .rope import rotary_freqs_at, slice_positions


class SlimPackGPTModel(GPTModel):
    def __init__(self, config: TransformerConfig, transformer_layer_spec, *args, **kwargs):
        spec = sequence_parallel_spec(transformer_layer_spec, config, vp_stage=kwargs.get("vp_stage"))
        super().__init__(config, spec, *args, **kwargs)

    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                    packed_seq_params=None, **kwargs):
        outputs = super()._preprocess(input_ids, position_ids, decoder_input=decoder_input,
                                      inference_context=inference_context,
                                      packed_seq_params=packed_seq_params, **kwargs)
        if self.position_embedding_type == "rope" and isinstance(packed_seq_params, SlicedSeqParams):
            if self.config.apply_rope_fusion:
                raise ValueError("SlimPack needs apply_rope_fusion=False: the fused THD RoPE restarts at 0 per slice")
            freqs = rotary_freqs_at(self.rotary_pos_emb, slice_positions(packed_seq_params))
            outputs = (outputs[0], freqs, *outputs[2:])
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
    **gpt_kwargs,
) -> SlimPackGPTModel:
    """A `SlimPackGPTModel` with the SlimPack layer spec (or `layer_spec`)."""
    if layer_spec is None:
        normalization = getattr(config, "normalization", "LayerNorm")
        layer_spec = slimpack_layer_spec(backend, normalization=normalization, config=config)
    return SlimPackGPTModel(
        config, layer_spec, vocab_size=vocab_size, max_sequence_length=max_sequence_length,
        position_embedding_type=position_embedding_type, pre_process=pre_process,
        post_process=post_process, **gpt_kwargs,
    )


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
