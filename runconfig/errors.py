"""Validation errors in the project's words, one line each: what a pydantic error says, rewritten (no "Input
should be", no "Extra inputs are not permitted"), with the closest known key, option, method or choice for a
mistyped one (:func:`did_you_mean`)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable
from typing import Any

import pydantic

from fcl_emu.aggregation.choice import members


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """``"; did you mean X?"`` for the known name closest to a mistyped ``word`` (``""`` where none is close)."""
    close = difflib.get_close_matches(word, list(known), n=1)
    return f"; did you mean {close[0]}?" if close else ""


def _dotted(loc: tuple) -> str:
    return ".".join(str(part) for part in loc)


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel)


def _keys_at(model: Any, path: tuple) -> list[str]:
    """The keys the pydantic model ``model`` takes at ``path`` (through its nested models; [] past them)."""
    for key in path:
        field = model.model_fields.get(key) if _is_model(model) else None
        if field is None:
            return []
        model = field.annotation
    return list(model.model_fields) if _is_model(model) else []


def _untagged(model: Any, loc: tuple) -> tuple:
    """``loc`` less the part's name pydantic puts after a part chosen with its options (``aggregation.rule.krum.
    byzantine`` is ``aggregation.rule.byzantine``: :mod:`fcl_emu.aggregation.choice`)."""
    out: list = []
    for key in loc:
        field = model.model_fields.get(key) if _is_model(model) else None
        parts = members(field.annotation) if field is not None else ()
        out.append(key)
        model = field.annotation if field is not None else None
        if parts:
            tags = {p.model_fields["name"].default: p for p in parts}
            rest = loc[len(out):]
            if rest and rest[0] in tags:
                return (*out, *_untagged(tags[rest[0]], rest[1:]))
    return tuple(out)


def _all_keys(model: Any, prefix: str = "") -> dict[str, str]:
    """Every key of ``model`` and its nested models: its name -> its dotted path."""
    out: dict[str, str] = {}
    for name, field in model.model_fields.items():
        out.setdefault(name, prefix + name)
        if _is_model(field.annotation):
            out.update({k: v for k, v in _all_keys(field.annotation, f"{prefix}{name}.").items() if k not in out})
    return out


_WORDS = {"greater_than_equal": "must be at least {ge}", "greater_than": "must be more than {gt}",
          "less_than_equal": "must be at most {le}", "less_than": "must be less than {lt}",
          "literal_error": "must be one of {expected}"}
_PREFIXES = (("Value error, ", ""), ("Assertion failed, ", ""), ("Input should be", "must be"))  # pydantic's


def _value(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def error_lines(exc: pydantic.ValidationError, model: type[pydantic.BaseModel],
                where: Callable[[tuple], str] = _dotted, unknown: str = "unknown key") -> list[str]:
    """Each error of ``exc`` (validating ``model``) as one line in the project's words, ``where: what``:
    ``where(loc)`` names the flag or key; a mistyped key or choice gets the closest known one ("did you mean");
    a bound says the value given."""
    lines = []
    for error in exc.errors():
        loc, kind, given = _untagged(model, tuple(error["loc"])), error["type"], error.get("input")
        ctx = {key: _value(value) for key, value in (error.get("ctx") or {}).items()}
        if kind == "extra_forbidden":
            known, anywhere = _keys_at(model, loc[:-1]), _all_keys(model)
            close = difflib.get_close_matches(str(loc[-1]), list(anywhere), n=1, cutoff=0.8)  # at the wrong level
            hint = (did_you_mean(str(loc[-1]), known) or (f"; did you mean {anywhere[close[0]]}?" if close else "")
                    or (f" (known: {', '.join(known)})" if known else ""))
            what = unknown + hint
        elif kind in _WORDS:
            what = _WORDS[kind].format(**ctx) + (f" (got {given!r})" if isinstance(given, (int, float, str)) else "")
            if kind == "literal_error" and isinstance(given, str):
                what += did_you_mean(given, re.findall(r"'([^']*)'", ctx["expected"]))
        else:
            what = error["msg"]
            for prefix, words in _PREFIXES:
                what = words + what[len(prefix):] if what.startswith(prefix) else what
        lines.append(f"{where(loc)}: {what}" if loc else what)
    return lines


def method_spec(name: str):
    """The registered method ``name`` (or alias); an unknown one is a ValueError naming the closest known."""
    from fcl_emu.methods import registry

    try:
        return registry.get(name)
    except KeyError as exc:
        raise ValueError(f"{exc.args[0]}{did_you_mean(name, registry.names())}") from None


def check_method_options(spec, options: dict[str, Any]) -> None:
    """Validate ``options`` against the method's ``Options``: a ValueError in the project's words if they fail."""
    try:
        spec.options(**options)
    except pydantic.ValidationError as exc:
        raise ValueError("; ".join(error_lines(exc, spec.options, lambda loc: "method option " + _dotted(loc),
                                               unknown=f"{spec.name} has no such option"))) from None
