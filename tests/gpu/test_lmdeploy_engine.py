"""A real LMDeploy 0.18.0 PyTorch engine on a GPU loading the node's versions (what CPU CI cannot run:
LMDeploy's engine refuses device_type "cpu"; tests/lmdeploy_engine runs its model classes on CPU).

One GPU, LMDeploy's single-process executor, started with weightsync's custom module map on a tiny
Qwen2 (bf16) from seed 0. A trainer pushes seed 1's weights to a real server; the engine loads them
in process (weightsync.engine.lmdeploy.pipeline.load_into_pipeline: LMDeploy's own load_weights
and its own finalisation of an external update) and its greedy tokens must equal those of an
engine cold-started from seed 1's checkpoint. A version with a tensor the model lacks is refused
(TENSOR_NOT_IN_MODEL) and the tokens do not move; the next push (seed 2) loads and matches seed 2's
cold engine. Both the hot and the cold engine run the same LMDeploy kernels on the same GPU.

Skips with the reason where LMDeploy or CUDA is missing (the lent GPU machine has no package
registry; LMDeploy's wheel, about 106 MB, is over what a run can carry there).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lmdeploy.pytorch.engine", reason="LMDeploy is not installed in this environment (the GPU "
                    "engine test needs lmdeploy==0.18.0 with its CUDA torch: pip install 'weightsync[lmdeploy]')")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: LMDeploy's PyTorch engine refuses device_type 'cpu'", allow_module_level=True)

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig  # noqa: E402
from lmdeploy.pytorch.engine import Engine  # noqa: E402

from weightsync.engine.lmdeploy import MODULE_MAP_PATH, UpdateRequest  # noqa: E402
from weightsync.engine.lmdeploy.loader import AttachConfig, LoadError  # noqa: E402
from weightsync.engine.lmdeploy.pipeline import load_into_pipeline  # noqa: E402
from weightsync.v1 import weight_sync_service_pb2 as pb  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines"))
import tiny_model  # noqa: E402

from helpers import sdk_client  # noqa: E402

MAX_TOKENS = 12


def write_tokenizer(directory: str) -> None:
    """A word-level tokenizer over the tiny model's vocabulary ("t0" ... "t1023"): LMDeploy's model
    agent loads one from the model directory (the test itself sends token ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(tiny_model.SIZES["tiny"]["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(directory)


def start(directory: str) -> Engine:
    config = PytorchEngineConfig(custom_module_map=MODULE_MAP_PATH, eager_mode=True, cache_max_entry_count=0.05,
                                 session_len=256, max_batch_size=4, distributed_executor_backend="uni")
    return Engine.from_pretrained(directory, engine_config=config)


def generate(engine: Engine) -> list[list[int]]:
    instance = engine.create_instance()
    tokens = []
    for session, prompt in enumerate(tiny_model.PROMPTS, start=1):
        out = instance.infer(session, prompt, gen_config=GenerationConfig(max_new_tokens=MAX_TOKENS, do_sample=False,
                                                                          ignore_eos=True))
        tokens.append(list(out.token_ids))
        instance.end(session)
    return tokens


def cold_tokens(directory: str) -> list[list[int]]:
    engine = start(directory)
    try:
        return generate(engine)
    finally:
        engine.close()


@pytest.mark.gpu
def test_a_running_lmdeploy_engine_serves_what_was_pushed_like_a_cold_start(cpu_server, tmp_path):
    seeds = {seed: tiny_model.weights(seed) for seed in (0, 1, 2)}
    dirs = {seed: tiny_model.save(tmp_path / f"seed{seed}", state) for seed, state in seeds.items()}
    for directory in dirs.values():
        write_tokenizer(directory)
    cold = {seed: cold_tokens(dirs[seed]) for seed in (1, 2)}
    assert cold[1] != cold[2]  # the check can tell the versions apart
    config = AttachConfig(server=cpu_server.address, engine_name="lmdeploy-gpu")
    engine = start(dirs[0])
    try:
        assert type(engine.executor.model_agent.patched_model.get_model()).__module__ == "weightsync.engine.lmdeploy.models"
        before = generate(engine)
        assert before != cold[1]
        with sdk_client(cpu_server) as trainer:
            g1 = trainer.push(seeds[1], version="s1", transport="inline", allow_new_tensors=True).servers[0].generation
            stats = load_into_pipeline(engine, UpdateRequest(generation=g1), config)
            assert stats.tensors == len(seeds[1])
            assert generate(engine) == cold[1]
            bad = {"model.layers.0.self_attn.extra.weight": torch.ones(4, 4, dtype=torch.bfloat16)}
            g2 = trainer.push(bad, version="bad", transport="inline", allow_new_tensors=True).servers[0].generation
            with pytest.raises(LoadError) as refused:
                load_into_pipeline(engine, UpdateRequest(generation=g2, since_generation=g1), config)
            assert refused.value.reason == "TENSOR_NOT_IN_MODEL"
            assert generate(engine) == cold[1]
            g3 = trainer.push(seeds[2], version="s2", transport="inline").servers[0].generation
            stats = load_into_pipeline(engine, UpdateRequest(generation=g3, since_generation=g1), config)
            assert stats.skipped == ["model.layers.0.self_attn.extra.weight"]
            assert generate(engine) == cold[2]
        info = {e.name: e for e in cpu_server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).engines}
        assert info["lmdeploy-gpu"].applied_version.generation == g3
    finally:
        engine.close()
