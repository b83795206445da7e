"""PATCH_XOR kernels on their own: `python -m bench.patch_kernels [--workload dense|single] [--reps 5]`.

Per density (0.1% .. 50% of bf16 elements changed, spread at random; one-ulp steps up or down,
as a small AdamW step moves bf16 weights, or random new bits):
  - bytes per changed element and the patch as % of the dense bytes;
  - the trainer's compare_and_encode on 1 and 2 threads, and compare_many (the SDK's batch), also
    with advance_base (the same pass bringing the kept copy up to date, as the SDK runs it), in GB/s
    of the two inputs read, against
    torch copy_ of the same bytes into memory already touched, in this process (medians);
  - the current torch path (common.patches: changes_between + smallest_encoding + encode_patch)
    on the same tensors;
  - the receiver's check_patch and apply_patch, ns per changed element (tensors spread over 1
    or 2 threads), and apply_checked (both in one pass, what a worker runs);
  - zstandard level 1 on the encoded patches: ratio, MB/s each way, and when it pays on a
    1 and a 10 Gbit/s link.
Also the kernels' cold JIT cost (an empty numba cache) and its warm-cache load, in subprocesses.
Writes bench/results/patch_kernels.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import zstandard

from bench import workloads
from bench.harness import median
from bench.progress import log
from weightsync.common import patch_kernels as pk
from weightsync.common.patches import changes_between, encode_patch, gaps_of, smallest_encoding

DENSITIES = (0.001, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.5)
LINKS_GBIT = (1, 10)
RESULTS = Path(__file__).parent / "results" / "patch_kernels.md"


def model(kind: str) -> dict[str, torch.Tensor]:
    if kind == "single":
        g = torch.Generator().manual_seed(0)
        return {"w": (torch.randn(128 << 20, generator=g) * 0.02).to(torch.bfloat16)}
    return workloads.dense(1.0).materialize(seed=0)


def step(base: dict[str, torch.Tensor], density: float, values: str, seed: int) -> tuple[dict[str, torch.Tensor], int]:
    """base with `density` of its elements changed: by one ulp (bits +-1) or to random bits."""
    g = torch.Generator().manual_seed(seed)
    new, changed = {}, 0
    for name, tensor in base.items():
        t = tensor.clone()
        bits = t.view(-1).view(torch.int16)
        where = torch.nonzero(torch.rand(bits.numel(), generator=g) < density).reshape(-1)
        if values == "ulp":
            bits[where] += (torch.randint(0, 2, (where.numel(),), generator=g, dtype=torch.int16) * 2 - 1)
        else:
            bits[where] = torch.randint(-(1 << 15), 1 << 15, (where.numel(),), generator=g, dtype=torch.int16)
        changed += int((bits != tensor.view(-1).view(torch.int16)).sum())
        new[name] = t
    return new, changed


def timed(call, reps: int) -> float:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return median(times)


def timed_together(calls: dict[str, object], reps: int) -> dict[str, list[float]]:
    """Each call once per repetition, in turn: a neighbour's load then slows all of them alike
    (ratios are taken per repetition, then the median)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(reps):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - started)
    return times


def over_tensors(call, names: list[str], threads: int, pool: ThreadPoolExecutor) -> None:
    """call(name) for every tensor, on `threads` threads (largest first, so they finish together)."""
    if threads == 1:
        for name in names:
            call(name)
    else:
        list(pool.map(call, names))


def torch_path(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    """What client/delta/base.py does today for a tensor it patches."""
    for name, tensor in new.items():
        changes = changes_between(base[name], tensor)
        gaps = gaps_of(changes.positions)
        choice = smallest_encoding(changes.positions, tensor.numel(), tensor.element_size(), gaps=gaps)
        out = torch.empty(choice.size_bytes, dtype=torch.uint8)
        encode_patch(tensor, changes.positions, choice.encoding, out, values=changes.values, gaps=gaps)


def zstd_row(patches: dict[str, pk.EncodedPatch], reps: int) -> dict:
    compressor, decompressor = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    raw = {n: p.data.numpy().tobytes() for n, p in patches.items()}
    packed = {n: compressor.compress(r) for n, r in raw.items()}
    size, zsize = sum(map(len, raw.values())), sum(map(len, packed.values()))
    tc = timed(lambda: [compressor.compress(r) for r in raw.values()], reps)
    td = timed(lambda: [decompressor.decompress(z) for z in packed.values()], reps)
    pays = []
    for gbit in LINKS_GBIT:
        rate = gbit * 1e9 / 8
        plain = size / rate
        serial = tc + zsize / rate + td  # compress all, send, decompress all
        streamed = max(tc, zsize / rate, td)  # chunk by chunk, the three stages overlapped
        pays.append(f"{plain * 1e3:.0f} / {serial * 1e3:.0f} / {streamed * 1e3:.0f} ms")
    return {"ratio": size / max(zsize, 1), "c_mbs": size / tc / 1e6, "d_mbs": size / td / 1e6, "pays": pays}


def cold_jit() -> tuple[float, float]:
    """Seconds for import + warm_up() with an empty numba cache, then with that cache filled."""
    code = ("import time; t = time.perf_counter(); from weightsync.common import patch_kernels as pk; "
            "pk.warm_up(); print(time.perf_counter() - t)")
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        runs = [float(subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True,
                                     text=True).stdout) for _ in range(3)]
    base = float(subprocess.run([sys.executable, "-c", "import time; t = time.perf_counter(); import numba, torch; "
                                 "print(time.perf_counter() - t)"], check=True, capture_output=True, text=True).stdout)
    return runs[0] - base, median(runs[1:]) - base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("dense", "single"), default="dense")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--densities", type=float, nargs="*", default=DENSITIES)
    args = parser.parse_args()
    pk.warm_up()
    cold, warm = cold_jit()
    log("jit", cold_s=f"{cold:.2f}", warm_s=f"{warm:.2f}")
    base = model(args.workload)
    names = sorted(base, key=lambda n: -base[n].numel())
    dense_bytes = sum(t.numel() * t.element_size() for t in base.values())
    scratch = {n: torch.empty_like(t) for n, t in base.items()}
    scratch2 = {n: torch.empty_like(t) for n, t in base.items()}
    pool = ThreadPoolExecutor(2)

    def memcpy(new: dict[str, torch.Tensor]) -> None:
        for n in names:
            scratch[n].copy_(base[n])
            scratch2[n].copy_(new[n])

    memcpy(base)
    memcpy_alone = timed(lambda: memcpy(base), args.reps)
    rows = []
    for density in args.densities:
        for values in ("ulp", "random"):
            rows.append(measure(base, names, density, values, args.reps, pool, memcpy))
    report = render(rows, args.workload, dense_bytes, cold, warm, memcpy_alone)
    print(report)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(report)
    log("wrote", path=str(RESULTS))


def measure(base: dict[str, torch.Tensor], names: list[str], density: float, values: str, reps: int,
            pool: ThreadPoolExecutor, memcpy) -> dict:
    """One row: the trainer's and the receivers' times for one step of `density` changes."""
    new, changed = step(base, density, values, seed=int(density * 1e6))
    log("density", changed=f"{100 * changed / sum(t.numel() for t in base.values()):.2f}%", values=values)
    patches = {n: pk.compare_and_encode(base[n], new[n], 2) for n in names}
    assert sum(p.count for p in patches.values()) == changed
    target = {n: t.clone() for n, t in base.items()}
    moving, toward_new = {n: t.clone() for n, t in base.items()}, [True]

    def advance() -> None:  # the kept copy made the new tensors, then the base again: the same changes each time
        goal = new if toward_new[0] else base
        pk.compare_many([(moving[n], goal[n], None) for n in names], 2, advance_base=True)
        toward_new[0] = not toward_new[0]

    def check(name: str) -> None:
        pk.check_patch(patches[name].data, base[name], base[name].numel(), 2, patches[name].count, live_ws64=0)

    def apply(name: str) -> None:  # flips target between base and new
        pk.apply_patch(patches[name].data, target[name], patches[name].count)

    def fused(name: str) -> None:  # checked while it applies (what a worker runs): flips it too
        pk.apply_checked(patches[name].data, target[name], patches[name].count, live_ws64=0)

    calls = {
        "copy": lambda: memcpy(new),
        "enc1": lambda: [pk.compare_and_encode(base[n], new[n], 1) for n in names],
        "enc2": lambda: [pk.compare_and_encode(base[n], new[n], 2) for n in names],
        "many2": lambda: pk.compare_many([(base[n], new[n], None) for n in names], 2),
        "adv2": advance,
        "check1": lambda: over_tensors(check, names, 1, pool),
        "check2": lambda: over_tensors(check, names, 2, pool),
        "apply1": lambda: over_tensors(apply, names, 1, pool),
        "apply2": lambda: over_tensors(apply, names, 2, pool),
        "fused1": lambda: over_tensors(fused, names, 1, pool),
    }
    if values == "ulp":
        calls["torch"] = lambda: torch_path(base, new)
    times = timed_together(calls, reps)
    row = {"density": density, "values": values, "changed": changed,
           "bytes": sum(p.data.numel() for p in patches.values())}
    row.update({name: median(t) for name, t in times.items()})
    row["x_memcpy"] = median([c / e for c, e in zip(times["copy"], times["many2"], strict=True)])
    if "torch" in times:
        row["x_torch"] = median([t / e for t, e in zip(times["torch"], times["many2"], strict=True)])
    row["zstd"] = zstd_row(patches, max(1, reps // 2))
    return row


def render(rows: list[dict], workload: str, dense_bytes: int, cold: float, warm: float, memcpy_alone: float) -> str:
    read = 2 * dense_bytes
    lines = [
        "# PATCH_XOR kernels (`python -m bench.patch_kernels`)",
        "",
        f"Machine: {os.cpu_count()} cores ({platform.processor() or platform.machine()}), torch {torch.__version__} "
        f"({torch.get_num_threads()} intra-op threads), numba {_version('numba')}, Python {platform.python_version()}. "
        f"Workload: {workload}, {dense_bytes / 1e9:.2f} GB bf16 in {'one tensor' if workload == 'single' else '291 tensors'}; "
        "medians. The machine is shared: expect +-20% between runs.",
        "",
        f"JIT: import + warm_up() costs {cold:.1f} s with an empty numba cache (compiles every kernel for 4 element "
        f"widths) and {warm:.2f} s once cached (beyond importing torch and numba).",
        "",
        "Trainer: `compare` = compare_and_encode over every tensor, GB/s of both inputs read: `1t` one thread, "
        "`2t split` each tensor split over 2 threads, `2t whole` = compare_many, the tensors shared out whole "
        "between 2 threads (the columns after it are its), `+ copy` = the same with advance_base, the pass also "
        "writing the changes into the kept copy (what the SDK runs). Every timing of a "
        "row is taken in turn within each repetition (a neighbour's load slows them alike); ratios are per "
        "repetition, then the median. `x memcpy`: torch copy_ of both inputs into touched memory (the same "
        "bytes read), its time over compare_many's; `x memcpy b2b`: compare_many's GB/s over "
        f"memcpy's timed back to back at the start ({read / memcpy_alone / 1e9:.1f} GB/s, its best case); "
        "`ns/chg` = compare_many's whole time per changed element; `torch` = the common.patches reference "
        "path (changes_between, smallest_encoding, encode_patch). Receiver: ns per changed element, "
        "check_patch (validate + WS64, no write) and apply_patch (in place), the tensors on 1 or 2 threads; "
        "`checked apply` = apply_checked, the one pass a worker runs for a patch it applies now (validate, WS64 "
        "and write), against check then apply (two passes), one thread.",
        "",
        "| changed | values | B/changed | % dense | compare 1t GB/s | 2t split GB/s | 2t whole GB/s | + copy GB/s | x memcpy "
        "| x memcpy b2b | ns/chg | torch s | x torch | check ns 1t / 2t | apply ns 1t / 2t | checked apply ns 1t |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        count = max(r["changed"], 1)
        enc1, enc2, many = read / r["enc1"] / 1e9, read / r["enc2"] / 1e9, read / r["many2"] / 1e9
        torch_s, x_torch = r.get("torch"), r.get("x_torch", 0.0)
        lines.append(
            f"| {100 * r['density']:g}% | {r['values']} | {r['bytes'] / count:.2f} | {100 * r['bytes'] / dense_bytes:.2f}% "
            f"| {enc1:.1f} | {enc2:.1f} | {many:.1f} | {read / r['adv2'] / 1e9:.1f} | {r['x_memcpy']:.2f} | {many / (read / memcpy_alone / 1e9):.2f} "
            f"| {r['many2'] / count * 1e9:.1f} | {f'{torch_s:.2f}' if torch_s else '-'} "
            f"| {f'{x_torch:.1f}x' if torch_s else '-'} "
            f"| {r['check1'] / count * 1e9:.1f} / {r['check2'] / count * 1e9:.1f} "
            f"| {r['apply1'] / count * 1e9:.1f} / {r['apply2'] / count * 1e9:.1f} "
            f"| {r['fused1'] / count * 1e9:.1f} |")
    memcpy_gbs = median([read / r["copy"] / 1e9 for r in rows])
    lines += ["", f"memcpy (torch copy_, both inputs): {memcpy_gbs:.1f} GB/s read taken in turn with the rows' "
              f"other timings (median over the rows), {read / memcpy_alone / 1e9:.1f} GB/s back to back.", "",
              "zstandard level 1 on the encoded patches, each tensor's patch alone, one thread. Link columns: the "
              "patches' time on the link raw / compressed one stage after the other (compress, send, decompress) / "
              "compressed with the three stages overlapped chunk by chunk (the slowest stage):", "",
              "| changed | values | ratio | compress MB/s | decompress MB/s | 1 Gbit/s raw / serial / streamed "
              "| 10 Gbit/s raw / serial / streamed |",
              "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        z = r["zstd"]
        lines.append(f"| {100 * r['density']:g}% | {r['values']} | {z['ratio']:.3f} | {z['c_mbs']:.0f} | {z['d_mbs']:.0f} "
                     f"| {z['pays'][0]} | {z['pays'][1]} |")
    return "\n".join(lines) + "\n"


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
