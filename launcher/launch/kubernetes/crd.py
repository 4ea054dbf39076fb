"""A CRD's structural schema and CEL rules applied to one object, as the API server does on
create: types, required fields, enums, bounds, formats it can check, unknown fields (which the
server would prune or, with ``kubectl --validate=strict``, refuse) and ``x-kubernetes-validations``
rules evaluated with cel-python. Transition rules (on ``oldSelf``) do not apply to a create.
"""

from __future__ import annotations

import functools
import re
from typing import Any

TYPES = {"object": dict, "array": list, "string": str, "boolean": bool}


def schema_problems(value: Any, schema: dict, path: str = "") -> list[str]:
    """Every way ``value`` breaks ``schema`` (paths like ``.spec.trainer.numNodes``)."""
    where = path or "."
    if schema.get("x-kubernetes-int-or-string"):
        if not isinstance(value, (int, str)) or isinstance(value, bool):
            return [f"{where}: must be an integer or a string"]
    elif (kind := _type_problem(value, schema.get("type"))) is not None:
        return [f"{where}: {kind}"]
    problems = _bounds(value, schema, where)
    if isinstance(value, dict):
        problems += _object(value, schema, path)
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            problems += schema_problems(item, schema["items"], f"{path}[{i}]")
    return problems + rule_problems(value, schema, where)


def _type_problem(value: Any, kind: str | None) -> str | None:
    if kind is None:
        return None
    if kind in ("integer", "number"):
        ok = isinstance(value, int if kind == "integer" else (int, float)) and \
            not isinstance(value, bool)
    else:
        ok = isinstance(value, TYPES[kind])
    return None if ok else f"must be of type {kind}, not {type(value).__name__} ({value!r})"


def _bounds(value: Any, s: dict, where: str) -> list[str]:
    out = []
    if "enum" in s and value not in s["enum"]:
        out.append(f"{where}: {value!r} is not one of {s['enum']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in s and value < s["minimum"]:
            out.append(f"{where}: {value} is below the minimum {s['minimum']}")
        if "maximum" in s and value > s["maximum"]:
            out.append(f"{where}: {value} is above the maximum {s['maximum']}")
    size = len(value) if isinstance(value, (str, list, dict)) else None
    for key, test in (("maxLength", "long"), ("maxItems", "many"), ("maxProperties", "many")):
        if size is not None and key in s and size > s[key]:
            out.append(f"{where}: {size} is too {test} ({key} {s[key]})")
    for key in ("minLength", "minItems"):
        if size is not None and key in s and size < s[key]:
            out.append(f"{where}: {size} is under {key} {s[key]}")
    if isinstance(value, str) and "pattern" in s and not re.search(s["pattern"], value):
        out.append(f"{where}: {value!r} does not match {s['pattern']!r}")
    return out


def _object(value: dict, s: dict, path: str) -> list[str]:
    props = s.get("properties")
    extra = s.get("additionalProperties")
    out = [f"{path or '.'}: required field {k!r} is missing" for k in s.get("required", [])
           if k not in value]
    for key, item in value.items():
        sub = f"{path}.{key}"
        if props and key in props:
            out += schema_problems(item, props[key], sub)
        elif isinstance(extra, dict):
            out += schema_problems(item, extra, sub)
        elif props is not None and not s.get("x-kubernetes-preserve-unknown-fields") \
                and extra is not True:
            out.append(f"{sub}: unknown field (the API server would drop it)")
    return out


def rule_problems(value: Any, schema: dict, where: str) -> list[str]:
    """The CEL rules on this node that ``value`` breaks (transition rules skipped)."""
    out = []
    for rule in schema.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"]:
            continue
        try:
            ok = _program(rule["rule"]).evaluate({"self": _to_cel(value)})
        except Exception as exc:  # an unevaluable rule is a problem, never a silent pass
            out.append(f"{where}: CEL rule {rule['rule']!r} could not be evaluated: {exc}")
            continue
        if not bool(ok):
            out.append(f"{where}: {rule.get('message') or rule['rule']} (CEL: {rule['rule']})")
    return out


@functools.lru_cache(maxsize=None)
def _program(rule: str):
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(rule))


def _to_cel(value: Any):
    import celpy

    return celpy.json_to_cel(value)
