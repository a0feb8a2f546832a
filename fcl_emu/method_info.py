"""What ``fcl-emu methods`` prints: every method in a table, or one method in full (its options with their
defaults, its client optimiser, its server-side jobs, the extras it needs and the run features it refuses).
Every fact is read from the method's registry entry and code; text is escaped for rich, so that
``fcl-emu[text]`` shows as written.
"""

from __future__ import annotations

import re
from typing import Any, Literal, get_args, get_origin

from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from fcl_emu.options import bounds, value_type
from fcl_emu.methods import jobs
from fcl_emu.methods.base import ServerPart
from fcl_emu.methods.registry import MethodSpec
from fcl_emu.methods.requirements import missing_extras, pip_install
from fcl_emu.runconfig import RunConfig
from fcl_emu.runconfig.compatibility import method_refusals

_TRAINING_KEYS = ("optimizer", "lr", "momentum", "weight_decay", "local_epochs", "batch_size")


def _role(match: re.Match) -> str:
    """A reStructuredText role's text: ``:func:`~a.b.c``` is ``c``, ``:class:`words <target>``` is ``words``."""
    body = match.group(1)
    if "<" in body:
        return body.partition("<")[0].strip()
    return body[1:].rpartition(".")[2] if body.startswith("~") else body


def plain(text: str) -> str:
    """``text`` without reStructuredText markup: roles, literals, interpreted text, emphasis, directives."""
    text = re.sub(r"\.\. [\w-]+::\s*", "", text)
    text = re.sub(r":[\w:]+:`([^`]+)`", _role, text)
    text = re.sub(r"``([^`]+)``", r"\1", text)
    text = re.sub(r"`([^`]+)`_{0,2}", r"\1", text)
    return re.sub(r"\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*", lambda m: m.group(1) or m.group(2), text)


def _summary(obj: Any) -> str:
    """The first paragraph of ``obj``'s docstring, on one line, as plain text."""
    return plain(" ".join((obj.__doc__ or "").strip().split("\n\n")[0].split()))


def _value(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def extras_hint(spec: MethodSpec) -> str:
    """The extras ``spec`` needs and the command that installs them ("" for none)."""
    return f"{', '.join(spec.requires_extras)}: {pip_install(spec.requires_extras)}" if spec.requires_extras else ""


def methods_table(specs: list[MethodSpec]) -> Table:
    """One row per method: name, aliases, the extras it needs, its own local training settings, description."""
    table = Table("method", "aliases", "extras", "local training (its code's; where the config is silent)",
                  "description", caption="fcl-emu methods NAME: its options, optimiser, jobs, extras and refusals")
    for spec in specs:
        training = ", ".join(f"{k} {_value(v)}" for k, v in spec.training.items()) or "the run's"
        table.add_row(*(escape(cell) for cell in (spec.name, ", ".join(spec.aliases), extras_hint(spec) or "-",
                                                  training, spec.description)))
    return table


def _type(annotation: Any) -> str:
    if get_origin(annotation) is Literal:
        return "|".join(str(a) for a in get_args(annotation))
    annotation = value_type(annotation) if get_origin(annotation) is not None else annotation
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined:
        return "-" if field.default_factory is None else _value(field.default_factory())
    return "unset" if field.default is None else _value(field.default)


def options_table(spec: MethodSpec) -> Table:
    """The method's options (its ``Options`` model's fields): name, type, default, description and bounds."""
    table = Table("option", "type", "default", "description",
                  title="options (--method-option KEY=VALUE, or method_options: in the config)", title_justify="left")
    for name, field in spec.options.model_fields.items():
        about = "; ".join([field.description or "", *bounds(field)]).strip("; ")
        table.add_row(*(escape(cell) for cell in (name, _type(field.annotation), _default(field), about)))
    return table


def _overridden(part: type, base: type, hook: str) -> Any:
    """The method's own ``hook`` if its part overrides the base's, else None."""
    own = getattr(part, hook)
    return None if own is getattr(base, hook) else own


def optimiser_lines(spec: MethodSpec) -> list[str]:
    """The clients' local optimiser: what it trains, its settings (the method's own, or the run's defaults) and
    the learning rate's schedule over a task's rounds."""
    training = RunConfig.model_validate({"method": spec.name}).training
    values = {key: f"{key} {_value(getattr(training, key))}" for key in _TRAINING_KEYS}
    own = ", ".join(values[key] for key in _TRAINING_KEYS if key in spec.training)
    run = ", ".join(values[key] for key in _TRAINING_KEYS if key not in spec.training)
    schedule = _overridden(spec.server, ServerPart, "learning_rate")
    return [f"client optimiser: {_summary(spec.client.make_optimizer).rstrip('.')}; "
            + (f"{own} (the method's code), " if own else "") + f"{run} (the run's); the config's training "
            f"section, --lr and --local-epochs override them",
            f"learning rate over a task's rounds: {_summary(schedule).rstrip('.') if schedule else 'constant'}"]


def requirement_lines(spec: MethodSpec) -> list[str]:
    """Extras (installed or not), and what the method rules out and why (the compatibility table's method entries:
    models, run features; docs/compatibility.md)."""
    lines = []
    if spec.requires_extras:
        state = "missing here" if missing_extras(spec.requires_extras) else "installed"
        lines.append(f"needs the extra {extras_hint(spec)} ({state})")
    lines += [f"refuses {feature}: {why}" for feature, why in method_refusals(spec)]
    return lines or ["needs no extra and takes every run feature"]


def method_card(spec: MethodSpec) -> Group:
    """Everything ``fcl-emu methods NAME`` prints about one method."""
    head = Text(spec.name, style="bold")
    head.append(f" ({', '.join(spec.aliases)})" if spec.aliases else "")
    head.append(f": {spec.description}")
    job_kinds = jobs.kinds(spec.name)
    job_lines = [f"  {kind}: {_summary(fn)}" for kind, fn in job_kinds.items()]
    server = (["server-side jobs (on the GPU worker pool, docs/gpu.md):", *job_lines] if job_lines
              else ["server-side jobs: none"])
    return Group(head, options_table(spec),
                 *(Text(line) for line in (*optimiser_lines(spec), *server, *requirement_lines(spec))))
