"""engine_kwargs.weightsync as verl passes them: every wrong or unknown entry is CONFIG_INVALID naming it,
when the engine is built (a table); an outcome host that does not resolve, or is not actor rank 0's,
is CONFIG_INVALID at once where TCPStore would retry its connection for the whole timeout; a token the
node's server refuses is CONFIG_INVALID on the rollout (its reason as cause_reason), and the same
rollout with the right token reads the next step."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("verl.checkpoint_engine", reason="verl is not installed here: run make test-verl")

import torch  # noqa: E402

from weightsync.client import WeightSyncClient  # noqa: E402
from weightsync.integrations.verl import (  # noqa: E402
    VerlSyncConfig,
    WeightSyncCheckpointEngine,
    WeightSyncVerlError,
)

from helpers import start_server  # noqa: E402

pytestmark = pytest.mark.timeout(600)
GOOD = {"servers": ["127.0.0.1:50051"]}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({**GOOD, "timeout": 5, "bucket": 1}, "bucket, timeout: not a key weightsync reads; its keys are delta, engine, "
                                          "mode, node_server, outcome_host, receive, senders, servers, timeout_s, "
                                          "token, transport"),
    ({**GOOD, "timeout_s": "soon"}, "timeout_s must be a number of seconds in (0, 86400], got 'soon'"),
    ({**GOOD, "timeout_s": float("inf")}, "timeout_s must be a number of seconds in (0, 86400], got inf"),
    ({**GOOD, "timeout_s": float("nan")}, "timeout_s must be a number of seconds in (0, 86400], got nan"),
    ({**GOOD, "timeout_s": 1e300}, "timeout_s must be a number of seconds in (0, 86400], got 1e+300"),
    ({**GOOD, "timeout_s": 0}, "timeout_s must be a number of seconds in (0, 86400], got 0"),
    ({**GOOD, "timeout_s": True}, "timeout_s must be a number of seconds in (0, 86400], got True"),
    ({**GOOD, "timeout_s": [5]}, "timeout_s must be a number of seconds in (0, 86400], got [5]"),
    ({**GOOD, "token": 1234}, "token must be a string of printable ASCII without spaces (the servers' bearer token), "
                              "got a int"),
    ({**GOOD, "token": "two words"}, "token must be a string of printable ASCII without spaces (the servers' bearer "
                                     "token), got a str with other characters"),
    ({**GOOD, "delta": ["on"]}, "delta must be auto, on/true or off/false, got ['on']"),
    ({**GOOD, "delta": "maybe"}, "delta must be auto, on/true or off/false, got 'maybe'"),
    ({"servers": 50051}, "servers must be a list of host:port, got int"),
    ({"servers": [50051]}, "servers must be host:port strings, got 50051"),
    ({"servers": []}, "servers is required (host:port of each rollout node's weightsync server)"),
    ({}, "servers is required (host:port of each rollout node's weightsync server)"),
    ({"servers": ["http://a:1"]}, "servers: server address 'http://a:1' has a scheme (http://): drop it and write "
                                  "host:port"),
    ({**GOOD, "node_server": 7}, "node_server must be host:port strings, got 7"),
    ({**GOOD, "transport": ["inline"]}, "transport must be one of ('collective', 'inline', 'shm'), got ['inline']"),
    ({**GOOD, "mode": "staging"}, "mode must be one of ('staged', 'in_place'), got 'staging'"),
    ({**GOOD, "senders": 2}, "senders must be one of ('auto', 'all', 'one'), got 2"),
    ({**GOOD, "receive": None}, "receive must be one of ('tensors', 'served'), got None"),
    ({**GOOD, "outcome_host": ""}, "outcome_host must be a host name or address, got ''"),
    ({**GOOD, "outcome_host": 10}, "outcome_host must be a host name or address, got 10"),
    ({**GOOD, "engine": ""}, "engine must be an engine's name, got ''"),
])
def test_a_wrong_or_unknown_entry_is_config_invalid_naming_it(kwargs: dict, message: str) -> None:
    with pytest.raises(WeightSyncVerlError) as raised:
        WeightSyncCheckpointEngine(bucket_size=1 << 20, is_master=True, **kwargs)
    assert (raised.value.reason, str(raised.value)) == ("CONFIG_INVALID",
                                                        f"CONFIG_INVALID: engine_kwargs.weightsync.{message}")


def test_good_entries_are_read_as_given() -> None:
    config = VerlSyncConfig.from_engine_kwargs(servers="a:1", timeout_s="2.5", delta="ON", token="", senders="all")
    assert (config.servers, config.timeout_s, config.delta, config.token, config.senders) == (
        ("a:1",), 2.5, True, None, "all")


@pytest.mark.parametrize(("host", "why"), [
    ("no-such-host.invalid", "outcome_host 'no-such-host.invalid' does not resolve"),
    ("192.0.2.1", "outcome_host '192.0.2.1' (192.0.2.1) is not an address of actor rank 0's host, where the outcome "
                  "store listens: name this host as the other actor ranks and the rollout workers reach it"),
])
def test_an_outcome_host_rank_0_cannot_listen_at_is_config_invalid_at_prepare_at_once(host: str, why: str) -> None:
    engine = WeightSyncCheckpointEngine(bucket_size=1 << 20, is_master=True, outcome_host=host, timeout_s=120, **GOOD)
    started = time.monotonic()
    with pytest.raises(WeightSyncVerlError) as raised:
        engine.prepare()
    assert time.monotonic() - started < 60  # not the 120 s TCPStore retries a connection for
    assert raised.value.reason == "CONFIG_INVALID"
    assert str(raised.value).startswith(f"CONFIG_INVALID: engine_kwargs.weightsync.{why}"), str(raised.value)
    engine.close()


def test_an_outcome_store_whose_host_does_not_resolve_is_config_invalid_on_the_others_at_once() -> None:
    engine = WeightSyncCheckpointEngine(bucket_size=1 << 20, timeout_s=120, **GOOD)
    started = time.monotonic()
    with pytest.raises(WeightSyncVerlError) as raised:
        engine.init_process_group(role="rollout", rank=0, world_size=1, outcome_store="no-such-host.invalid:4000",
                                  sync="run-1", actor_world=1)
    assert time.monotonic() - started < 60
    assert raised.value.reason == "CONFIG_INVALID"
    assert str(raised.value).startswith("CONFIG_INVALID: rollout 0: engine_kwargs.weightsync.outcome_host "
                                        "'no-such-host.invalid' does not resolve"), str(raised.value)
    engine.close()


def test_a_token_the_node_refuses_is_config_invalid_on_the_rollout_then_the_right_one_reads(tmp_path) -> None:
    """The rollout alone has the wrong token (a refusal of the actors' pushes is PUSH_FAILED, typed by the
    server's reason): CONFIG_INVALID at init_process_group, its cause TOKEN_INVALID (it was EngineError,
    raw, out of receive_weights). Built again with the right token, the rollout reads the step."""
    import asyncio

    token_file = tmp_path / "token"
    token_file.write_text("right-token\n")
    server = start_server(tmp_path, "--token-file", str(token_file), workers=1)
    engines: list[WeightSyncCheckpointEngine] = []
    try:
        kwargs = {"servers": [server.address], "transport": "inline", "senders": "one", "timeout_s": 60}
        weights = {"w": torch.arange(12, dtype=torch.float32)}
        for token in ("wrong-token", "right-token"):
            actor = WeightSyncCheckpointEngine(bucket_size=1 << 20, is_master=True, token="right-token", **kwargs)
            rollout = WeightSyncCheckpointEngine(bucket_size=1 << 20, token=token, **kwargs)
            engines += [actor, rollout]
            actor_kwargs, rollout_kwargs = WeightSyncCheckpointEngine.build_topology(1, 1, [actor.prepare(), {}])
            actor.init_process_group(**{k: v[0] for k, v in actor_kwargs.items()})
            if token == "wrong-token":
                with pytest.raises(WeightSyncVerlError) as raised:
                    rollout.init_process_group(**{k: v[0] for k, v in rollout_kwargs.items()})
                assert (raised.value.reason, raised.value.cause_reason) == ("CONFIG_INVALID", "TOKEN_INVALID")
                assert str(raised.value).startswith(f"CONFIG_INVALID: rollout worker 0: the node's server "
                                                    f"{server.address} refused it: TOKEN_INVALID: "), str(raised.value)
                continue
            rollout.init_process_group(**{k: v[0] for k, v in rollout_kwargs.items()})

            async def step(actor=actor, rollout=rollout):
                async def receive() -> dict:
                    return {n: t.clone() async for n, t in rollout.receive_weights(global_steps=1)}
                return await asyncio.gather(actor.send_weights(iter(weights.items()), global_steps=1), receive())

            metrics, received = asyncio.run(step())
            assert set(metrics) == {"weightsync/push_s", "weightsync/bytes_sent", "weightsync/dense_bytes"}
            assert torch.equal(received["w"], weights["w"]), received
        with WeightSyncClient(server.address, token="right-token") as client:
            assert client.verify(weights).ok
    finally:
        for engine in engines:
            engine.close()
        server.stop()
