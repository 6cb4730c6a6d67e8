"""Serving bindings as an instance, so that a gateway can swap a tensor-parallel group's ranks together.

Owns: ``BindingAdaptor`` — an ``InstanceAdaptor`` whose engine commands ``weights.prepare``,
``weights.activate``, ``weights.abort`` and ``weights.status`` run on the process's bindings (one per model),
and which hands every other operation and command to the engine's own adaptor (``inner``, e.g. the HF
adaptor), so one instance can serve requests and take weight swaps; and ``serve_binding`` to attach it
(``instance.serve``); after an activation, an ``inner`` with a ``weights_changed()`` method is told (the
HF adaptor re-fingerprints its weights for KV-page reuse). The instance runtime runs adaptor calls one at a
time, so an activation never overlaps an engine command such as a generation. Does not own: the swap logic
(``client.binding``) or the group protocol (``plans.group_swap``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tensorcast.client.weights_sync import Binding
from tensorcast.errors import InvalidArgument, NotFound, clip
from tensorcast.instance.adaptor import InstanceAdaptor, InstanceLoad
from tensorcast.instance.runtime import InstanceRuntime, serve

__all__ = ["BindingAdaptor", "serve_binding"]

COMMANDS = ("weights.prepare", "weights.activate", "weights.abort", "weights.status")


def _optional_int(args: Mapping[str, Any], key: str) -> int | None:
    value = args.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise InvalidArgument(f"{key} must be an integer, got {clip(value)}")
    return value


class BindingAdaptor:
    """Weight-swap commands for ``bindings``; everything else goes to ``inner`` (if any)."""

    def __init__(self, bindings: Binding | Sequence[Binding], inner: InstanceAdaptor | None = None) -> None:
        items = [bindings] if isinstance(bindings, Binding) else list(bindings)
        self.bindings = {b.model: b for b in items}
        if len(self.bindings) != len(items) or not items:
            raise InvalidArgument("one binding per model, at least one")
        self.inner = inner
        self.engine = inner.engine if inner is not None else "tensorcast-binding"

    def _binding(self, args: Mapping[str, Any]) -> Binding:
        model = args.get("model")
        if model is None and len(self.bindings) == 1:
            return next(iter(self.bindings.values()))
        try:
            return self.bindings[str(model)]
        except KeyError:
            raise NotFound(f"this instance binds no model {clip(model)} (binds {sorted(self.bindings)})") from None

    def engine_command(self, command: str, args: Mapping[str, Any]) -> dict[str, Any]:
        if command not in COMMANDS:
            if self.inner is None:
                raise InvalidArgument(f"unknown engine command {clip(command)}; known: {list(COMMANDS)}")
            return self.inner.engine_command(command, args)
        binding = self._binding(args)
        swap_id = args.get("swap_id") or None
        if command == "weights.prepare":
            timeout = args.get("timeout")
            report = binding.prepare(_optional_int(args, "version"), expected=_optional_int(args, "expected"),
                                     swap_id=swap_id, timeout=None if timeout is None else float(timeout),
                                     fetch=str(args.get("fetch") or "view"))
            return report.as_dict()
        if command == "weights.activate":
            report = binding.activate(swap_id, expected=_optional_int(args, "expected"))
            changed = getattr(self.inner, "weights_changed", None)
            if report.status == "activated" and callable(changed):
                changed()  # e.g. the HF adaptor re-fingerprints its weights for KV-page reuse
            return report.as_dict()
        if command == "weights.abort":
            binding.abort(swap_id)
            return {}
        return binding.status()

    # ----------------------------------------------------------------- the rest: the engine's
    def _inner(self, what: str) -> InstanceAdaptor:
        if self.inner is None:
            raise InvalidArgument(f"this instance only serves weight bindings: no {what}")
        return self.inner

    def publish(self, request_id: str, options: Mapping[str, Any]) -> Mapping[str, Any]:
        return self._inner("publish").publish(request_id, options)

    def hydrate(self, request_id: str, tensors: Mapping[str, Any], options: Mapping[str, Any]) -> None:
        self._inner("hydrate").hydrate(request_id, tensors, options)

    def transform_into(self, tensors: Mapping[str, Any], options: Mapping[str, Any]) -> None:
        self._inner("transform_into").transform_into(tensors, options)

    def load(self) -> InstanceLoad:
        return self.inner.load() if self.inner is not None else InstanceLoad()


def serve_binding(bindings: Binding | Sequence[Binding], worker: str, instance_id: str, *,
                  inner: InstanceAdaptor | None = None, **kwargs: Any) -> InstanceRuntime:
    """Attach ``bindings`` (one per model) as instance ``instance_id`` of home worker ``worker`` (``HOST:PORT``),
    so that ``client.group_swap([...], model)`` can reach them; ``inner``: the engine's own adaptor for every
    other call. Returns the started runtime (``stop()`` it)."""
    return serve(BindingAdaptor(bindings, inner), worker=worker, instance_id=instance_id, **kwargs)
