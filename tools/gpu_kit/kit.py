"""The GPU kit's bookkeeping, standard library only (it runs here and on the GPU machine).

    python tools/gpu_kit/kit.py manifest .gpu-kit   # here, after make gpu-kit downloaded: sizes, MANIFEST.json
    python3 tools/gpu_kit/kit.py stale .gpu-kit     # there: does the weightsync wheel match this tree?
    python3 tools/gpu_kit/kit.py plan .gpu-kit      # there: which wheels to install, which to leave

`plan` prints one line per decision, for run.sh to read:
    INSTALL <wheel>    into the machine's python (missing there, or its version misses a requirement)
    OVERLAY <wheel>    torch/grpcio/protobuf too old there: a fallback wheel, on PYTHONPATH for this run only
    KEEP <name> <version>
    WARN <message>
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass, field
from email.parser import HeaderParser
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEVICE_LIMIT_BYTES = 64 << 20
"""What one device call carries: the working tree plus carried folders."""
COMFORT_BYTES = 48 << 20
"""Above this the kit still travels, but a few more wheels would not."""
PROTECTED = ("torch", "grpcio", "protobuf", "numba", "llvmlite", "numpy")
"""The machine's own builds: never installed over (a CUDA torch; grpcio and protobuf the image's;
numba with the llvmlite it was built against, and the numpy both use)."""
SOURCE_SUFFIXES = (".py", ".pyi", ".proto")
RUN_BUDGET_SECONDS = 300
"""run.sh's whole run (GPU_KIT_TOTAL_S): a lent machine is there ~15 minutes, start-up included, so
the first run stays short and a second, corrected one fits on the same warm machine."""
STOP_GRACE_SECONDS = 20
"""What a step stopped at its limit may still take (run.sh: timeout -k 20) to write its results."""
CALL_TIMEOUT_SECONDS = RUN_BUDGET_SECONDS + 3 * STOP_GRACE_SECONDS
"""The device call's timeout_s for one run."""


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# -- the weightsync sources a wheel was built from -----------------------------------------
def package_dirs(root: Path = ROOT) -> list[str]:
    """The folders setuptools maps into the weightsync wheel (pyproject's package-dir)."""
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    dirs = pyproject["tool"]["setuptools"]["package-dir"].values()
    return sorted({d.split("/")[0] for d in dirs})


def source_digest(root: Path = ROOT) -> dict[str, str]:
    """sha256 of every file the wheel is built from (the same walk here and on the GPU machine)."""
    files = [root / "pyproject.toml"]
    for top in package_dirs(root):
        for path in sorted((root / top).rglob("*")):
            parts = path.relative_to(root).parts
            if any(p == "__pycache__" or p.endswith(".egg-info") or p.startswith(".") for p in parts):
                continue
            if path.is_file() and path.suffix in SOURCE_SUFFIXES:
                files.append(path)
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def changed_sources(recorded: dict[str, str], now: dict[str, str]) -> list[str]:
    return sorted(p for p in recorded.keys() | now.keys() if recorded.get(p) != now.get(p))


# -- wheels --------------------------------------------------------------------------------
@dataclass(slots=True)
class Wheel:
    path: Path
    name: str
    version: str
    requires: list[str] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> Wheel:
        name, version = path.name.split("-")[:2]
        with zipfile.ZipFile(path) as archive:
            meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
            headers = HeaderParser().parsestr(archive.read(meta).decode("utf-8"))
        return cls(path, normalize(name), version, headers.get_all("Requires-Dist") or [])


def wheels_in(folder: Path) -> dict[str, Wheel]:
    return {w.name: w for w in map(Wheel.read, sorted(folder.glob("*.whl")))}


def tree_bytes(root: Path = ROOT) -> int:
    """What travels besides carried folders: tracked files and untracked ones git does not ignore."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                cwd=root, check=True, capture_output=True).stdout.split(b"\0")
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum((root / os.fsdecode(p)).stat().st_size for p in listed if p and (root / os.fsdecode(p)).is_file())


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def manifest(kit: Path) -> int:
    """Print the kit's wheels and sizes, write MANIFEST.json; exit 1 if the call would not fit."""
    files = sorted(p for p in kit.rglob("*.whl"))
    if not files:
        print(f"no wheels in {kit}", file=sys.stderr)
        return 1
    sizes = {str(p.relative_to(kit)): p.stat().st_size for p in files}
    kit_total = sum(sizes.values())
    tree = tree_bytes()
    for name, size in sizes.items():
        print(f"  {size / 2**20:7.2f} MiB  {name}")
    total = kit_total + tree
    print(f"kit: {len(files)} wheels, {mib(kit_total)}; with the working tree ({mib(tree)}): {mib(total)} "
          f"of the device's {mib(DEVICE_LIMIT_BYTES)} per call")
    print(f"on the GPU machine: bash tools/gpu_kit/run.sh, carrying {kit.name} (a {RUN_BUDGET_SECONDS} s run: "
          f"give the call timeout_s={CALL_TIMEOUT_SECONDS}; a corrected rerun fits the same machine)")
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = ""
    record = {
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "wheels": sizes,
        "kit_bytes": kit_total,
        "tree_bytes": tree,
        "sources": source_digest(),
    }
    (kit / "MANIFEST.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    if total >= DEVICE_LIMIT_BYTES:
        print(f"DOES NOT FIT: {mib(total)} >= {mib(DEVICE_LIMIT_BYTES)}; carry fewer wheels", file=sys.stderr)
        return 1
    if total > COMFORT_BYTES:
        print(f"WARNING: {mib(total)} leaves little room under {mib(DEVICE_LIMIT_BYTES)}", file=sys.stderr)
    return 0


def stale(kit: Path) -> int:
    """0 when the kit's weightsync wheel was built from the sources in this tree, 1 when not."""
    path = kit / "MANIFEST.json"
    if not path.exists():
        print(f"STALE: {path} is missing (run make gpu-kit)")
        return 1
    changed = changed_sources(json.loads(path.read_text())["sources"], source_digest())
    if changed:
        shown = ", ".join(changed[:10]) + (f" and {len(changed) - 10} more" if len(changed) > 10 else "")
        print(f"STALE: the weightsync wheel was built from other sources: {shown}")
        return 1
    print("fresh: the weightsync wheel was built from these sources")
    return 0


# -- what to install on the GPU machine ------------------------------------------------
def _packaging():
    try:
        from packaging.requirements import Requirement
        from packaging.version import Version
    except ImportError:  # pip vendors it
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.version import Version
    return Requirement, Version


def installed_versions() -> dict[str, str]:
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(normalize(name), dist.version)
    return found


@dataclass(slots=True)
class Plan:
    install: list[Wheel]
    overlay: list[Wheel]
    keep: dict[str, str]
    warnings: list[str]


def _meets(version: str, specifiers: list) -> bool:
    """Whether an installed version meets every specifier (one that does not parse meets none)."""
    _, Version = _packaging()
    try:
        parsed = Version(version)
    except ValueError:  # InvalidVersion is a ValueError
        return False
    return all(s.contains(parsed, prereleases=True) for s in specifiers)


def make_plan(kit: dict[str, Wheel], fallback: dict[str, Wheel], have: dict[str, str],
              extras: tuple[str, ...] = ("", "dev")) -> Plan:
    """Which kit wheels the machine needs.

    Every kit wheel is there because the project or its tests need it. One is installed when the
    machine lacks it, or when the machine's version misses a requirement that weightsync (its
    runtime and `dev` requirements) or another wheel being installed states. The machine's torch,
    grpcio and protobuf are never replaced: when one misses a requirement, its fallback wheel (if
    the kit has one) goes on a private PYTHONPATH for this run, and a warning says so.
    """
    Requirement, _ = _packaging()
    chosen = {n for n in kit if n == "weightsync" or n not in have}
    while True:
        wanted: dict[str, list[tuple[str, object]]] = {}
        for owner in sorted(chosen):
            for line in kit[owner].requires:
                req = Requirement(line)
                names = extras if owner == "weightsync" else ("",)
                if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in names):
                    continue
                wanted.setdefault(normalize(req.name), []).append((owner, req.specifier))
        grown = {n for n, specs in wanted.items() if n in kit and n not in chosen and n in have
                 and not _meets(have[n], [s for _, s in specs])}
        if not grown:
            break
        chosen |= grown
    warnings: list[str] = []
    overlay: list[Wheel] = []
    for name in PROTECTED:
        specs = wanted.get(name, [])
        version = have.get(name)
        missed = [f"{owner} wants {name}{spec}" for owner, spec in specs
                  if version is None or not _meets(version, [spec])]
        if not missed:
            continue
        there = f"the machine has {name} {version}" if version else f"the machine has no {name}"
        if name in fallback:
            overlay.append(fallback[name])
            warnings.append(f"{there}; {'; '.join(missed)}: using the kit's fallback {name} "
                            f"{fallback[name].version} on PYTHONPATH for this run (the machine's stays)")
        else:
            warnings.append(f"{there}; {'; '.join(missed)}: no fallback in the kit, imports may fail")
    for name in sorted(chosen):
        if name in have and name != "weightsync":
            warnings.append(f"replacing the machine's {name} {have[name]} with the kit's {kit[name].version} "
                            f"(asked for: {', '.join(f'{o} {s}' for o, s in wanted.get(name, []))})")
    keep = {n: have[n] for n in kit if n not in chosen}
    warnings += unmet([kit[n] for n in sorted(chosen)] + overlay,
                      dict(have, **{n: kit[n].version for n in chosen}, **{w.name: w.version for w in overlay}))
    return Plan([kit[n] for n in sorted(chosen)], overlay, keep, warnings)


def unmet(wheels: list[Wheel], after: dict[str, str]) -> list[str]:
    """What the wheels being installed ask for that nothing will provide (a kit cannot bring it)."""
    Requirement, _ = _packaging()
    out = []
    for wheel in wheels:
        for line in wheel.requires:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            name = normalize(req.name)
            if name not in after:
                out.append(f"{wheel.name} {wheel.version} needs {req}, which neither the machine nor the kit has")
            elif name not in PROTECTED and not _meets(after[name], [req.specifier]):
                out.append(f"{wheel.name} {wheel.version} needs {req}, and {name} {after[name]} is what it gets")
    return out


def plan(kit_dir: Path) -> int:
    kit = wheels_in(kit_dir)
    if "weightsync" not in kit:
        print(f"WARN no weightsync wheel in {kit_dir} (run make gpu-kit)")
    fallback = wheels_in(kit_dir / "fallback") if (kit_dir / "fallback").is_dir() else {}
    result = make_plan(kit, fallback, installed_versions())
    for name, version in sorted(result.keep.items()):
        print(f"KEEP {name} {version}")
    for message in result.warnings:
        print(f"WARN {message}")
    for wheel in result.overlay:
        print(f"OVERLAY {wheel.path}")
    for wheel in result.install:
        print(f"INSTALL {wheel.path}")
    return 0


def main(argv: list[str]) -> int:
    commands = {"manifest": manifest, "stale": stale, "plan": plan}
    if len(argv) != 2 or argv[0] not in commands:
        print(__doc__, file=sys.stderr)
        return 2
    return commands[argv[0]](Path(argv[1]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
