"""The nesting depth of a JSON value, measured without recursion.

A schema nested 2,000 levels deep must be refused with a typed error, not a
``RecursionError`` from whatever walks it first: :func:`json_depth_exceeds` walks with an
explicit stack and stops as soon as the depth passes a bound.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["json_depth_exceeds"]


def json_depth_exceeds(value: object, limit: int) -> int | None:
    """The first depth past ``limit`` that ``value`` reaches (``limit + 1``), or ``None`` when
    it nests ``limit`` levels or fewer. A dict or list is one level; scalars are none.
    Iterative: any depth is safe."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children: list[object] = list(item.values())
        elif isinstance(item, (list, tuple)):
            children = list(item)
        else:
            continue
        if depth > limit:
            return depth
        for child in children:
            if isinstance(child, (Mapping, list, tuple)):
                stack.append((child, depth + 1))
    return None
