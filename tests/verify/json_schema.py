"""A validator for the subset of JSON Schema that `freetoken_verify/report/schema.json` uses (type,
const, enum, properties, required, additionalProperties, items, minimum, pattern, anyOf), so
the report tests need no schema library. An unknown keyword is an error, not ignored: the
schema cannot silently outgrow what the tests check."""

from __future__ import annotations

import re

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
_ANNOTATIONS = {"$schema", "title", "description"}
_KEYWORDS = {"type", "const", "enum", "properties", "required", "additionalProperties", "items",
             "minimum", "pattern", "anyOf"} | _ANNOTATIONS


def _is_type(value, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[name])


def schema_errors(value, schema: dict, where: str = "$") -> list[str]:
    """Every way `value` breaks `schema`, as `path: problem` lines (empty: valid)."""
    unknown = set(schema) - _KEYWORDS
    if unknown:
        return [f"{where}: schema uses unsupported keywords {sorted(unknown)}"]
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else types
        if not any(_is_type(value, n) for n in names):
            return [f"{where}: {value!r} is not of type {types}"]
    errors = []
    if "const" in schema and value != schema["const"]:
        errors.append(f"{where}: {value!r} != {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} not in {schema['enum']}")
    if "anyOf" in schema and all(schema_errors(value, s, where) for s in schema["anyOf"]):
        errors.append(f"{where}: {value!r} matches none of anyOf")
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        errors.append(f"{where}: {value!r} does not match {schema['pattern']}")
    if _is_type(value, "number") and "minimum" in schema and value < schema["minimum"]:
        errors.append(f"{where}: {value} < {schema['minimum']}")
    if isinstance(value, dict):
        errors += _object_errors(value, schema, where)
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{where}[{i}]")
    return errors


def _object_errors(value: dict, schema: dict, where: str) -> list[str]:
    properties = schema.get("properties", {})
    errors = [f"{where}: missing {key!r}" for key in schema.get("required", ())
              if key not in value]
    for key, item in value.items():
        if key in properties:
            errors += schema_errors(item, properties[key], f"{where}.{key}")
        elif schema.get("additionalProperties", True) is False:
            errors.append(f"{where}: unexpected key {key!r}")
    return errors
