"""An engine instance with no engine behind it: a fixed load and nothing else, for tests of what an instance
process reports (it starts in about a second: no torch, no model).

``python -m idle_instance --worker ADDR --id NAME --ready-file PATH`` with this folder on ``PYTHONPATH``, which
is how ``LocalCluster.start_instance(..., module="idle_instance")`` runs it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

from tensorcast.errors import InvalidArgument
from tensorcast.instance import InstanceLoad, serve
from tensorcast.testing.instance_process import run_until_signalled

# What every heartbeat and scrape reports: distinct numbers, so a test can tell which is which.
LOAD = InstanceLoad(running=1, waiting=2, kv_tokens_used=3, kv_tokens_capacity=64)


class IdleEngine:
    engine = "idle"

    def publish(self, request_id: str, options: Mapping[str, Any]) -> Mapping[str, Any]:
        raise InvalidArgument("an idle instance holds no requests")

    def hydrate(self, request_id: str, tensors: Mapping[str, Any], options: Mapping[str, Any]) -> None:
        raise InvalidArgument("an idle instance holds no requests")

    def transform_into(self, tensors: Mapping[str, Any], options: Mapping[str, Any]) -> None:
        raise InvalidArgument("an idle instance has no weights")

    def load(self) -> InstanceLoad:
        return LOAD

    def engine_command(self, command: str, args: Mapping[str, Any]) -> dict[str, Any]:
        raise InvalidArgument(f"unknown engine command {command!r}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", required=True)
    ap.add_argument("--id", required=True)
    ap.add_argument("--ready-file", required=True)
    args = ap.parse_args()
    runtime = serve(IdleEngine(), worker=args.worker, instance_id=args.id, token=os.environ.get("TENSORCAST_TOKEN"))
    run_until_signalled(runtime, args.id, args.ready_file)


if __name__ == "__main__":
    main()
