"""One line describing the machine the figures come from."""

from __future__ import annotations

import os
import platform

import torch


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def ram_gib() -> float:
    try:
        with open("/proc/meminfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def describe() -> dict:
    return {
        "cores": os.cpu_count(),
        "ram_gib": round(ram_gib(), 1),
        "cpu_model": cpu_model(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


def one_line(m: dict) -> str:
    return (f"{m['cores']} cores, {m['ram_gib']:.0f} GiB RAM, {m['cpu_model']}, torch {m['torch']}, "
            f"Python {m['python']}; CPU tensors over Gloo on loopback (CPU/Gloo figures, not GPU/NCCL)")


class LoadSampler:
    """Samples the 1-minute load average every `interval` seconds in a daemon thread:
    the machine is shared, and the spread says how much to trust the figures."""

    def __init__(self, interval: float = 2.0) -> None:
        import threading

        self.samples: list[float] = []
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.samples.append(round(os.getloadavg()[0], 2))
            except OSError:
                return

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def summary(self) -> dict:
        s = sorted(self.samples)
        if not s:
            return {}
        return {"samples": len(s), "min": s[0], "median": s[len(s) // 2], "max": s[-1]}
