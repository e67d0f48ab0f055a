"""Credentials of a remote tier: given inline, or read from an environment variable; never logged.

A remote tier's secrets (a Redis password, S3 keys, ...) come one of three ways:

* inline in the config (``password: ...``): works, but the config file then holds the secret;
* from a *named* environment variable (``password_env: REDIS_PASSWORD``): the config holds
  only the variable's name;
* from a standard variable the tier names itself (``default_env``, e.g. ``AWS_ACCESS_KEY_ID``)
  when neither is given.

:func:`read_secret` checks that a secret is given one way only, and that a named variable is set,
with errors naming the field and never the value. A :class:`Secret` never shows its value in
``repr``; :meth:`Secret.describe` is what ``to_dict`` writes (the variable's name, or
:data:`HIDDEN` for an inline secret, which ``from_dict`` refuses so that the operator gives it
again). The keyed-record secret (``mac_key`` / ``mac_key_env``) follows the same rules in
:class:`kvtier.records.format.RecordMac`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from kvtier.errors import ConfigError

__all__ = ["HIDDEN", "Secret", "read_secret"]

#: What ``to_dict`` writes in place of an inline secret.
HIDDEN = "<hidden>"


@dataclasses.dataclass(frozen=True, slots=True)
class Secret:
    """A secret and where it came from. ``value`` is ``None`` when none was given."""

    field: str
    env_field: str
    value: str | None = dataclasses.field(default=None, repr=False)
    #: given inline (in the config, or in a URL): ``to_dict`` writes :data:`HIDDEN`
    inline: bool = False
    #: the variable named by ``env_field``, when that is how it was given
    env: str | None = None

    def describe(self) -> dict[str, str]:
        """What ``to_dict`` keeps of it: the variable's name, :data:`HIDDEN`, or nothing."""
        if self.env is not None:
            return {self.env_field: self.env}
        if self.inline:
            return {self.field: HIDDEN}
        return {}


def read_secret(
    field: str,
    value: str | None,
    env_field: str,
    env: str | None,
    *,
    also: Mapping[str, str | None] | None = None,
    default_env: str | None = None,
) -> Secret:
    """The secret ``field`` given inline (``value``), through the variable named by ``env_field``
    (``env``), or one of the other ways in ``also`` (way -> value, e.g. ``{"url": ...}``: counted
    as inline); else from ``default_env`` when that variable is set. Raises ``ConfigError``
    (naming the field, never the value) when it is given twice, is the :data:`HIDDEN` marker of a
    serialised config, or names a variable that is not set."""
    if value == HIDDEN:
        raise ConfigError(f"{field}: secrets are not serialised; give the {field} again, or use {env_field}")
    ways = {field: value, env_field: env, **(also or {})}
    given = [name for name, v in ways.items() if v is not None]
    if len(given) > 1:
        raise ConfigError(f"{field}: give it one way only, got {' and '.join(given)}")
    if env is not None:
        if not isinstance(env, str) or not env:
            raise ConfigError(f"{env_field}: expected an environment variable name, got {env!r}")
        found = os.environ.get(env)
        if found is None:
            raise ConfigError(f"{env_field}: the environment variable {env!r} is not set")
        return Secret(field, env_field, found, env=env)
    if given:
        return Secret(field, env_field, ways[given[0]], inline=True)
    if default_env is not None and os.environ.get(default_env) is not None:
        return Secret(field, env_field, os.environ[default_env])
    return Secret(field, env_field)
