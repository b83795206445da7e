"""vLLM's greedy logprobs for the TRL toy's fixed prompt, from a cold start (tests/engines/test_trl_grpo.py).

    python tests/engines/trl_cold.py MODEL_DIR     # prints one line: COLD {"tokens": [...], "logprobs": [...]}

A process of its own, offline vLLM started from MODEL_DIR (the trainer's saved weights) with
the flags of examples/trl_grpo/run.py's server: the same weights, dtype and logprobs mode give
the same numbers, to the bit, as the API server once it serves the same version.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

MAX_TOKENS = 8
TOP_LOGPROBS = 5


def cold_logprobs(model_dir: str) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "trl_grpo"))
    import trl_toy
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=256,
              kv_cache_memory_bytes=64 << 20, seed=0, logprobs_mode="processed_logprobs")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS, detokenize=False)
    output = llm.generate([TokensPrompt(prompt_token_ids=trl_toy.FIXED_PROMPT)], params, use_tqdm=False)[0].outputs[0]
    return {"tokens": list(output.token_ids),
            "logprobs": [{str(token): entry.logprob for token, entry in position.items()}
                         for position in output.logprobs]}


if __name__ == "__main__":
    print("COLD " + json.dumps(cold_logprobs(sys.argv[1])), flush=True)
