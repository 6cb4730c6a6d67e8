"""``tensorcast credential``: a credential of a role, made from the cluster secret (or a stronger credential).

Owns: the command and its flags. Nothing is sent anywhere: a credential is derived locally (``credentials``),
so whoever holds the secret makes them offline. Does not own: what a role may do (``wire.protocol``).
"""

from __future__ import annotations

import click

from tensorcast.cli.common import say
from tensorcast.credentials import CLIENT, ROLES, Keyring
from tensorcast.errors import InvalidArgument

__all__ = ["credential"]


@click.command()
@click.option("--role", type=click.Choice(ROLES), default=CLIENT, show_default=True,
              help="worker: the cluster's own processes; client: callers; read-only: reads, lists, status, metrics.")
@click.option("--token", envvar="TENSORCAST_TOKEN", default=None, show_envvar=True,
              help="The cluster secret, or a credential of a stronger role.")
def credential(role: str, token: str | None) -> None:
    """Print a credential of ROLE for TENSORCAST_TOKEN=... of the callers that get it."""
    keyring = Keyring.from_token(token)
    if keyring is None:
        raise InvalidArgument("no cluster secret: set TENSORCAST_TOKEN (or --token) to the secret the cluster runs "
                              "with")
    say(keyring.credential(role))
