"""See __init__.py: only imported while SGLang builds its rotary embeddings; never called."""


def rotary_embedding(*args, **kwargs):
    raise NotImplementedError("tests/sglang_engine/cpu_env: no rotary kernel here (SGLang cannot generate on this CPU)")
