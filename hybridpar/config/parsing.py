"""The parts of the config's language that the layers above read without the schema:
``model.bn_sync`` and the partitioning rules' shape. No ml_collections and no JAX, so the
partitioning API and the models import them without the config schema.
"""

from __future__ import annotations

import re

from hybridpar.config.errors import ConfigError


def parse_bn_sync(bn_sync: str) -> tuple[str, int]:
    """``"global"`` -> ``("global", 0)``, ``"local"`` -> ``("local", 1)``,
    ``"group:4"`` -> ``("group", 4)`` (devices per group)."""
    s = str(bn_sync).strip()
    if s == "global":
        return "global", 0
    if s == "local":
        return "local", 1
    kind, sep, n = s.partition(":")
    if kind == "group" and sep:
        try:
            size = int(n)
        except ValueError:
            size = 0
        if size >= 1:
            return "group", size
    raise ConfigError(
        f"model.bn_sync={bn_sync!r}: use 'global' (statistics over the whole batch), 'local' "
        "(per device, no communication) or 'group:N' (over groups of N devices, N >= 1, "
        "e.g. group:2)"
    )


def check_logical_rules(logical_rules) -> None:
    """A ``ConfigError`` naming the first ``partitioning.logical_rules`` entry that is not a
    ``(logical_name, mesh_axis)`` pair (the axis a name, a tuple of names, or None)."""

    def axis(a) -> bool:
        names = a if isinstance(a, (tuple, list)) else (a,)
        return a is None or all(isinstance(n, str) for n in names)

    for rule in logical_rules:
        ok = isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)
        if not ok or not axis(rule[1]):
            raise ConfigError(
                f"partitioning.logical_rules entry {rule!r} is not a (logical_name, mesh_axis) "
                "pair; write e.g. (('embed', 'fsdp'), ('mlp', 'model'))"
            )


def check_rule_patterns(path_rules) -> None:
    """A ``ConfigError`` naming the first ``(path_regex, spec)`` rule whose regex does not
    compile, or that is not such a pair (``re`` caches the compiled ones for the searches)."""
    for rule in path_rules:
        if not isinstance(rule, (tuple, list)) or len(rule) != 2:
            raise ConfigError(
                f"partitioning rule {rule!r} is not a (path_regex, spec) pair; write the rules "
                "as a tuple of pairs, e.g. ((r'head/kernel$', (None, 'model')),)"
            )
        pattern, spec = rule
        try:
            re.compile(pattern)
        except (re.error, TypeError) as e:
            raise ConfigError(
                f"partitioning rule ({pattern!r}, {spec}): {pattern!r} is not a regex ({e}); "
                r"fix the pattern, e.g. escape a literal bracket as '\['"
            ) from None
