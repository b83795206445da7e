"""Make gpu-kit, tools/gpu_kit/run.sh and bench.gpu, without a GPU.

The kit's list must follow pyproject.toml: every dependency but the GPU machine's own (torch,
grpcio, protobuf, numba, llvmlite, numpy), pytest and pytest-timeout, and what each of them pulls
in, pinned to versions the project accepts. The install plan never replaces the machine's own. bench.gpu's argument
parsing, model shapes and report are plain Python.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import time
import tomllib
import zipfile
from pathlib import Path

import pytest
import torch
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "gpu_kit"))

import kit  # noqa: E402

from bench import gpu  # noqa: E402

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
GPU_PYTHON = dict(default_environment(), python_version="3.12", python_full_version="3.12.3",
                  sys_platform="linux", platform_system="Linux", platform_machine="x86_64",
                  implementation_name="cpython", platform_python_implementation="CPython")


def pins(path: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) of a hash-pinned requirements file."""
    text = path.read_text().replace("\\\n", " ")
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        spec, *options = line.split()
        name, version = spec.split("==")
        out[kit.normalize(name)] = (version, [o.removeprefix("--hash=") for o in options])
    return out


def planned(path: Path) -> set[str]:
    return {kit.normalize(n.strip()) for line in path.read_text().splitlines() if line.startswith("# planned:")
            for n in line.removeprefix("# planned:").split(",")}


KIT = pins(ROOT / "tools/gpu_kit/requirements.txt")
FALLBACK = pins(ROOT / "tools/gpu_kit/fallback.txt")
PROJECT = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
TESTS = [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["dev"]
         if kit.normalize(Requirement(r).name) in ("pytest", "pytest-timeout")]


def requirements_of(name: str) -> list[Requirement]:
    """What an installed distribution asks for on the GPU machine's Python (no extras)."""
    out = []
    for line in md.requires(name) or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(dict(GPU_PYTHON, extra="")):
            out.append(req)
    return out


def test_every_line_is_pinned_to_one_hashed_file():
    for name, (version, hashes) in {**KIT, **FALLBACK}.items():
        assert Version(version), name
        assert hashes and all(h.startswith("sha256:") and len(h) == 71 for h in hashes), name


def test_the_kit_is_pyproject_less_the_machines_own_plus_what_they_pull_in():
    wanted = {kit.normalize(r.name): r.specifier for r in PROJECT + TESTS}
    for name in kit.PROTECTED:
        wanted.pop(name, None)  # torch, grpcio, protobuf, numba are in pyproject; llvmlite, numpy come with numba
    for name, specifier in wanted.items():
        assert name in KIT, f"{name} (pyproject) is missing from tools/gpu_kit/requirements.txt"
        assert specifier.contains(KIT[name][0]), f"{name}=={KIT[name][0]} misses pyproject's {specifier}"
    # What each kit package pulls in (read from this environment's installed copies).
    pulled: dict[str, list[SpecifierSet]] = {}
    for name in KIT:
        try:
            reqs = requirements_of(name)
        except md.PackageNotFoundError:
            continue
        for req in reqs:
            pulled.setdefault(kit.normalize(req.name), []).append(req.specifier)
    for name, specifiers in pulled.items():
        if name in kit.PROTECTED:
            continue
        assert name in KIT, f"{name} is pulled in by a kit package but is not in the kit"
        assert all(s.contains(KIT[name][0]) for s in specifiers), f"{name}=={KIT[name][0]} misses {specifiers}"
    extra = set(KIT) - set(wanted) - set(pulled) - planned(ROOT / "tools/gpu_kit/requirements.txt")
    assert not extra, f"in the kit, but neither in pyproject nor pulled in nor planned: {sorted(extra)}"
    assert not set(KIT) & set(kit.PROTECTED)


def test_no_kit_wheel_asks_for_more_grpcio_than_the_fallback_and_the_project_floor():
    floor = next(r for r in PROJECT if r.name == "grpcio").specifier
    fallback = FALLBACK["grpcio"][0]
    assert floor.contains(fallback) and set(FALLBACK) == {"grpcio", "protobuf"}
    assert next(r for r in PROJECT if r.name == "protobuf").specifier.contains(FALLBACK["protobuf"][0])
    for name in ("grpcio-health-checking", "grpcio-reflection", "grpcio-status"):
        assert Version(KIT[name][0]) <= Version(fallback), name


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_gpu_kit_downloads_these_files_for_cpython_3_12():
    recipe = subprocess.run(["make", "-n", "gpu-kit"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    downloads = [line for line in recipe.splitlines() if " pip download " in line]
    assert len(downloads) == 2
    for line in downloads:
        for flag in ("--no-deps", "--only-binary=:all:", "--require-hashes", "--python-version 3.12",
                     "--platform manylinux_2_17_x86_64", "--platform manylinux2014_x86_64"):
            assert flag in line
    assert "-d .gpu-kit -r tools/gpu_kit/requirements.txt" in downloads[0]
    assert "-d .gpu-kit/fallback -r tools/gpu_kit/fallback.txt" in downloads[1]
    assert "kit.py manifest .gpu-kit" in recipe
    assert ".gpu-kit/" in (ROOT / ".gitignore").read_text().splitlines()


# -- the install plan ----------------------------------------------------------------------
def wheel(name: str, version: str, *requires: str) -> kit.Wheel:
    return kit.Wheel(Path(f"{name}-{version}-py3-none-any.whl"), kit.normalize(name), version, list(requires))


KIT_WHEELS = {w.name: w for w in (
    wheel("weightsync", "0.2.0", "torch>=2.4", "grpcio>=1.85.1", "protobuf>=7.36.2", "structlog>=24.1",
          "pytest>=8; extra == \"dev\"", "ruff>=0.6; extra == \"dev\"", "requests>=2.32; extra == \"trl\""),
    wheel("grpcio-health-checking", "1.85.1", "grpcio>=1.85.1", "protobuf<8.0.0,>=7.35.1"),
    wheel("structlog", "26.1.0"),
    wheel("pytest", "9.2.0", "pluggy<2,>=1.6", "iniconfig>=2"),
    wheel("pluggy", "1.7.0"),
    wheel("iniconfig", "2.3.1"),
)}
FALLBACK_WHEELS = {w.name: w for w in (wheel("grpcio", "1.85.1", "typing-extensions~=4.12"), wheel("protobuf", "7.36.2"))}


def test_the_plan_installs_what_is_missing_and_keeps_what_fits():
    have = {"torch": "2.11.0+cu130", "grpcio": "1.86.0", "protobuf": "7.36.3", "pytest": "9.0.1",
            "pluggy": "1.6.0", "iniconfig": "2.0.0", "grpcio-health-checking": "1.70.0"}
    plan = kit.make_plan(KIT_WHEELS, FALLBACK_WHEELS, have)
    assert [w.name for w in plan.install] == ["structlog", "weightsync"]
    assert plan.keep == {"grpcio-health-checking": "1.70.0", "pytest": "9.0.1", "pluggy": "1.6.0",
                         "iniconfig": "2.0.0"}
    assert not plan.overlay and not plan.warnings


def test_an_old_pytest_brings_its_new_requirements_and_torch_is_never_installed():
    have = {"torch": "2.11.0", "grpcio": "1.85.1", "protobuf": "7.36.2", "pytest": "7.4.0", "pluggy": "1.0.0",
            "iniconfig": "2.0.0", "structlog": "25.1.0", "grpcio-health-checking": "1.85.1"}
    plan = kit.make_plan(KIT_WHEELS, FALLBACK_WHEELS, have)
    assert [w.name for w in plan.install] == ["pluggy", "pytest", "weightsync"]
    assert any("replacing the machine's pytest 7.4.0" in w for w in plan.warnings)
    assert all(w.name not in kit.PROTECTED for w in plan.install)


def test_an_old_grpcio_or_protobuf_gets_the_fallback_on_pythonpath_not_installed():
    have = {"torch": "2.11.0", "grpcio": "1.78.0", "protobuf": "6.33.0", "structlog": "26.1.0"}
    plan = kit.make_plan(KIT_WHEELS, FALLBACK_WHEELS, have)
    assert sorted(w.name for w in plan.overlay) == ["grpcio", "protobuf"]
    assert "grpcio" not in [w.name for w in plan.install]
    grpc_warning = next(w for w in plan.warnings if "grpcio 1.78.0" in w)
    assert "grpcio-health-checking wants grpcio>=1.85.1" in grpc_warning and "fallback grpcio 1.85.1" in grpc_warning
    assert any("grpcio 1.85.1 needs typing-extensions~=4.12, which neither" in w for w in plan.warnings)
    plan = kit.make_plan(KIT_WHEELS, FALLBACK_WHEELS, dict(have, **{"typing-extensions": "4.15.0"}))
    assert not any("typing-extensions" in w for w in plan.warnings)
    plan = kit.make_plan(KIT_WHEELS, {}, {"torch": "2.4.0", "grpcio": "1.60.0", "protobuf": "7.36.2"})
    assert not plan.overlay and any("no fallback" in w for w in plan.warnings)


def test_the_source_digest_follows_pyprojects_package_dirs_and_sees_a_change():
    digest = kit.source_digest()
    assert {"pyproject.toml", "client/sdk.py", "engine/client.py", "protos/weightsync/v1/tensor_pb2.py"} <= set(digest)
    assert not any("__pycache__" in p or p.startswith("tests/") for p in digest)
    changed = dict(digest, **{"client/sdk.py": "0" * 64, "client/new.py": "1" * 64})
    assert kit.changed_sources(digest, changed) == ["client/new.py", "client/sdk.py"]


def seconds_to_import_torch() -> float:
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.monotonic() - started


def test_run_sh_parses_and_its_dry_run_prints_the_plan(tmp_path):
    assert subprocess.run(["bash", "-n", str(ROOT / "tools/gpu_kit/run.sh")]).returncode == 0
    folder = tmp_path / "kit"
    folder.mkdir()
    for name, requires in (("weightsync", ["structlog>=24.1"]), ("structlog", [])):
        with zipfile.ZipFile(folder / f"{name}-99.0-py3-none-any.whl", "w") as archive:
            archive.writestr(f"{name}-99.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: " + name
                             + "\nVersion: 99.0\n" + "".join(f"Requires-Dist: {r}\n" for r in requires))
    out = tmp_path / "out"
    # The versions line and the info step each wait for an import of torch (and a few short interpreters): their
    # limit follows what that import takes on this machine now, and the run's budget follows them.
    info_s = math.ceil(3 * seconds_to_import_torch()) + 30
    total = 2 * info_s + 60 + 100  # versions, info, the plan (60), and what the run keeps for pytest and the bench
    env = dict(os.environ, OUT=str(out), GPU_PY=sys.executable, GPU_KIT=str(folder), GPU_KIT_DRY_RUN="1",
               GPU_KIT_INFO_S=str(info_s), GPU_KIT_TOTAL_S=str(total))
    done = subprocess.run(["bash", str(ROOT / "tools/gpu_kit/run.sh")], env=env, capture_output=True, text=True,
                          timeout=total + 3 * kit.STOP_GRACE_SECONDS)
    assert done.returncode == 0, done.stdout + done.stderr
    log = (out / "run.log").read_text()
    assert f"=== info (at most {info_s}s) ===" in log
    assert f"INSTALL {folder}/weightsync-99.0-py3-none-any.whl" in log
    assert "KEEP structlog" in log and "+ pip install --no-index --no-deps" in log
    summary = (out / "summary.txt").read_text().splitlines()
    # First the versions every figure of the run comes from (none here: no CUDA), then the steps.
    assert summary[0] == f"versions {(out / 'versions.txt').read_text().strip()}"
    assert summary[0].startswith("versions no CUDA device, driver ") and f"torch {torch.__version__}, CUDA " in summary[0]
    assert summary[0].endswith(", NCCL -") or torch.cuda.is_available()
    assert summary[1].split()[:2] == ["info", "ok"] and summary[2].split()[:2] == ["plan", "ok"]


def test_the_kit_run_is_short_enough_for_a_corrected_second_run():
    """One lent machine, ~15 minutes in all with its start-up (minutes): two runs and the start must fit."""
    text = (ROOT / "tools/gpu_kit/run.sh").read_text()
    assert f"TOTAL=${{GPU_KIT_TOTAL_S:-{kit.RUN_BUDGET_SECONDS}}}" in text and kit.RUN_BUDGET_SECONDS == 300
    assert f"timeout -s INT -k {kit.STOP_GRACE_SECONDS} " in text
    assert 2 * kit.CALL_TIMEOUT_SECONDS + 3 * 60 <= 15 * 60
    # A small bench by default: well under the budget the run keeps for it.
    assert "BENCH_ARGS=${GPU_KIT_BENCH_ARGS:---gb 0.25 --reps 2}" in text
    args = gpu.parse_args(["--out", "x", "--gb", "0.25", "--reps", "2"])
    shapes = gpu.model_shapes(int(args.gb * gpu.GB))
    assert sum(gpu._numel(s) for _, s in shapes) * gpu.DTYPE_BYTES < 0.35 * gpu.GB  # the embedding and one layer


def first_run_tests() -> list[str]:
    return [line.strip() for line in (ROOT / "tools/gpu_kit/tests.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def test_the_kits_pytest_runs_the_one_gpu_list_with_a_low_nonblocking_timeout():
    """docs/gpus.md's one-GPU list, by default, in the time the run keeps for pytest; every id names a test that
    collects here; torch's TORCH_NCCL_NONBLOCKING_TIMEOUT lowered for the tests' processes (a communicator that
    never forms lingers that long); the tests' measurements kept in $OUT."""
    text = (ROOT / "tools/gpu_kit/run.sh").read_text()
    assert "TESTS=${GPU_KIT_TESTS:-$(grep -v '^#' tools/gpu_kit/tests.txt" in text and '$TESTS \\' in text
    assert "export TORCH_NCCL_NONBLOCKING_TIMEOUT=${TORCH_NCCL_NONBLOCKING_TIMEOUT:-20}" in text
    assert 'export GPU_KIT_MEASURES="$OUT/measures.jsonl"' in text
    listed = (ROOT / "tools/gpu_kit/tests.txt").read_text()
    estimates = [int(line.split("~")[1].split()[0]) for line in listed.splitlines() if line.startswith("# ~")]
    assert estimates and sum(estimates) <= 225 and "PYTEST_S=${GPU_KIT_PYTEST_S:-225}" in text
    tests = first_run_tests()
    for must in ("tests/gpu/test_nccl_one_gpu.py::", "tests/gpu/test_nccl_pairs.py", "tests/gpu/test_host_memory.py",
                 "tests/gpu/test_nccl_parts.py::test_two_parts_on_the_workers_gpu_push_over_one_gloo_group",
                 "tests/gpu/test_gpu_parts.py"):
        assert any(t.startswith(must) for t in tests), must
    collected = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                                "-p", "no:randomly", *tests], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    ids = [line for line in collected.stdout.splitlines() if "::" in line]
    for test in tests:
        assert any(i == test or i.startswith(test + "::") or i.startswith(test + "[") for i in ids), test
    # The tests that abort a communicator with a kernel still queued run last: a fault would be sticky for the
    # context, and every test after them would fail for the wrong reason (review H3, F9).
    assert ids[-2:] == [
        "tests/gpu/test_nccl_one_gpu.py::test_a_broadcast_that_outlasts_the_group_timeout_fails_at_it_and_close_stays_bounded",
        "tests/gpu/test_nccl_pairs.py::test_a_failed_receives_cached_blocks_wait_for_its_kernel_and_the_abort_is_answered_at_once",
    ], ids[-4:]


def dedented_scripts() -> list[tuple[str, int, str]]:
    """(file, line, script) of every textwrap.dedent(<a string>) under tests/gpu: the child processes' scripts."""
    found = []
    for path in sorted((ROOT / "tests/gpu").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "dedent"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "textwrap"):
                [argument] = node.args
                assert isinstance(argument, ast.Constant), f"{path.name}:{node.lineno}: not a plain string"
                found.append((path.name, node.lineno, textwrap.dedent(argument.value)))
    return found


def test_every_script_the_gpu_tests_run_in_a_child_compiles():
    """A child's script that does not compile fails every child at once, and only on the lent machine (one line
    left at column 0 keeps dedent from removing the indentation of the others)."""
    scripts = dedented_scripts()
    assert len(scripts) >= 5 and {"test_host_memory.py", "test_nccl_pairs.py"} <= {name for name, _, _ in scripts}
    for name, line, script in scripts:
        compile(script, f"{name}:{line}", "exec")


def test_a_run_out_of_time_skips_its_steps_rather_than_overrun(tmp_path):
    """Each step's limit is what is left less what the steps after it keep: with too small a budget the
    steps are skipped (and the run fails), never started past the budget."""
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), GPU_PY=sys.executable, GPU_KIT=str(tmp_path / "none"),
               GPU_KIT_DRY_RUN="1", GPU_KIT_TOTAL_S="100")
    done = subprocess.run(["bash", str(ROOT / "tools/gpu_kit/run.sh")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    summary = (out / "summary.txt").read_text().splitlines()
    assert [line.split()[:2] for line in summary[1:]] == [["info", "SKIPPED"], ["plan", "SKIPPED"]]


# -- bench.gpu -------------------------------------------------------------------------------
def test_bench_gpu_arguments():
    args = gpu.parse_args(["--out", "x"])
    assert (args.out, args.gb, args.reps, args.bucket_mib, args.workers) == (Path("x"), 1.5, 5, 128, 1)
    with pytest.raises(SystemExit):
        gpu.parse_args([])
    with pytest.raises(SystemExit):
        gpu.parse_args(["--out", "x", "--gb", "100"])
    with pytest.raises(SystemExit):
        gpu.parse_args(["--out", "x", "--reps", "0"])


def test_bench_gpu_ingress_slots_hold_the_largest_tensor():
    embedding = gpu.VOCAB * gpu.HIDDEN * gpu.DTYPE_BYTES
    assert gpu.ingress_slot_bytes(128 << 20, embedding) == 260 << 20
    assert gpu.ingress_slot_bytes(512 << 20, embedding) == 512 << 20


@pytest.mark.parametrize("gb", [0.05, 1.0, 1.5, 2.0])
def test_bench_gpu_model_is_about_the_size_asked_with_hundreds_of_tensors(gb):
    shapes = gpu.model_shapes(int(gb * gpu.GB))
    size = sum(gpu._numel(s) for _, s in shapes) * gpu.DTYPE_BYTES
    assert len({n for n, _ in shapes}) == len(shapes)
    if gb >= 1:
        assert abs(size - gb * gpu.GB) < 0.02 * gb * gpu.GB and 250 <= len(shapes) <= 700
    else:
        assert len(shapes) == 14  # the embedding alone is 0.27 GB: one layer at least


def made_up_results() -> dict:
    size = int(1.5 * gpu.GB)
    push = gpu.section("push", {"d2h_pinned": [0.06, 0.061, 0.059], "d2h_pageable": [0.3, 0.31, 0.29],
                                "push_inline": [1.2, 1.1, 1.3], "push_shm": [0.5, 0.45, 0.55]}, size)
    engine = gpu.section("engine", {"h2d_pinned": [0.055, 0.056, 0.054], "h2d_pageable": [0.25, 0.26, 0.24],
                                    "engine_apply_pinned": [0.3, 0.28, 0.32],
                                    "engine_apply_pageable": [0.5, 0.52, 0.48]}, size)
    return {"machine": {"gpu": "NVIDIA H100 80GB HBM3", "cores": 16, "torch": "2.11.0+cu130", "cuda": "13.0",
                        "nccl": "2.28.9", "python": "3.12.3"},
            "model": {"tensors": 494, "bytes": size, "dtype": "bfloat16", "layers": 41},
            "config": {"reps": 3, "bucket_bytes": 128 << 20, "workers": 1, "ingress_slot_bytes": 260 << 20},
            "sections": [push, engine], "verified": {"server holds the pushed bytes (verify)": True}}


def test_bench_gpu_report_on_made_up_numbers(tmp_path):
    results = made_up_results()
    push = {r["mode"]: r for r in results["sections"][0]["runs"]}
    assert push["d2h_pinned"]["x_baseline"] == 1.0 and push["push_inline"]["x_baseline"] == 20.0
    assert push["push_shm"]["gbps"] == 3.0 and push["push_inline"]["median_seconds"] == 1.2
    js, md_path = gpu.write(results, tmp_path / "out")
    assert json.loads(js.read_text()) == results
    text = md_path.read_text()
    assert "## Trainer -> server: CUDA tensors into a CPU worker's store" in text
    assert "| push_inline | 1.2000 | 1.25 | 20.00 |  |" in text
    # Each engine mode against the section's baseline (pinned) and against the copy from its own kind of memory.
    assert "| engine_apply_pinned | 0.3000 | 5.00 | 5.46 | 5.46 (h2d_pinned) |" in text  # 0.3 / 0.055
    assert "| engine_apply_pageable | 0.5000 | 3.00 | 9.09 | 2.00 (h2d_pageable) |" in text  # 0.5 / 0.25
    assert "device='cuda:0'), store mapping pinned" in text and "device='cpu'), store mapping pageable" in text
    assert "Machine: NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, CUDA 13.0, NCCL 2.28.9; 16 cores" in text
    assert "494 bf16 tensors, 1.50 GB" in text and "verify) ok" in text
    assert "ingress slots of 260 MiB; buckets of 128 MiB" in text and "Medians of 3 after" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the bench would run")
def test_bench_gpu_skips_without_cuda(tmp_path, capsys):
    assert gpu.main(["--out", str(tmp_path / "out")]) == 0
    assert "skipped: no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def test_bench_gpu_names_the_nccl_it_ran_with():
    version = gpu.nccl_version()
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        assert version.count(".") >= 2 and version.split(".")[0].isdigit(), version
    else:
        assert version == "-"
