"""weightsync benchmarks: `python -m bench` (full) or `python -m bench --quick`.

Modes, run alternately on the same workloads:
  raw        the transport alone: plain ProcessGroupGloo broadcasts of the same
             bucket sizes between preallocated, touched buffers (the limit);
  weightsync the SDK and a real server with worker processes, end to end;
  concat     pack with torch.cat, fresh receive buffer per bucket, unpack with
             slicing + copy_, one control round trip per bucket;
  per_tensor one control round trip and one broadcast per tensor.
Results go to bench/results/ (latest.json, latest.md, PNG plots).
"""
