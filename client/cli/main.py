"""`weightsync`: the command line.

    weightsync serve --workers 2 --device cpu
    weightsync info --server host:port [--json]
    weightsync groups --server host:port
    weightsync push --checkpoint model.safetensors --to host:port[,host:port] --version v
    weightsync verify --checkpoint model.safetensors --to host:port

Exit code 0 on success; otherwise 1 and one line on stderr saying why.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import grpc
from google.protobuf import json_format

from weightsync.common.address import parse_address
from weightsync.v1 import weight_sync_service_pb2 as pb


def _client_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token-file", help="file holding the bearer token")
    parser.add_argument("--tls-ca", help="CA bundle (PEM) that signed the server certificate; enables TLS")
    parser.add_argument("--tls-cert", help="client certificate (PEM), for mutual TLS")
    parser.add_argument("--tls-key", help="client key (PEM), for mutual TLS")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds for RPCs and the rendezvous")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weightsync", description="Push model weights into weightsync servers.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run a server (same flags as weightsync-server)", add_help=False)
    info = sub.add_parser("info", help="describe a server")
    info.add_argument("--server", required=True)
    info.add_argument("--json", action="store_true", help="print GetServerInfo as JSON")
    _client_args(info)
    groups = sub.add_parser("groups", help="list a server's transfer groups")
    groups.add_argument("--server", required=True)
    groups.add_argument("--json", action="store_true")
    _client_args(groups)
    for name, text in (("push", "push a checkpoint"), ("verify", "compare a checkpoint with the servers' weights")):
        command = sub.add_parser(name, help=text)
        command.add_argument("--checkpoint", action="append", required=True, help="a .safetensors file (repeatable)")
        command.add_argument("--to", required=True, help="host:port[,host:port...]")
        _client_args(command)
        if name == "push":
            command.add_argument("--version", required=True, help="version label, e.g. step-42")
            command.add_argument("--mode", choices=("in_place", "staged"), default="in_place")
            command.add_argument("--bucket-size-mb", type=int, default=256)
            command.add_argument("--allow-new-tensors", action="store_true")
            command.add_argument("--no-verify", action="store_true", help="skip the checksum comparison after commit")
            command.add_argument("--transport", choices=("collective", "inline", "shm"), default="collective",
                                 help="collective: a Gloo/NCCL group; inline: inside gRPC (any proxy); shm: same host")
            command.add_argument("--store-host", help="address this host's rendezvous store listens on (collective)")
            command.add_argument("--store-port", type=int, default=0,
                                 help="fixed port for the rendezvous store (collective; default: a free one)")
            command.add_argument("--delta", choices=("auto", "on", "off"), default="auto",
                                 help="send only what changed since --base (auto: where it pays)")
            command.add_argument("--base", action="append", default=[],
                                 help="the checkpoint the servers hold now (.safetensors, repeatable): with it, "
                                      "--delta sends only what differs; servers that do not hold it get it dense")
    return parser


def _client(args: argparse.Namespace, servers: list[str]):
    from weightsync.client import TlsConfig, WeightSyncClient

    token = None
    if args.token_file:
        with open(args.token_file, encoding="utf-8") as handle:
            token = handle.read().strip()
    tls = None
    if args.tls_ca or args.tls_cert:
        tls = TlsConfig(ca_cert=args.tls_ca, client_cert=args.tls_cert, client_key=args.tls_key)
    return WeightSyncClient(servers, token=token, tls=tls, timeout=args.timeout)


def _servers(text: str) -> list[str]:
    servers = [s.strip() for s in text.split(",") if s.strip()]
    if not servers:
        raise ValueError("no server address given")
    for server in servers:
        parse_address(server, what="server address")
    return servers


def _json(message) -> str:
    """A response as JSON with every field, zero values included (worker 0 has index 0)."""
    return json_format.MessageToJson(message, always_print_fields_with_no_presence=True)


def _hint(error: BaseException, args: argparse.Namespace) -> str:
    """What to do about an RPC failure, when the status alone does not say it."""
    code = getattr(error, "code", None)
    text = str(error).lower()
    if code == grpc.StatusCode.UNAUTHENTICATED and not getattr(args, "token_file", None):
        return " (the server wants a bearer token: pass --token-file)"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return " (the token in --token-file is not the server's)"
    if code == grpc.StatusCode.UNAVAILABLE and not getattr(args, "tls_ca", None) and (
        "socket closed" in text or "ssl" in text or "handshake" in text or "connection reset" in text
    ):
        return " (if the server speaks TLS, pass --tls-ca with the CA that signed its certificate)"
    return ""


def _info(args: argparse.Namespace) -> int:
    with _client(args, _servers(args.server)[:1]) as client:
        (info,) = client.server_info()
    if args.json:
        print(_json(info))
        return 0
    version = info.current_version
    print(f"server       {args.server} (weightsync {info.server_version})")
    store = info.store
    print(f"store        {pb.StoreState.Name(store.state)}: {store.tensor_count} tensors, {store.live_bytes} bytes "
          f"live, {store.held_bytes} held in host memory (shadows included)")
    if store.tensor_filter:
        print(f"subset       only tensors matching {store.tensor_filter!r} (--tensors)")
    print(f"version      {version.version or '-'} (generation {version.generation}, store epoch {version.store_epoch})")
    print(f"transports   {', '.join(pb.Transport.Name(t) for t in info.transports)}")
    print(f"{'worker':>6}  {'device':<8} {'state':<22} {'received':>14} {'staging':>14} {'pid':>8} {'restarts':>8}")
    for w in info.workers:
        staging = f"{w.staging_bytes}{' dev' if w.staging_on_device else ''}"
        print(
            f"{w.index:>6}  {w.device:<8} {pb.WorkerState.Name(w.state):<22} {w.received_bytes:>14} {staging:>14} "
            f"{w.pid:>8} {w.restart_count:>8}"
        )
    return 0


def _groups(args: argparse.Namespace) -> int:
    with _client(args, _servers(args.server)[:1]) as client:
        groups = client.list_groups()[args.server]
    if args.json:
        print(json.dumps([json.loads(_json(g)) for g in groups], indent=2))
        return 0
    print(f"{'group':<32} {'state':<20} {'world':>5} {'offset':>6} backend")
    for g in groups:
        print(f"{g.group_id:<32} {pb.GroupState.Name(g.state):<20} {g.world_size:>5} {g.rank_offset:>6} {pb.Backend.Name(g.backend)}")
    return 0


def _push(args: argparse.Namespace) -> int:
    from weightsync.client.cli.checkpoint import load_checkpoints

    tensors = load_checkpoints(args.checkpoint)
    delta = {"auto": "auto", "on": True, "off": False}[args.delta]
    with _client(args, _servers(args.to)) as client:
        if args.transport == "collective":
            client.create_group(timeout=args.timeout, store_host=args.store_host, store_port=args.store_port)
        if args.base and delta is not False:
            holding = client.adopt_base(load_checkpoints(args.base))
            print(f"base held by {len(holding)} of {len(_servers(args.to))} server(s)", file=sys.stderr)
        result = client.push(
            tensors, version=args.version, mode=args.mode, transport=args.transport,
            bucket_size_bytes=args.bucket_size_mb << 20, allow_new_tensors=args.allow_new_tensors, delta=delta,
        )
        verified = "skipped"
        if not args.no_verify:
            check = client.verify(tensors)
            if not check.ok:
                first = check.mismatches[0]
                raise RuntimeError(f"{len(check.mismatches)} checksum mismatches, first {first.name!r} on {first.server}")
            verified = "ok"
    print(
        f"pushed {result.version}: {result.tensor_count} tensors, {result.size_bytes} bytes "
        f"(dense {result.dense_bytes}) in "
        f"{result.seconds:.3f} s ({result.gigabytes_per_second:.2f} GB/s) to {len(result.servers)} server(s); verify {verified}"
    )
    return 0


def _verify(args: argparse.Namespace) -> int:
    from weightsync.client.cli.checkpoint import load_checkpoints

    tensors = load_checkpoints(args.checkpoint)
    with _client(args, _servers(args.to)) as client:
        result = client.verify(tensors)
    if result.ok:
        print(f"verified {result.checked} tensors on every worker")
        return 0
    for m in result.mismatches[:20]:
        where = "missing" if m.remote is None else f"{m.remote:#018x} != local {m.local:#018x}"
        print(f"{m.server}: {m.name}: {where}")
    names = {m.name for m in result.mismatches}
    raise RuntimeError(f"{len(names)} tensors differ")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        from weightsync.server.cli import main as serve

        return serve(argv[1:])
    args = build_parser().parse_args(argv)
    from weightsync.common.logging import configure_logging

    configure_logging("warning")
    handlers = {"info": _info, "groups": _groups, "push": _push, "verify": _verify}
    try:
        code = handlers[args.command](args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader went away (`weightsync info | head`): nothing is wrong, and no traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("weightsync: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 - one line, non-zero exit, for every failure
        message = " ".join(str(error).split()) or type(error).__name__
        cause = getattr(error, "cause", None) or error
        print(f"weightsync: {args.command} failed: {message}{_hint(cause, args)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
