"""The schedule's gradient reduction without a finalize function equals megatron-core's
finalize_model_grads, tied word embeddings included.

A GPTModel with `share_embeddings_and_output_weights=True` split over two pipeline stages holds
two copies of the word embedding: the first stage's input embedding and the last stage's output
layer. Each stage's backward gives its copy only its own share of the gradient; the whole
gradient is their sum over Megatron's embedding group. Every case runs as a plain module (the
schedule's own reduction), as a Megatron DDP chunk without a finalize function (the same), and as
a DDP chunk with `finalize_model_grads` (Megatron's trainer), tied and untied, with PP=2 and
PP=2 x VPP=2, and is compared with the whole-document reference (fp32).
"""
import pytest
import torch

from conftest import init_megatron, run_multiprocess, save_whole_document_reference

VOCAB = 64
PP = 2
LAYERS = 4
WAYS = ("plain", "ddp", "ddp-finalize")  # the model as the schedule gets it; finalize function or not


def _config(**overrides):
    from megatron_slimpack.runtime.model import tiny_config

    return tiny_config(num_layers=LAYERS, hidden_size=32, num_attention_heads=4, num_query_groups=2, **overrides)


def make_case(vpp: int, seed: int = 3):
    """A plan over two stages with sliced documents and asymmetric units (test_schedule's random
    case, or test_virtual_stages' sliced case in interleaved orders) + its documents."""
    if vpp == 1:
        from test_schedule import make_case as pipeline_case

        return pipeline_case(seed, pp=PP, dp=1)
    from test_virtual_stages import make_sliced_case

    return make_sliced_case(seed, asymmetric=True)


def _reference_name(name: str, stage: int, chunk: int, vpp: int, tied: bool) -> str:
    """A chunk parameter's name in the one-stage reference: layers numbered globally, and a tied
    output layer's weight is the reference's embedding."""
    prefix = "decoder.layers."
    if name.startswith(prefix):
        local, rest = name[len(prefix):].split(".", 1)
        per_chunk = LAYERS // (PP * vpp)
        return f"{prefix}{(chunk * PP + stage) * per_chunk + int(local)}.{rest}"
    if tied and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    return name


def _stage_models(saved_state: dict, vpp: int, stage: int, tied: bool, way: str):
    """(the chunks as the schedule gets them, the inner chunks) with the reference's weights."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from megatron_slimpack.runtime.model import build_stage_chunks

    virtual = dict(virtual_pipeline_model_parallel_size=vpp) if vpp > 1 else {}
    config = _config(pipeline_model_parallel_size=PP, pipeline_dtype=torch.float32, calculate_per_token_loss=True,
                     **virtual)
    chunks = build_stage_chunks(config, vpp=vpp, vocab_size=VOCAB, max_sequence_length=64, backend="torch",
                                share_embeddings_and_output_weights=tied)
    for index, chunk in enumerate(chunks):
        chunk.load_state_dict({name: saved_state[_reference_name(name, stage, index, vpp, tied)]
                               for name in chunk.state_dict()})
    if way == "plain":
        return chunks, chunks
    models = [DistributedDataParallel(config, DistributedDataParallelConfig(), chunk) for chunk in chunks]
    if way == "ddp-finalize":
        config.finalize_model_grads_func = finalize_model_grads
    return models, chunks


def tied_worker(rank, world_size, port, vpp, paths):
    from megatron.core import parallel_state

    from megatron_slimpack.runtime import InMemoryTokenSource
    from megatron_slimpack.runtime.pipeline.schedule import slimpack_forward_backward

    init_megatron(rank, world_size, pp=PP, port=port)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    plan, documents = make_case(vpp)
    for tied, path in paths.items():
        saved = torch.load(path)
        for way in WAYS:
            models, chunks = _stage_models(saved["state"], vpp, stage, tied, way)
            if tied:  # each stage holds a copy of the word embedding
                assert any(c.shared_embedding_or_output_weight() is not None for c in chunks)
            slimpack_forward_backward(model=models, plan=plan, token_source=InMemoryTokenSource(documents))
            for index, chunk in enumerate(chunks):
                for name, p in chunk.named_parameters():
                    grad = p.grad if way == "plain" else p.main_grad
                    want = saved["grads"][_reference_name(name, stage, index, vpp, tied)]
                    error = ((grad - want).norm() / want.norm().clamp_min(1e-30)).item()
                    assert error <= 1e-5, (f"{'tied' if tied else 'untied'} {way}, stage {stage} chunk {index}: "
                                           f"{name} relative gradient error {error:.2e}")


def _run(tmp_path, vpp: int):
    from megatron_slimpack.runtime.pipeline.executor import global_loss_tokens

    plan, documents = make_case(vpp)
    paths = {}
    for tied in (True, False):
        paths[tied] = str(tmp_path / f"reference_tied{tied}.pt")
        save_whole_document_reference(_config(), VOCAB, documents, global_loss_tokens(plan), paths[tied],
                                      share_embeddings_and_output_weights=tied)
    run_multiprocess(tied_worker, PP, vpp, paths, timeout_s=240)


@pytest.mark.slow
def test_tied_and_untied_embeddings_two_stages(tmp_path, megatron_cpu):
    _run(tmp_path, vpp=1)


@pytest.mark.slow
def test_tied_and_untied_embeddings_virtual_stages(tmp_path, megatron_cpu):
    _run(tmp_path, vpp=2)


# ---- refusals: before anything runs, with a named error ---------------------------------------
def _one_stage_model():
    from megatron_slimpack.runtime.model import build_gpt_model

    return build_gpt_model(_config(), vocab_size=VOCAB, max_sequence_length=64, backend="torch")


@pytest.mark.parametrize("setting, message", [
    (dict(num_moe_experts=4), "mixture-of-experts"),
    (dict(mtp_num_layers=1), "multi-token prediction"),
])
def test_fallback_refuses_what_it_cannot_reduce(megatron_cpu, setting, message):
    from megatron_slimpack.runtime import InMemoryTokenSource
    from megatron_slimpack.runtime.pipeline.schedule import FallbackReductionError, slimpack_forward_backward

    plan, documents = make_case(1)
    plan = plan.__class__([plan.replicas[0]], plan.samples, plan.parallel.with_(pp=1), 16, "test")
    plan.replicas[0].stage_orders = plan.replicas[0].stage_orders[:1]
    model = _one_stage_model()
    for key, value in setting.items():
        setattr(model.config, key, value)  # as if built so: the check reads the config
    with pytest.raises(FallbackReductionError, match=f"{message}.*finalize_model_grads_func"):
        slimpack_forward_backward(model=model, plan=plan, token_source=InMemoryTokenSource(documents))
    assert all(p.grad is None for p in model.parameters())


def test_fallback_refuses_a_reduction_it_does_not_know(megatron_cpu, monkeypatch):
    """A later release's finalize_model_grads that calls a reduction the fallback does not take."""
    from megatron_slimpack.runtime import InMemoryTokenSource
    from megatron_slimpack.runtime.pipeline import schedule

    monkeypatch.setattr(schedule, "_finalize_steps", lambda: {"_allreduce_word_embedding_grads",
                                                              "_allreduce_new_thing_grads"})
    plan, documents = make_case(1)
    with pytest.raises(schedule.FallbackReductionError, match="also calls _allreduce_new_thing_grads"):
        schedule.slimpack_forward_backward(model=_one_stage_model(), plan=plan,
                                           token_source=InMemoryTokenSource(documents))
