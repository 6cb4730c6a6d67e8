"""A test/benchmark process: one tensor-parallel rank of an engine, its weights a binding served as an instance.

``python -m tensorcast.testing.weight_rank --worker ADDR --id NAME --ready-file PATH --model M --rank R
--world W [--host-id H] [--rules qwen2] [--staging mapped|copy]``

Allocates the rank's tensors from the newest version's view shapes (plain torch tensors, as an engine's
parameters would be), binds them, and serves the binding (``instance.binding``). Test commands beside the
weight commands: ``test.digests`` (BLAKE3 of every bound tensor's bytes, and its address), ``test.fault``
(the next prepares fail: ``{"mode": "fail", "count": n}``; or wait for a file to exist before fetching:
``{"mode": "hold", "path": p}``).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import blake3

import tensorcast as tc
from tensorcast.client.binding import resolve_rules
from tensorcast.client.weights_sync import Binding
from tensorcast.errors import InternalError, InvalidArgument
from tensorcast.instance.adaptor import InstanceLoad
from tensorcast.instance.binding import BindingAdaptor
from tensorcast.instance.runtime import serve
from tensorcast.log import setup_logging
from tensorcast.testing.instance_process import run_until_signalled
from tensorcast.weights.versions import META_TENSORS

__all__ = ["RankHooks", "main"]


class RankHooks:
    """The test commands (the binding adaptor's ``inner``) and the faults its prepares obey."""

    engine = "tensorcast-test-rank"

    def __init__(self, binding: Binding) -> None:
        self.binding = binding
        self.fault: dict[str, Any] = {}

    def before_prepare(self) -> None:
        fault, self.fault = self.fault, {}
        if fault.get("mode") == "fail" and int(fault.get("count", 1)) > 0:
            if int(fault.get("count", 1)) > 1:
                self.fault = {**fault, "count": int(fault["count"]) - 1}
            raise InternalError("injected prepare failure")
        if fault.get("mode") == "hold":
            deadline = time.time() + 60
            while not Path(fault["path"]).exists() and time.time() < deadline:
                time.sleep(0.02)

    def engine_command(self, command: str, args: Mapping[str, Any]) -> dict[str, Any]:
        import torch

        if command == "test.digests":
            out = {}
            for name, t in self.binding.tensors.items():
                raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                out[name] = {"digest": blake3.blake3(raw).hexdigest(), "ptr": int(t.data_ptr())}
            return out
        if command == "test.fault":
            self.fault = dict(args)
            return {}
        raise InvalidArgument(f"unknown engine command {command!r}")

    def load(self) -> InstanceLoad:
        return InstanceLoad()

    def publish(self, request_id: str, options: Mapping[str, Any]) -> Mapping[str, Any]:
        raise InvalidArgument("a weight rank serves no requests")

    def hydrate(self, request_id: str, tensors: Mapping[str, Any], options: Mapping[str, Any]) -> None:
        raise InvalidArgument("a weight rank serves no requests")

    def transform_into(self, tensors: Mapping[str, Any], options: Mapping[str, Any]) -> None:
        raise InvalidArgument("a weight rank takes weights through its binding")


class FaultyBindingAdaptor(BindingAdaptor):
    def __init__(self, binding: Binding, hooks: RankHooks) -> None:
        super().__init__(binding, hooks)
        self.hooks = hooks

    def engine_command(self, command: str, args: Mapping[str, Any]) -> dict[str, Any]:
        if command == "weights.prepare":
            self.hooks.before_prepare()
        return super().engine_command(command, args)


def _allocate(client: tc.Client, model: str, tp: tc.TP, rules: str) -> dict[str, Any]:
    import torch

    art = client.artifact(f"{model}@v{client.publisher(model).latest()}")
    view = art.view(tp=tp, rules=resolve_rules(rules, art.info))
    return {n: torch.zeros(view.shape(n), dtype=getattr(torch, art.meta(n).dtype))
            for n in view.tensor_names if n not in META_TENSORS}


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag in ("--worker", "--id", "--ready-file", "--model"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--host-id", default="")
    ap.add_argument("--rules", default="qwen2")
    ap.add_argument("--staging", default="mapped")
    args = ap.parse_args()
    setup_logging(f"rank-{args.id}")
    import torch

    torch.set_num_threads(1)
    config = tc.Config.load(overrides={"client.host_id": args.host_id} if args.host_id else None)
    client = tc.connect(args.worker, config=config)
    tp = tc.TP(args.rank, args.world)
    binding = client.bind(args.model, into=_allocate(client, args.model, tp, args.rules), tp=tp, rules=args.rules,
                          staging=args.staging, holder=args.id)
    hooks = RankHooks(binding)
    runtime = serve(FaultyBindingAdaptor(binding, hooks), worker=args.worker, instance_id=args.id,
                    token=os.environ.get("TENSORCAST_TOKEN"), config=config)
    run_until_signalled(runtime, args.id, args.ready_file)
    client.close()


if __name__ == "__main__":
    main()
