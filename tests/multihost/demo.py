"""Multi-host demo on one machine (`make demo-multihost`; needs root).

Builds three network namespaces on a bridge (trainer 10.231.0.1, node-a .2, node-b .3), starts
a 2-worker CPU weightsync server with mTLS in each node namespace, and from the trainer
namespace pushes with the SDK: a STAGED and an IN_PLACE update over COLLECTIVE (Gloo) and over
INLINE, on clean links, then the same with 5 ms delay + 0.1% loss on every link. Each update is
verified (per-tensor checksums of each node's store) and read back from both servers'
GetServerInfo: what each worker received (each bucket has one owner worker per node, so the two
add up to the push), and the host memory the node's one store holds. Prints a table; exits 1 if
any step failed, 2 if namespaces cannot be created here. Everything is removed at the end.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from meshkit import NODES, Cluster, owned_bytes  # noqa: E402
from netns import NetnsUnavailable, check_available  # noqa: E402

GROUP_TIMEOUT = 10.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=24, help="model size in MB (default 24)")
    args = parser.parse_args()
    try:
        check_available()
    except NetnsUnavailable as error:
        print(f"demo-multihost: cannot run here: {error}", file=sys.stderr)
        return 2

    rows: list[tuple[str, ...]] = []
    failures: list[str] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ws-multihost-") as tmp, Cluster(Path(tmp)) as cluster:
        trainer = cluster.trainer
        mesh = cluster.mesh
        print(f"mesh up in {cluster.startup_seconds:.1f} s: "
              + ", ".join(f"{role} {host.ip} ({host.netns})" for role, host in mesh.hosts.items()))
        group = trainer.call("create_group", timeout=GROUP_TIMEOUT)
        print(f"group {group['group_id']}: TCPStore at {group['store_host']}:{group['store_port']} "
              f"(trainer's mesh address), Gloo, mTLS to {', '.join(s.address for s in cluster.servers.values())}")
        if group["store_host"] != mesh.host("trainer").ip:
            failures.append(f"TCPStore on {group['store_host']}, not the trainer's mesh address")

        steps = [(link, transport, mode) for link in ("clean", "5ms+0.1%") for transport in ("collective", "inline")
                 for mode in ("staged", "in_place")]
        for seed, (link, transport, mode) in enumerate(steps, start=1):
            version = f"step-{seed}"
            if link != "clean" and not mesh.impairment_method:
                method = mesh.impair(delay_ms=5, loss_pct=0.1)
                rtt = trainer.call("rtt", count=5)["ms"]
                print(f"links impaired ({method}): TCP round trip "
                      + ", ".join(f"{a} {ms:.1f} ms" for a, ms in rtt.items()))
            before = trainer.call("info")["servers"]
            pushed = trainer.call("push", seed=seed, version=version, mode=mode, transport=transport, mb=args.mb,
                                  wait=180, expect=("pushed", "push_failed"))
            if pushed["event"] != "pushed":
                failures.append(f"{version}: {pushed['code']} {pushed['reason']}: {pushed['message']}")
                continue
            checked = trainer.call("verify", seed=seed, mb=args.mb, wait=180)
            bad = {m["server"] for m in checked["mismatches"]}
            infos = trainer.call("info")["servers"]
            owners = owned_bytes(pushed["bucket_sizes"], len(infos[0]["workers"]))
            for role, old, info in zip(NODES, before, infos, strict=True):
                received = [n["received_bytes"] - o["received_bytes"]
                            for o, n in zip(old["workers"], info["workers"], strict=True)]
                store = info["store"]
                one_copy = store["live_bytes"] == pushed["bytes"] and \
                    store["held_bytes"] <= 2 * (pushed["bytes"] + 4096 * pushed["buckets"])  # + the STAGED shadow
                ok = info["address"] not in bad and info["store_state"] == "STORE_STATE_CONSISTENT" \
                    and info["version"] == version and received == owners and one_copy
                rows.append((role, link, transport, mode, info["version"], str(info["generation"]),
                             info["store_state"].removeprefix("STORE_STATE_"), f"{pushed['seconds']:.3f}",
                             f"{pushed['bytes'] / 1e6:.1f}", "/".join(f"{r / 1e6:.1f}" for r in received),
                             f"{store['held_bytes'] / 1e6:.1f}", "yes" if ok else "NO"))
                if not ok:
                    failures.append(f"{version} on {role}: {info['store_state']} {info['version']!r}, workers received "
                                    f"{received} (owners: {owners}), store {store}, checksum mismatches: "
                                    f"{[m for m in checked['mismatches'] if m['server'] == info['address']]}")
        mesh.clear_impairment()
        trainer.call("delete_group")

    header = ("node", "links", "transport", "mode", "version", "gen", "store", "push s", "MB",
              "MB per worker", "held MB", "verified")
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    print()
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    print()
    codes = {role: code for role, code in cluster.exit_codes.items()}
    if any(code != 0 for code in codes.values()):
        failures.append(f"server exit codes {codes}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    print(f"ok: {len(rows) // 2} updates to 2 hosts verified, each bucket received by one worker per node; "
          "servers exited 0; namespaces removed "
          f"({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
