"""Handler groups: routing a submit to one member by the group's policy (`_route`), and
the operator's plans that define, list and delete groups.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from asynctaskd.errors import InvalidTask
from asynctaskd.keys import deployment_problem
from asynctaskd.plans import Reads
from asynctaskd.plans import read as _read
from asynctaskd.routing import (
    Group,
    MemberSpec,
    active_fields,
    choose,
    decode_group,
    encode_group,
    loads,
    make_group,
)

from .context import GROUP_CACHE_S, HANDLER_CACHE_S, Plan, _Context
from .validation import _name


def _group_name(value: object) -> str:
    return _name("" if value is None else value, "group name")


def _find_group(ctx: _Context, name: str) -> Plan[Group | None]:
    """The group called `name`, or None if it is a plain handler key."""
    now = time.monotonic()
    if now - ctx.groups_read_at < GROUP_CACHE_S:
        if name in ctx.groups:
            return decode_group(name, ctx.groups[name])
        if (now - ctx.live_read_at < HANDLER_CACHE_S
                and ctx.live_until_ms.get(name, 0) > time.time() * 1000):  # fmt: skip
            return None  # a live handler, and no group had that name a moment ago
    # A miss: the group may have just been defined. Refresh the handlers too, in the same
    # round trip, so the strict check that follows usually needs none.
    groups, handlers, deployment = yield Reads(
        _read("hgetall", ctx.keys.groups()),
        _read("hgetall", ctx.keys.handlers()),
        _read("get", ctx.keys.deployment()),
        share="groups+handlers",
    )
    ctx.deployment_problem = deployment_problem(deployment, ctx.keys)
    ctx.deployment_read_at = time.monotonic()
    ctx.remember_handlers(handlers)
    raw = ctx.remember_groups(groups).get(name)
    return None if raw is None else decode_group(name, raw)


def _route(ctx: _Context, name: str, route_key: str | None) -> Plan[str]:
    """The handler key a submit to `name` creates its task with: `name` itself, or the one
    member its group's policy picks (workers never re-route)."""
    group = yield from _find_group(ctx, name)
    if group is None:
        return name
    if group.policy == "consistent_hash":
        if route_key is None:
            raise InvalidTask(
                f"handler group {name!r} routes by consistent_hash: submit with a route_key "
                "(the business key, e.g. a customer id)"
            )
        return choose(group, route_key=route_key)
    if group.policy == "least_active":
        fields = active_fields(group.members)
        replies = yield Reads(
            *(_read("hmget", ctx.keys.counts(s), fields) for s in range(ctx.keys.shards))
        )
        return choose(group, active=loads(group.members, replies))
    # INCR itself, not redis-py's INCRBY: a producer's ACL user may only count up
    (counter,) = yield Reads(_read("execute_command", "INCR", ctx.keys.group_counter(name)))
    return choose(group, counter=int(counter))


def _set_group(ctx: _Context, name: str, policy: str, members: Sequence[MemberSpec]) -> Plan[Group]:
    group = make_group(name, policy, members)
    raw_groups, raw_handlers = yield Reads(
        _read("hgetall", ctx.keys.groups()), _read("hgetall", ctx.keys.handlers())
    )
    live, known = ctx.remember_handlers(raw_handlers), ctx.remember_groups(raw_groups)
    if live.get(name, 0) > time.time() * 1000:
        raise InvalidTask(
            f"{name!r} is the key of a live handler: a group cannot have the same name, or "
            "submits to it would be ambiguous"
        )
    for m in group.members:
        if m.handler == name or m.handler in known:
            raise InvalidTask(
                f"group {name!r}: member {m.handler!r} is a group; members are handler keys"
            )
    for other, raw in known.items():
        try:
            used = other != name and any(
                m.handler == name for m in decode_group(other, raw).members
            )
        except InvalidTask:
            continue  # a corrupt group is reported when it is used, not here
        if used:
            raise InvalidTask(
                f"{name!r} is a member of group {other!r}: a group cannot have a handler's name"
            )
    encoded = encode_group(group)
    yield Reads(_read("hset", ctx.keys.groups(), name, encoded))
    ctx.groups[name] = encoded
    return group


def _groups(ctx: _Context) -> Plan[dict[str, Group]]:
    (raw,) = yield Reads(_read("hgetall", ctx.keys.groups()))
    known = ctx.remember_groups(raw)
    return {name: decode_group(name, known[name]) for name in sorted(known)}


def _delete_group(ctx: _Context, name: str) -> Plan[bool]:
    name = _group_name(name)
    removed, _ = yield Reads(
        _read("hdel", ctx.keys.groups(), name), _read("delete", ctx.keys.group_counter(name))
    )
    ctx.groups.pop(name, None)
    return bool(removed)
