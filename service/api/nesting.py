"""JSON nested no deeper than MAX_JSON_DEPTH levels, wherever corechat decodes it: request bodies,
the tool-call arguments of a conversation, and the tool calls a model writes.

Python's JSON decoder and the chat template's `tojson` recurse once per level, against the
process's recursion limit, so a request nested deep enough would raise RecursionError (a 500) at a
depth that depends on the stack it is parsed on. A fixed depth, checked after decoding, gives every
such request the same 400 at the same depth.
"""

import json

# Deeper than any tool schema or argument object; shallow enough that rendering it never nears the
# recursion limit.
MAX_JSON_DEPTH = 64


class TooDeep(ValueError):
    """JSON nested deeper than MAX_JSON_DEPTH levels."""

    def __init__(self):
        super().__init__(f"nested deeper than {MAX_JSON_DEPTH} levels")


def loads(text: str | bytes, **options):
    """Decode JSON as json.loads does, raising TooDeep (a ValueError) when it nests too deeply."""
    try:
        value = json.loads(text, **options)
    except RecursionError:
        raise TooDeep() from None
    # Counting brackets (C speed, strings included) bounds the depth from above: most documents
    # need no walk at all.
    brackets = (b"[", b"{") if isinstance(text, bytes) else ("[", "{")
    if sum(map(text.count, brackets)) > MAX_JSON_DEPTH and too_deep(value):
        raise TooDeep()
    return value


def too_deep(value) -> bool:
    """Tell whether a decoded JSON value nests arrays and objects deeper than MAX_JSON_DEPTH.

    A walk one level at a time, not a recursion, that creates no container per node.
    """
    if not isinstance(value, (dict, list)):
        return False
    level = [value]
    for _depth in range(MAX_JSON_DEPTH):
        below = []
        for node in level:
            children = node.values() if isinstance(node, dict) else node
            below += [child for child in children if isinstance(child, (dict, list))]
        if not below:
            return False
        level = below
    return True
