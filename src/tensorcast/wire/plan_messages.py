"""Plans and the engine instances they drive: a caller's ``RunPlan`` for a gateway, and the instances'
registration with the global store and the gateway's calls into an instance's runtime.

Owns: ``RunPlan``/``PlanResult``, ``RegisterInstance``, ``InstanceHeartbeat``, ``ListInstances`` and
``InstanceCall`` with their replies. Does not own: running plans (``plans``), the instance runtime
(``instance``), or the tables derived from the messages (``wire.protocol``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from tensorcast.records import InstanceInfo, StepResult, StepSpec
from tensorcast.wire.message_base import Msg, Request
from tensorcast.wire.session_messages import Ack

# --------------------------------------------------------------------------- instances


class RegisterInstance(Request[Ack]):
    idempotent: ClassVar[bool] = True
    instance: InstanceInfo


class InstanceHeartbeat(Request[Ack]):
    idempotent: ClassVar[bool] = True
    instance_id: str
    running: int = 0
    waiting: int = 0
    kv_tokens_used: int = 0
    kv_tokens_capacity: int = 0


class ListInstances(Request["InstanceList"]):
    idempotent: ClassVar[bool] = True
    pass


class InstanceList(Msg):
    instances: tuple[InstanceInfo, ...]


class InstanceCall(Request["InstanceReply"]):
    """Gateway -> instance runtime: run one instance operation through the adaptor.

    ``op``: publish | hydrate | transform_into | engine (an engine-specific command in ``args``)."""

    instance_id: str
    op: str
    request_id: str = ""
    artifacts: tuple[str, ...] = ()
    args: dict[str, Any] = {}


class InstanceReply(Msg):
    artifacts: tuple[str, ...] = ()
    result: dict[str, Any] = {}


# --------------------------------------------------------------------------- plans


class RunPlan(Request["PlanResult"]):
    steps: tuple[StepSpec, ...]
    concurrency: int = 4
    idempotency_key: str | None = None


class PlanResult(Msg):
    plan_id: str
    status: str  # succeeded | failed
    steps: tuple[StepResult, ...]
    # Steps whose results came from an earlier run with the same idempotency key.
    reused: tuple[str, ...] = ()
