"""Handler groups: persisted routing policies and the choice of one member (pure, no I/O).

A group is a name (same charset as handler keys) with a policy and members. A submit to a
group picks one member once, in the client; the task is created with that member as its
handler, so workers never re-route. The client does the Redis work (the group hash, the
round-robin counter, the load counters) and hands the replies to the functions here.

Policies:
- `round_robin`: members in turn, from a shared counter (INCR): exact cycles.
- `weighted`: the same counter over the total weight, spread so that every run of
  `total weight` consecutive submits gives each member exactly its weight's share,
  interleaved rather than in blocks (3:1 gives A B A A, not A A A B).
- `consistent_hash`: weighted rendezvous (highest random weight) hashing of the submit's
  `route_key`: the same key always maps to the same member, and removing a member moves
  only the keys it had.
- `least_active`: the member with the fewest SUBMITTING + SUBMITTED + RUNNING +
  PENDING_SUBMIT tasks (summed over every shard); ties go to the earlier member.

Weights matter to `weighted` and `consistent_hash` only.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence
from typing import Final, Literal, TypeAlias, get_args

import msgspec

from .errors import InvalidTask
from .keys import HANDLER_KEY_RE
from .model import Status

__all__ = [
    "LEAST_ACTIVE_STATUSES",
    "MAX_MEMBERS",
    "MAX_WEIGHT",
    "POLICIES",
    "Group",
    "Member",
    "MemberSpec",
    "Policy",
    "active_fields",
    "choose",
    "consistent_hash",
    "decode_group",
    "encode_group",
    "least_active",
    "loads",
    "make_group",
    "needs_counter",
    "round_robin",
    "weighted",
]

Policy: TypeAlias = Literal["round_robin", "weighted", "consistent_hash", "least_active"]
POLICIES: Final[tuple[str, ...]] = get_args(Policy)
MAX_MEMBERS: Final = 100
MAX_WEIGHT: Final = 10_000
MAX_ROUTE_KEY: Final = 200
LEAST_ACTIVE_STATUSES: Final = (
    Status.SUBMITTING,
    Status.SUBMITTED,
    Status.RUNNING,
    Status.PENDING_SUBMIT,
)
_GOLDEN: Final = (math.sqrt(5) - 1) / 2  # 0.618...: the stride that spreads weighted slots


class Member(msgspec.Struct, frozen=True):
    """One handler of a group and its weight (a positive integer)."""

    handler: str
    weight: int = 1


class Group(msgspec.Struct, frozen=True):
    """A group's persisted definition: `<ns>:groups` field = name, value = this as JSON."""

    policy: Policy
    members: tuple[Member, ...]


MemberSpec: TypeAlias = str | tuple[str, int] | Member


def _bad_name(value: object, what: str) -> InvalidTask:
    return InvalidTask(
        f"{what} must be 1-64 characters from letters, digits, '_', '.', ':' and '-', got {value!r}"
    )


def _check(group: Group) -> None:
    """Raise InvalidTask (without the group's name; callers add it) if `group` is unusable."""
    if group.policy not in POLICIES:
        raise InvalidTask(f"policy must be one of {', '.join(POLICIES)}, got {group.policy!r}")
    if not group.members:
        raise InvalidTask("a group needs at least one member")
    if len(group.members) > MAX_MEMBERS:
        raise InvalidTask(f"a group has at most {MAX_MEMBERS} members, got {len(group.members)}")
    seen: set[str] = set()
    for m in group.members:
        if not isinstance(m.handler, str) or not HANDLER_KEY_RE.fullmatch(m.handler):
            raise _bad_name(m.handler, "a member's handler key")
        if m.handler in seen:
            raise InvalidTask(f"member {m.handler!r} is listed twice")
        seen.add(m.handler)
        w = m.weight
        if not isinstance(w, int) or isinstance(w, bool) or not 1 <= w <= MAX_WEIGHT:
            raise InvalidTask(
                f"member {m.handler!r}: weight must be an integer from 1 to {MAX_WEIGHT}, got {w!r}"
            )


def _member(spec: object) -> Member:
    if isinstance(spec, Member):
        return spec
    if isinstance(spec, str):
        return Member(spec)
    if isinstance(spec, tuple) and len(spec) == 2:
        return Member(spec[0], spec[1])
    raise InvalidTask(
        f"a member is a handler key or a (handler key, weight) tuple, got {spec!r:.80}"
    )


def make_group(name: object, policy: object, members: object) -> Group:
    """Validate a definition from user input; InvalidTask naming the group if it is wrong."""
    if not isinstance(name, str) or not HANDLER_KEY_RE.fullmatch(name):
        raise _bad_name(name, "group name")
    if isinstance(members, str | bytes) or not isinstance(members, Sequence):
        raise InvalidTask(f"group {name!r}: members must be a list, got {type(members).__name__}")
    try:
        if not isinstance(policy, str):
            raise InvalidTask(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        group = Group(policy, tuple(_member(m) for m in members))  # type: ignore[arg-type]  # checked next
        _check(group)
    except InvalidTask as exc:
        raise InvalidTask(f"group {name!r}: {exc}") from None
    return group


def encode_group(group: Group) -> bytes:
    return msgspec.json.encode(group)


def decode_group(name: str, raw: bytes) -> Group:
    """A stored definition, or InvalidTask naming the group if it is corrupt."""
    try:
        group = msgspec.json.decode(raw, type=Group)
        _check(group)
    except (msgspec.DecodeError, InvalidTask) as exc:
        raise InvalidTask(
            f"handler group {name!r} has a corrupt definition in Redis ({exc}); "
            "fix it with `asynctaskd group set` or remove it with `asynctaskd group delete`"
        ) from None
    return group


def needs_counter(group: Group) -> bool:
    """True if the policy consumes the shared counter (INCR <ns>:group:<name>:rr)."""
    return group.policy in ("round_robin", "weighted")


def round_robin(members: Sequence[Member], counter: int) -> str:
    """Member number `counter` (the value INCR returned, from 1) in turn."""
    return members[(counter - 1) % len(members)].handler


def _stride(total: int) -> int:
    """A step coprime with `total`, near total * 0.618: visits every slot, well spread."""
    step = max(1, round(total * _GOLDEN))
    while math.gcd(step, total) != 1:
        step += 1
    return step


def weighted(members: Sequence[Member], counter: int) -> str:
    """Member for counter value `counter`: exact shares over any `total weight` submits.

    Slot (counter - 1) mod total is permuted by a stride coprime with the total, then looked
    up in the cumulative weights: a bijection on each cycle, so the shares are exact, and
    consecutive submits land far apart in the cumulative range, so members interleave.
    """
    cumulative: list[int] = []
    total = 0
    for m in members:
        total += m.weight
        cumulative.append(total)
    slot = (counter - 1) % total * _stride(total) % total
    return members[bisect.bisect_right(cumulative, slot)].handler


def _unit(key: str, handler: str) -> float:
    """A stable uniform number in (0, 1) for one (key, member) pair."""
    raw = f"{handler}\0{key}".encode("utf-8", "surrogatepass")  # any str is a key
    digest = hashlib.blake2b(raw, digest_size=8).digest()
    return ((int.from_bytes(digest, "big") >> 12) + 0.5) / 2**52  # 52 bits: never 0 or 1


def consistent_hash(members: Sequence[Member], route_key: str) -> str:
    """Weighted rendezvous hashing: the member with the highest -weight / ln(u)."""
    best, best_score = members[0].handler, -math.inf
    for m in members:
        score = -m.weight / math.log(_unit(route_key, m.handler))
        if score > best_score:
            best, best_score = m.handler, score
    return best


def active_fields(members: Sequence[Member]) -> list[str]:
    """The counter fields (`STATUS@handler`) to HMGET from each shard's counts hash."""
    return [f"{s.value}@{m.handler}" for m in members for s in LEAST_ACTIVE_STATUSES]


def loads(members: Sequence[Member], replies: Sequence[Sequence[bytes | str | None]]) -> list[int]:
    """Active tasks per member, from one HMGET reply of `active_fields` per shard."""
    per = len(LEAST_ACTIVE_STATUSES)
    out = [0] * len(members)
    for reply in replies:
        for i, value in enumerate(reply):
            if value is None:
                continue
            try:
                out[i // per] += int(value)
            except ValueError:
                continue  # not a number: not written by our scripts, so not a load
    return out


def least_active(members: Sequence[Member], active: Sequence[int]) -> str:
    """The member with the fewest active tasks; the first such on a tie."""
    best = min(range(len(members)), key=lambda i: (active[i], i))
    return members[best].handler


def choose(
    group: Group,
    *,
    counter: int | None = None,
    route_key: str | None = None,
    active: Sequence[int] | None = None,
) -> str:
    """The member's handler key: `counter` for round_robin and weighted, `route_key` for
    consistent_hash, `active` (from `loads`) for least_active."""
    members = group.members
    if group.policy == "consistent_hash":
        if route_key is None:
            raise InvalidTask("consistent_hash routing needs a route_key")
        return consistent_hash(members, route_key)
    if group.policy == "least_active":
        if active is None or len(active) != len(members):
            raise ValueError("least_active needs one load per member")
        return least_active(members, active)
    if counter is None:
        raise ValueError(f"{group.policy} needs the group's counter")
    return (
        round_robin(members, counter)
        if group.policy == "round_robin"
        else weighted(members, counter)
    )
