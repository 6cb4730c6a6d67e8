"""vLLM's native weight transfer with TensorCast as its backend: the trainer side.

What a trainer (TRL-, SkyRL- or slime-style, or a script) calls, through vLLM's own factory::

    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ModuleSource
    from tensorcast.integrations.vllm_transfer_trainer import TensorCastHTTPClient, TensorCastTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        TensorCastTrainerInitInfo(rank=0, address=GATEWAY, model="policy"),
        client=TensorCastHTTPClient("http://rollout:8000"), source=ModuleSource(model))
    engine.send_weights()          # after each training step; engine.last: the version and what moved

(``integrations.vllm.register``, the vLLM plugin, registers the backend; call it first in a trainer process
that does not load vLLM's plugins.) ``send_weights`` publishes the source as the model's next version
(``client.publisher``: tensors whose bytes did not change since the last publish are neither copied nor
hashed again, only their digests travel), then asks every rollout engine to stage it (``/start_weight_update``,
``/update_weights``: the engine keeps serving the old weights meanwhile; an engine serving the previous version
reads only the chunks that changed, ``weights.delta``), pauses it (``/pause``: in-flight
requests drained, prefix cache cleared), loads it (``/finish_weight_update``), and resumes it. Any rollout
engine count and tensor-parallel size: each worker reads the version from the pool itself; no process group
joins trainer and engine. A trainer that dies mid-publish never reached the engine: the old weights keep
serving. Multi-rank trainers: every rank iterates the source (its gathers are collectives); rank 0 publishes
and drives the engine. ``client`` may be any ``VLLMWeightSyncClient``; one with ``pause``/``resume`` (this
module's ``TensorCastHTTPClient``) gets the pause around the load. Does not own: the rollout side
(``integrations.vllm_transfer``), publishing itself (``client.publisher``).

GPU: tensors of the source on a CUDA device are copied to the host once (the pool's bytes live in host
memory); not tested without a GPU here.
"""

from __future__ import annotations

import time
import urllib.parse
import urllib.request
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

try:  # vLLM is optional
    from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine, WeightSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
except ImportError:  # pragma: no cover - exercised where vLLM is missing
    TrainerInitInfo = TrainerWeightTransferEngine = HTTPVLLMWeightSyncClient = WeightSource = object

from tensorcast.errors import InvalidArgument

__all__ = ["StateDictSource", "TensorCastHTTPClient", "TensorCastTrainerInitInfo",
           "TensorCastTrainerWeightTransferEngine"]


@dataclass
class TensorCastTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "tensorcast"
    address: str = ""  # a gateway of the cluster (the trainer's; the engine's workers may name their own)
    model: str = ""  # versions are published as {model}@v{N}
    rollout_address: str = ""  # the gateway the rollout workers connect to (default: address)
    token: str | None = None  # the trainer's credential (default TENSORCAST_TOKEN); never sent to the engine
    keep_last: int = 2  # versions kept in the pool (older ones are deleted once no engine uses them)
    policy: str | None = None  # placement of each version (default: the cluster's)
    timeout: float = 300.0  # seconds any one step may take, on both sides
    verify: bool = True  # the engine checks what it read against the published digests
    pause_mode: str = "wait"  # /pause?mode=: wait (drain in-flight requests) or abort them
    extra: dict[str, Any] = field(default_factory=dict)


class StateDictSource(WeightSource):  # type: ignore[misc,valid-type]
    """A ``WeightSource`` over a ``{name: tensor}`` mapping, read again at each ``send_weights`` (update the
    mapping between steps): for a trainer that holds a state dict rather than a module (``ModuleSource``).
    ``changed``: the names of the tensors that changed since the previous ``send_weights``, when the trainer
    knows them (frozen layers): the others are not read at all (``publish(changed=...)``: a promise; a
    tensor left out that did change is published with its old content). None: every tensor is checked."""

    def __init__(self, state: Mapping[str, Any], changed: Collection[str] | None = None) -> None:
        self.state = state
        self.changed = changed

    def metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.state.items()]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self.state.items())


class TensorCastHTTPClient(HTTPVLLMWeightSyncClient):  # type: ignore[misc,valid-type]
    """vLLM's HTTP weight-sync client (the RL routes; ``VLLM_SERVER_DEV_MODE=1`` on the server) with the pause
    and resume routes around the load."""

    def pause(self, mode: str = "wait") -> None:
        query = urllib.parse.urlencode({"mode": mode, "clear_cache": "true"})
        request = urllib.request.Request(f"{self.base_url}/pause?{query}", method="POST")
        with urllib.request.urlopen(request, timeout=self.timeout):  # raises on an error status
            pass

    def resume(self) -> None:
        self._post("resume")


class TensorCastTrainerWeightTransferEngine(TrainerWeightTransferEngine):  # type: ignore[misc,valid-type]
    init_info_cls = TensorCastTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, info: TensorCastTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=info.is_sender)
        self.info = info
        self.last: dict[str, Any] = {}
        self._tc: Any = None
        self._publisher: Any = None

    @classmethod
    def trainer_init(cls, init_info: TensorCastTrainerInitInfo, *, client: Any,
                     source: Any = None) -> TensorCastTrainerWeightTransferEngine:
        if source is None:
            raise InvalidArgument("the tensorcast trainer engine publishes a WeightSource: pass source=")
        if not init_info.address or not init_info.model:
            raise InvalidArgument("TensorCastTrainerInitInfo needs address= (a gateway) and model=")
        if init_info.pause_mode not in ("wait", "abort"):
            raise InvalidArgument(f"pause_mode is wait or abort, got {init_info.pause_mode!r}")
        engine = cls(client=client, source=source, info=init_info)
        if engine.is_sender:
            import tensorcast as tc

            # The trainer's environment and config file apply (TENSORCAST_WEIGHTS_DELTA_CHUNK_BYTES, ...).
            config = tc.Config.load(overrides={"client.timeout": init_info.timeout})
            engine._tc = tc.connect(init_info.address, init_info.token, config=config)
            engine._publisher = engine._tc.publisher(init_info.model, keep_last=init_info.keep_last,
                                                     policy=init_info.policy)
            client.init_weight_transfer_engine({"address": init_info.rollout_address or init_info.address,
                                                "model": init_info.model, "timeout": init_info.timeout,
                                                "verify": init_info.verify})
        return engine

    def send_weights(self) -> None:
        t0 = time.perf_counter()
        state = {name: _host(t) for name, t in self.source}  # every rank: the gathers are collectives
        if not self.is_sender:
            return
        published = self._publisher.publish(state, changed=getattr(self.source, "changed", None),
                                            timeout=self.info.timeout)
        t1 = time.perf_counter()
        self.client.start_weight_update()
        self.client.update_weights({"version": published.version, "model": self.info.model})
        t2 = time.perf_counter()
        pause, resume = getattr(self.client, "pause", None), getattr(self.client, "resume", None)
        if pause is not None:
            pause(self.info.pause_mode)
        try:
            self.client.finish_weight_update(weight_version=str(published.version))
        finally:
            if resume is not None:
                resume()
        self.last = {"version": published.version, "bytes": published.nbytes,
                     "changed_bytes": published.changed_bytes, "changed_tensors": published.changed_tensors,
                     "delta_base": published.delta_base, "delta_bytes": published.delta_bytes,
                     "publish_seconds": t1 - t0, "stage_seconds": t2 - t1,
                     "load_seconds": time.perf_counter() - t2}

    def shutdown(self) -> None:
        if self._tc is not None:
            self._tc.close()
            self._tc = None


def _host(t: Any) -> Any:
    """The tensor in host memory, detached (a CUDA tensor is copied once; the pool's bytes live on the host)."""
    t = t.detach()
    return t.cpu() if getattr(t, "is_cuda", False) else t
