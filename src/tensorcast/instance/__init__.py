"""Instances: engines attached to TensorCast through an adaptor (``serve(adaptor, worker=..., instance_id=...)``)."""

from tensorcast.instance.adaptor import InstanceAdaptor, InstanceLoad
from tensorcast.instance.runtime import InstanceRuntime, serve

__all__ = ["InstanceAdaptor", "InstanceLoad", "InstanceRuntime", "serve"]
