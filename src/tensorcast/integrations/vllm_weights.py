"""Live weight updates of a running vLLM engine from TensorCast versions (RL rollouts): a worker extension.

Turned on with ``LLM(..., worker_extension_cls="tensorcast.integrations.vllm_weights.TensorCastWeightSync")``
(``vllm serve --worker-extension-cls ...``). A controller (the RL driver) then calls, through vLLM's public
``collective_rpc``, on every worker of the engine at once:

- ``tensorcast_prepare(model, version=None, address=None)``: open version ``{model}@v{N}`` (the newest when
  ``version`` is None; see ``client.publisher``) and map its tensors (same host: the pool's pages, no copy;
  elsewhere: fetched). Nothing the engine uses is touched; returns the version.
- ``tensorcast_activate()``: hand the prepared tensors to vLLM's own in-place reload
  (``model_runner.reload_weights``): vLLM shards them for this rank, fuses and repacks them as its loader
  does, so the parameters keep their addresses. Returns the active version.
- ``tensorcast_swap(...)``: both; ``tensorcast_abort()`` drops a prepared version; ``tensorcast_version()``.

``collective_rpc`` runs between engine steps, so no forward pass sees a mixed version; every rank of the
engine prepares before any activates when the controller calls ``prepare`` on all, then ``activate``. After
a swap, call ``llm.reset_prefix_cache()``: cached KV was computed by the old weights.

Why not a ``client.bind`` binding on vLLM's parameters: vLLM fuses (``qkv_proj``) and, on CPU, repacks
weights after loading, so its parameters are not the checkpoint's tensors; its reload path knows how to
produce them. The cost is vLLM's reload (a copy per parameter), not a fetch: the fetch is a mapping when
the version has a replica on this host (prefetch it there first: ``artifact.prefetch(to=worker)``).

Does not own: publishing (``client.publisher``) or the vLLM engine.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

__all__ = ["TensorCastWeightSync"]

log = logging.getLogger("vllm.tensorcast")


class TensorCastWeightSync:
    """Mixed into vLLM's worker class by ``worker_extension_cls``; ``self`` is the worker."""

    model_runner: Any
    _tc_client: Any = None
    _tc_prepared: tuple[int, dict[str, Any]] | None = None
    _tc_active: int | None = None

    def _tc(self, address: str | None) -> Any:
        if self._tc_client is None:
            import tensorcast as tc

            address = address or os.environ.get("TENSORCAST_ADDRESS")
            if not address:
                from tensorcast.errors import InvalidArgument

                raise InvalidArgument("tensorcast_prepare needs address= or TENSORCAST_ADDRESS")
            self._tc_client = tc.connect(address)
        return self._tc_client

    def tensorcast_prepare(self, model: str, version: int | None = None, address: str | None = None) -> int:
        from tensorcast.errors import NotFound
        from tensorcast.weights.versions import META_TENSORS, version_key

        client = self._tc(address)
        if version is None:
            version = client.publisher(model).latest()
            if version is None:
                raise NotFound(f"no version of {model} is published")
        t0 = time.perf_counter()
        art = client.artifact(version_key(model, version))
        tensors = art.tensor_dict(like="torch")
        for name in META_TENSORS:
            tensors.pop(name, None)  # the publisher's tag and delta record, not weights
        self._tc_prepared = (version, tensors)
        log.info("TensorCast: prepared %s v%d (%d tensors, %d bytes) in %.2f s via %s", model, version, len(tensors),
                 art.nbytes, time.perf_counter() - t0, art.last_diagnostics.transport if art.last_diagnostics else "?")
        return version

    def tensorcast_activate(self) -> int:
        from tensorcast.errors import InvalidArgument

        if self._tc_prepared is None:
            raise InvalidArgument("tensorcast_activate without a prepared version")
        version, tensors = self._tc_prepared
        t0 = time.perf_counter()
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        self._tc_prepared, self._tc_active = None, version
        log.info("TensorCast: activated v%d in %.2f s", version, time.perf_counter() - t0)
        return version

    def tensorcast_swap(self, model: str, version: int | None = None, address: str | None = None) -> int:
        self.tensorcast_prepare(model, version, address)
        return self.tensorcast_activate()

    def tensorcast_abort(self) -> None:
        self._tc_prepared = None

    def tensorcast_version(self) -> int | None:
        return self._tc_active
