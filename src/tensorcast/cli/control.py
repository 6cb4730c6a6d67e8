"""Asking a running ``tensorcast up`` to add or stop a worker: request files in its data directory.

Owns: the exchange between ``tensorcast add-worker``/``stop-worker`` and the ``up`` holding the data directory.
The command writes ``DATA_DIR/requests/ID.json`` (``{"op": "add-worker", "worker_id": ..., "host": ...}`` or
``{"op": "stop-worker", "worker_id": ...}``; written whole, then renamed into place); ``up`` looks every second
(``serve_requests``), acts through its ``LocalCluster`` (so the worker is one of its own: same configuration,
data directory and shared-memory prefix, watched, in ``cluster.json``, stopped with it) and answers in
``ID.reply.json`` (``{"ok": true, "worker_id", "address", "pid"}``, or ``{"ok": false, "error"}``); the command
waits for the answer, bounded. Whoever may write the data directory may ask (they could stop the cluster
anyway). Does not own: starting or stopping workers (``cluster``).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensorcast.errors import DeadlineExceeded, InvalidArgument, TensorCastError
from tensorcast.lockfile import holder, is_held

if TYPE_CHECKING:
    from tensorcast.cluster import LocalCluster

__all__ = ["OPS", "request", "serve_requests"]

OPS = ("add-worker", "stop-worker")


def _requests(data_dir: Path) -> Path:
    return data_dir / "requests"


def request(data_dir: Path, op: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Send ``op`` to the ``up`` holding ``data_dir`` and return its answer (``InvalidArgument`` with its error)."""
    if not is_held(data_dir) or holder(data_dir).get("command", "").split(" ")[:2] != ["tensorcast", "up"]:
        raise InvalidArgument(f"no `tensorcast up` is running on {data_dir} (start one, or pass its --data-dir)")
    folder = _requests(data_dir)
    folder.mkdir(exist_ok=True)
    rid = f"{time.time_ns()}-{uuid.uuid4().hex[:8]}"  # sorts by age
    tmp, path, reply = folder / f"{rid}.tmp", folder / f"{rid}.json", folder / f"{rid}.reply.json"
    tmp.write_text(json.dumps(op))
    tmp.replace(path)
    deadline = time.monotonic() + timeout
    while not reply.exists():
        if time.monotonic() > deadline:
            path.unlink(missing_ok=True)
            raise DeadlineExceeded(f"`tensorcast up` on {data_dir} did not answer within {timeout:g} s")
        time.sleep(0.1)
    answer: dict[str, Any] = json.loads(reply.read_text())
    reply.unlink(missing_ok=True)
    if not answer.get("ok"):
        raise InvalidArgument(str(answer.get("error", "refused")))
    return answer


def _act(cluster: LocalCluster, op: dict[str, Any]) -> dict[str, Any]:
    kind, wid = op.get("op"), op.get("worker_id")
    if kind == "add-worker":
        host = op.get("host")
        wid = cluster.add_worker(wid if isinstance(wid, str) else None, host if isinstance(host, int) else None)
        handle = cluster.workers[wid]
        return {"ok": True, "worker_id": wid, "address": handle.address, "pid": handle.pid}
    if kind == "stop-worker" and isinstance(wid, str):
        return {"ok": True, "worker_id": wid, "exit_code": cluster.stop_worker(wid)}
    return {"ok": False, "error": f"unknown request {op!r}"}


def serve_requests(cluster: LocalCluster, data_dir: Path, say: Callable[[str], None]) -> None:
    """Answer every pending request (oldest first), each in one line of ``up``'s output too."""
    folder = _requests(data_dir)
    if not folder.is_dir():
        return
    for path in sorted(folder.glob("*.json")):
        if path.name.endswith(".reply.json"):
            continue
        try:
            op = json.loads(path.read_text())
            answer = _act(cluster, op) if isinstance(op, dict) else {"ok": False, "error": "not a JSON object"}
        except (TensorCastError, ValueError, OSError) as exc:
            answer = {"ok": False, "error": str(getattr(exc, "message", exc))}
        path.unlink(missing_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(answer))
        tmp.replace(path.with_name(path.name.removesuffix(".json") + ".reply.json"))
        if answer.get("ok") and "address" in answer:
            say(f"added worker {answer['worker_id']}: pid {answer['pid']}, address {answer['address']}")
        elif answer.get("ok"):
            say(f"stopped worker {answer['worker_id']} (exit code {answer['exit_code']})")
        else:
            say(f"refused a request: {answer['error']}")
