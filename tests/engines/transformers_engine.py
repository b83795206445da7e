"""A plain-PyTorch engine process: a transformers Qwen2ForCausalLM kept at the node's version.

    python tests/engines/transformers_engine.py HOST:PORT OUT.jsonl STOP_FILE

Starts from random weights of its own (seed 99, never pushed), then loops until STOP_FILE
exists: `ModuleFollower.update()` (applies a newer committed version between forward passes),
one forward pass over tiny_model.PROMPTS, and one JSON line per step with the version it
served and the SHA-256 of the logits' bytes. The test compares those digests with logits the
trainer's own model gives for each version: they must be bit-for-bit equal, and never torn.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tiny_model  # noqa: E402

SEED_NEVER_PUSHED = 99


def logits_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the fp32 logits for every prompt (one thread: the same reduction order as the test)."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for prompt in tiny_model.PROMPTS:
            logits = model(input_ids=torch.tensor([prompt])).logits.float().contiguous()
            digest.update(logits.numpy().tobytes())
    return digest.hexdigest()


def main(address: str, out_path: str, stop_path: str) -> int:
    from weightsync.engine import EngineClient, ModuleFollower

    torch.set_num_threads(1)
    model = tiny_model.model(SEED_NEVER_PUSHED)
    with EngineClient(server=address, name="transformers") as client, open(out_path, "w") as out:
        follower = ModuleFollower(client, model)
        print("ENGINE READY", flush=True)
        while not os.path.exists(stop_path):
            applied = follower.update()
            out.write(json.dumps({"version": follower.applied_version, "generation": follower.applied_generation,
                                  "applied": applied, "digest": logits_digest(model)}) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
