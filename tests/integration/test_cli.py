"""The weightsync CLI end to end, through subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from models import mixed_model

pytestmark = pytest.mark.timeout(240)


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "weightsync.client.cli.main", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    model = {k: v.contiguous() for k, v in mixed_model(41).items() if v.dtype != torch.float8_e5m2}
    names = sorted(model)
    shard1 = {n: model[n] for n in names[: len(names) // 2]}
    shard2 = {n: model[n] for n in names[len(names) // 2 :]}
    save_file(shard1, root / "model-1.safetensors")
    save_file(shard2, root / "model-2.safetensors")
    changed = dict(shard2)
    changed["step"] = torch.tensor(123456, dtype=torch.int64)
    save_file(changed, root / "model-2-changed.safetensors")
    (root / "corrupt.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    return root


def test_push_verify_info_groups(server, checkpoints):
    shards = ["--checkpoint", str(checkpoints / "model-1.safetensors"), "--checkpoint", str(checkpoints / "model-2.safetensors")]
    pushed = cli("push", *shards, "--to", server.address, "--version", "cli-1", "--bucket-size-mb", "1")
    assert pushed.returncode == 0, pushed.stderr
    assert pushed.stdout.startswith("pushed cli-1: ")
    assert "verify ok" in pushed.stdout

    verified = cli("verify", *shards, "--to", server.address)
    assert verified.returncode == 0, verified.stderr
    assert verified.stdout.strip().startswith("verified ")

    changed = ["--checkpoint", str(checkpoints / "model-1.safetensors"), "--checkpoint", str(checkpoints / "model-2-changed.safetensors")]
    differs = cli("verify", *changed, "--to", server.address)
    assert differs.returncode == 1
    assert "step" in differs.stdout
    assert differs.stderr.strip().splitlines() == ["weightsync: verify failed: 1 tensors differ"]

    info = cli("info", "--server", server.address, "--json")
    assert info.returncode == 0, info.stderr
    described = json.loads(info.stdout)
    assert described["storeState"] == "STORE_STATE_CONSISTENT"
    assert described["currentVersion"]["version"] == "cli-1"
    assert len(described["workers"]) == 2

    table = cli("info", "--server", server.address)
    assert "STORE_STATE_CONSISTENT" in table.stdout and "cli-1" in table.stdout

    groups = cli("groups", "--server", server.address, "--json")
    assert groups.returncode == 0
    assert json.loads(groups.stdout) == []  # the push deleted its group on exit


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["push", "--to", "127.0.0.1:1", "--version", "v"], "UNAVAILABLE"),
        (["push", "--to", "{server}", "--version", "v", "--checkpoint-override", "corrupt"], "not a valid safetensors file"),
        (["push", "--to", "{server}", "--version", "v", "--checkpoint-override", "missing"], "no such file"),
        (["verify", "--to", "127.0.0.1:1"], "UNAVAILABLE"),
    ],
)
def test_failures_are_one_line_and_non_zero(server, checkpoints, args, needle):
    checkpoint = str(checkpoints / "model-1.safetensors")
    argv = [a.replace("{server}", server.address) for a in args]
    if "--checkpoint-override" in argv:
        i = argv.index("--checkpoint-override")
        kind = argv[i + 1]
        del argv[i : i + 2]
        checkpoint = str(checkpoints / ("corrupt.safetensors" if kind == "corrupt" else "absent.safetensors"))
    result = cli(*argv, "--checkpoint", checkpoint, "--timeout", "10")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("weightsync: ")
    assert needle in lines[0]


# -- what the CLI says when it cannot do its job ---------------------------------
def test_a_scheme_in_the_address_says_drop_it(server):
    result = cli("info", "--server", f"http://{server.address}")
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert "has a scheme (http://): drop it and write host:port" in line


def test_a_reader_that_goes_away_gets_no_traceback(server):
    # `true` exits without reading: every write of the CLI meets a closed pipe.
    result = subprocess.run(f"{sys.executable} -m weightsync.client.cli.main info --server {server.address} | true",
                            shell=True, capture_output=True, text=True, timeout=60)
    assert result.stderr == ""


def test_info_json_prints_zero_values_too(server):
    described = json.loads(cli("info", "--server", server.address, "--json").stdout)
    assert [w["index"] for w in described["workers"]] == [0, 1]
    assert all(w["restartCount"] == "0" for w in described["workers"])


def test_push_delta_against_a_base_checkpoint(server, checkpoints):
    """`weightsync push --delta auto --base OLD`: the servers hold OLD, so only what differs moves
    (here one scalar); a base the servers do not hold sends the whole checkpoint, and verifies."""
    old = ["--checkpoint", str(checkpoints / "model-1.safetensors"), "--checkpoint", str(checkpoints / "model-2.safetensors")]
    new = ["--checkpoint", str(checkpoints / "model-1.safetensors"),
           "--checkpoint", str(checkpoints / "model-2-changed.safetensors")]
    base = ["--base", str(checkpoints / "model-1.safetensors"), "--base", str(checkpoints / "model-2.safetensors")]
    assert cli("push", *old, "--to", server.address, "--version", "base", "--transport", "inline").returncode == 0
    pushed = cli("push", *new, "--to", server.address, "--version", "delta", "--transport", "inline",
                 "--delta", "auto", *base)
    assert pushed.returncode == 0, pushed.stderr
    assert "base held by 1 of 1 server(s)" in pushed.stderr
    sent, dense = (int(w) for w in pushed.stdout.split(" bytes (dense ")[0].split()[-1:] +
                   pushed.stdout.split("(dense ")[1].split(")")[:1])
    assert sent < 1024 < dense and "verify ok" in pushed.stdout
    # The servers now hold `new`: `old` as a base is refused per tensor, and the push goes dense.
    again = cli("push", *old, "--to", server.address, "--version", "back", "--transport", "inline", *base)
    assert again.returncode == 0, again.stderr
    assert "base held by 0 of 1 server(s)" in again.stderr and "verify ok" in again.stdout
