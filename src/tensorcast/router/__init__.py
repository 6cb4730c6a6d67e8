"""The TensorCast router as a service (``tensorcast router``): OpenAI-compatible, in front of engine servers.

``router.choice`` holds the decisions (policy names, what a policy sees of a request), ``router.service`` the
HTTP service. Needs aiohttp (``pip install 'tensorcast[router]'``). See ``docs/router.md``.
"""

from tensorcast.router.choice import POLICIES, make_policy, register_policy
from tensorcast.router.service import RouterService

__all__ = ["POLICIES", "RouterService", "make_policy", "register_policy"]
