"""Plain data: the only form in which a value computed by a model's program leaves its process.

A program under test is hostile (docs/rewards.md, "What a program can reach"). What it returns is
checked in another process, so it crosses as text, and only values of builtin types exactly (no
subclass, so no `__eq__` or `__hash__` of the program's) can be written or read:

    None, bool, int, float, complex, str, bytes, list, tuple, set, frozenset, dict

Every container is a JSON array that starts with its type's tag (`["tuple", 1, 2]`, `["dict", [k, v],
...]`), so a list and a tuple stay apart and a dict may have any plain key. `from_json` builds builtins
only, whatever text it is given: a forged or malformed reply fails to decode, it cannot make an
object that lies.

Standard library only (json): this file's source is bundled into the scripts that run in the sandbox
(`bundle`), where the package cannot be imported.
"""

import json

MAX_DEPTH = 64  # nesting deeper than this is not plain data (a cycle would otherwise recurse forever)
_SCALARS = (type(None), bool, int, float, str)
_TAGS = ("list", "tuple", "set", "frozenset", "dict", "bytes", "complex")


class NotPlain(ValueError):
    """A value that is not plain data (its type's name in the message), or text that does not decode
    to plain data."""


def to_json(value, depth=0):
    """`value` as a JSON-ready structure; NotPlain for anything but builtin types exactly."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    if depth >= MAX_DEPTH:
        raise NotPlain(f"nested deeper than {MAX_DEPTH}")
    if kind is list or kind is tuple or kind is set or kind is frozenset:
        items = [to_json(item, depth + 1) for item in value]
        if kind is set or kind is frozenset:
            items.sort(key=json.dumps)  # one text for one value, whatever the order of iteration
        return [kind.__name__, *items]
    if kind is dict:
        return ["dict", *([to_json(k, depth + 1), to_json(v, depth + 1)] for k, v in value.items())]
    if kind is bytes:
        return ["bytes", value.hex()]
    if kind is complex:
        return ["complex", value.real, value.imag]
    raise NotPlain(f"a {kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins"
                   else f"a {kind.__name__}")


def from_json(obj, depth=0):
    """The builtin value a `to_json` structure stands for; NotPlain for anything else."""
    kind = type(obj)
    if kind in _SCALARS:
        return obj
    if kind is not list or not obj or obj[0] not in _TAGS or depth >= MAX_DEPTH:
        raise NotPlain("not an encoded value")
    tag, items = obj[0], obj[1:]
    try:
        if tag == "bytes":
            (text,) = items
            return bytes.fromhex(text)
        if tag == "complex":
            real, imag = items
            if type(real) is not float or type(imag) is not float:
                raise NotPlain("a complex of non-floats")
            return complex(real, imag)
        if tag == "dict":  # each item a bare [key, value] array
            if any(type(p) is not list or len(p) != 2 for p in items):
                raise NotPlain("a dict entry that is not a pair")
            return {from_json(k, depth + 1): from_json(v, depth + 1) for k, v in items}
        values = [from_json(item, depth + 1) for item in items]
        if tag == "list":
            return values
        if tag == "tuple":
            return tuple(values)
        return set(values) if tag == "set" else frozenset(values)
    except (TypeError, ValueError) as e:  # an unhashable key or set member, bad hex, a wrong count
        raise NotPlain(f"a malformed {tag}: {e}") from None
