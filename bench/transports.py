"""INLINE and SHM against COLLECTIVE, on the same tensors, alternately.

One plain server and one TLS server, each with 2 CPU workers and ingress slots
as large as the buckets; one SDK client per server. Every mode pushes the same
tensors IN_PLACE into the same store; the ratio of a mode is
median(collective) / median(mode): above 1, faster than COLLECTIVE.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from bench import workloads
from bench.harness import Harness, alternate, median, nbytes
from bench.progress import log
from bench.servers import Server

MODES = ("collective", "inline", "shm", "inline_tls")


def _self_signed(directory: Path) -> tuple[str, str]:
    """A throwaway certificate for 127.0.0.1 (the TLS server); returns (cert, key) paths."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "bench-tls.pem", directory / "bench-tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def _timed_push(target, transport: str, tensors: dict, bucket_bytes: int):
    """One IN_PLACE push through `transport`, as a zero-argument timer for `alternate`."""
    def push() -> float:
        started = time.perf_counter()
        target.push(tensors, delta=False, version=f"{transport}-{time.monotonic_ns()}", transport=transport,
                    bucket_size_bytes=bucket_bytes)
        return time.perf_counter() - started
    return push


def run(h: Harness, suite: list[workloads.Workload]) -> dict:
    from weightsync.client import TlsConfig, WeightSyncClient

    cfg = h.cfg
    h.stop_server()  # room for two servers' stores
    cert, key = _self_signed(h.workdir)
    slot = ("--ingress-slot-bytes", str(cfg.bucket_bytes))
    plain = Server(2, h.workdir, extra=slot)
    secure = Server(2, h.workdir, extra=(*slot, "--tls-cert", cert, "--tls-key", key))
    h.processes += [plain.process, secure.process]
    h.shm |= plain.shm | secure.shm
    runs = []
    try:
        for wl in suite:
            tensors = wl.materialize(prefix=f"{wl.name}.")
            size = nbytes(tensors)
            with WeightSyncClient(plain.address, timeout=300) as client, \
                    WeightSyncClient(secure.address, timeout=300,
                                     tls=TlsConfig(ca_cert=cert, server_name="localhost")) as tls_client:
                client.create_group(timeout=120)
                client.push(tensors, delta=False, version="define", transport="inline", allow_new_tensors=True,
                            bucket_size_bytes=cfg.bucket_bytes)
                tls_client.push(tensors, delta=False, version="define", transport="inline", allow_new_tensors=True,
                                bucket_size_bytes=cfg.bucket_bytes)

                pushes = {"collective": (client, "collective"), "inline": (client, "inline"),
                          "shm": (client, "shm"), "inline_tls": (tls_client, "inline")}
                times = alternate({mode: _timed_push(target, transport, tensors, cfg.bucket_bytes)
                                   for mode, (target, transport) in pushes.items()},
                                  cfg.reps, f"transports {wl.name}")
                for target in (client, tls_client):
                    if not target.verify(tensors).ok:
                        raise RuntimeError(f"transports {wl.name}: a worker does not hold the pushed tensors")
            base = median(times["collective"])
            for mode in MODES:
                m = median(times[mode])
                runs.append({"workload": wl.name, "mode": mode, "bytes": size, "tensors": len(tensors),
                             "seconds": [round(t, 6) for t in times[mode]], "median_seconds": round(m, 6),
                             "gbps": round(size / m / 1e9, 3), "vs_collective": round(base / m, 3)})
            log(f"transports {wl.name}: " + ", ".join(
                f"{r['mode']} {r['median_seconds']:.3f} s ({r['vs_collective']:.2f}x)" for r in runs[-len(MODES):]))
            del tensors
    finally:
        for server in (plain, secure):
            server.stop()
    return {"runs": runs, "goals": {"shm_vs_collective": 1.5, "inline_vs_collective": 0.4}}


def markdown(result: dict) -> str:
    lines = ["", "## Transports", "",
             "Same tensors, same store, IN_PLACE, alternated; `vs collective` = median(COLLECTIVE) / median(mode).",
             "", "| workload | transport | median s | GB/s | vs collective |", "|---|---|---:|---:|---:|"]
    for r in result["runs"]:
        lines.append(f"| {r['workload']} | {r['mode']} | {r['median_seconds']:.3f} | {r['gbps']:.2f} | "
                     f"{r['vs_collective']:.2f} |")
    goals = result["goals"]
    lines += ["", f"Goals on this machine: SHM >= {goals['shm_vs_collective']}x COLLECTIVE, INLINE >= "
              f"{goals['inline_vs_collective']}x COLLECTIVE (TLS on and off).", ""]
    return "\n".join(lines)
