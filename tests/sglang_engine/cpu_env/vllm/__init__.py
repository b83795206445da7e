"""A stand-in for the one piece of vLLM SGLang 0.5.23 imports on this CPU: test environment only.

SGLang's RotaryEmbedding, built without its CPU engine (SGLANG_USE_CPU_ENGINE, which needs the
sgl-kernel CPU build), takes its fallback kernel from `vllm._custom_ops` while the model is
built. The tests never run a forward pass (it cannot run here), so the kernel is never called;
installing vLLM beside SGLang for this import would pull another torch. sglang_server.py puts
this directory first on the SGLang server's PYTHONPATH; nothing else sees it.
"""
