"""The start-up probe of attention backends (runtime/attention/backend_probe.py), on CPU with stand-in
kernels: a backend that imports but computes wrongly, raises, or cannot be built is passed over,
with the reason; one that agrees with the torch reference is chosen; where none does, the probe
refuses by name (the torch kernel is chosen on a GPU only where it is fused: test_torch_gpu_attention.py)."""
import pytest
import torch

from megatron_slimpack.runtime.attention import backend_probe, kernels
from test_selftest import top_left_kernel  # what flash-attn < 2.1 computes


def raising(*args, **kwargs):
    raise RuntimeError("cuDNN: no THD kernel for this configuration\nmore detail")


def _config():
    from megatron_slimpack.runtime.model import tiny_config

    return tiny_config(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2)


def _choose(monkeypatch, flash_kernel):
    from megatron_slimpack.runtime.attention.core import SlicedDotProductAttention

    monkeypatch.setattr(backend_probe, "available_backends", lambda: ["flash", "torch"])
    monkeypatch.setitem(kernels.KERNELS, "flash", flash_kernel)
    config = _config()
    return backend_probe.choose_backend(
        config, torch.device("cpu"),
        lambda name: SlicedDotProductAttention(config, layer_number=1, attn_mask_type=None, backend=name))


def test_a_backend_that_agrees_with_the_reference_is_chosen(monkeypatch, megatron_cpu):
    choice = _choose(monkeypatch, kernels.torch_kernel)
    assert choice.backend == "flash" and choice.passed_over == {}


def test_a_wrong_backend_is_passed_over_with_the_reason(monkeypatch, megatron_cpu):
    with pytest.raises(backend_probe.NoFusedAttentionBackend) as refused:
        _choose(monkeypatch, top_left_kernel)
    assert "flash: output differs from the torch reference" in str(refused.value)
    assert "Install flash-attn >= 2.1" in str(refused.value)


def test_a_failing_backend_is_passed_over_with_its_error(monkeypatch, megatron_cpu):
    with pytest.raises(backend_probe.NoFusedAttentionBackend,
                       match="flash: RuntimeError: cuDNN: no THD kernel for this configuration"):
        _choose(monkeypatch, raising)


def test_a_backend_that_cannot_be_built_is_passed_over(monkeypatch, megatron_cpu):
    monkeypatch.setattr(backend_probe, "available_backends", lambda: ["te", "flash", "torch"])
    monkeypatch.setitem(kernels.KERNELS, "flash", kernels.torch_kernel)
    config = _config()

    def build(name):
        from megatron_slimpack.runtime.attention.core import SlicedDotProductAttention

        if name == "te":
            raise ImportError("transformer_engine_torch is missing")
        return SlicedDotProductAttention(config, layer_number=1, attn_mask_type=None, backend=name)

    choice = backend_probe.choose_backend(config, torch.device("cpu"), build)
    assert choice.backend == "flash" and "cannot be built: ImportError" in choice.passed_over["te"]
    assert choice.describe().startswith("attention backend flash (passed over: te: cannot be built")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_kernel_passes_its_own_probe(dtype, megatron_cpu):
    from megatron_slimpack.runtime.attention.core import SlicedDotProductAttention

    module = SlicedDotProductAttention(_config(), layer_number=1, attn_mask_type=None, backend="torch")
    assert backend_probe.probe(module, dtype, heads=4, groups=2, head_dim=16, device="cpu") is None


@pytest.mark.parametrize("tp, heads, groups", [(1, 64, 8), (2, 32, 4), (8, 8, 1), (16, 4, 1), (32, 2, 1)])
def test_heads_per_rank_for_every_tp(tp, heads, groups):
    """64 heads in 8 query groups: below 8 ranks the groups are split; above, every rank holds one."""
    from megatron_slimpack.runtime.model import tiny_config

    config = tiny_config(num_layers=1, hidden_size=64 * 8, num_attention_heads=64, num_query_groups=8,
                         tensor_model_parallel_size=tp)
    assert backend_probe.heads_per_rank(config) == (heads, groups)


def test_the_probe_runs_with_fewer_query_groups_than_tp_ranks(monkeypatch, megatron_cpu):
    from megatron_slimpack.runtime.attention.core import SlicedDotProductAttention
    from megatron_slimpack.runtime.model import tiny_config

    config = tiny_config(num_layers=1, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                         tensor_model_parallel_size=4)
    seen = []

    def recording_kernel(q, k, *args, **kwargs):
        seen.append((q.shape[1], k.shape[1]))
        return kernels.torch_kernel(q, k, *args, **kwargs)

    monkeypatch.setattr(backend_probe, "available_backends", lambda: ["flash", "torch"])
    monkeypatch.setitem(kernels.KERNELS, "flash", recording_kernel)
    single = tiny_config(num_layers=1, hidden_size=64, num_attention_heads=8, num_query_groups=2)
    choice = backend_probe.choose_backend(
        config, torch.device("cpu"),
        lambda name: SlicedDotProductAttention(single, layer_number=1, attn_mask_type=None, backend=name))
    assert choice.backend == "flash" and seen and set(seen) == {(2, 1)}
