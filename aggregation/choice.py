"""A registered part of aggregation chosen with its typed options, as a method is: the run config's ``rule``,
``policy`` and ``server_optimizer`` each name a part and set the options that part declares
(``rule: {name: krum, byzantine: 2}``; ``rule: krum`` takes its defaults).

Each part declares its options as a subclass of :class:`PartOptions` (its ``Options``). :func:`choice` makes the
config field that chooses among a registry's parts: a pydantic union tagged by ``name``, whose value is the chosen
part's options with its name (``config.aggregation.rule.byzantine``), and which refuses, in one line, an unknown
name or an option the chosen part does not take, naming the parts that take it."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import pydantic


class PartOptions(pydantic.BaseModel):
    """A part's typed options; a part declares its subclass with defaults and descriptions (none: no options).
    ``name`` is the chosen part's, set by :func:`choice`."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    name: str = ""

    @classmethod
    def option_names(cls) -> list[str]:
        return [key for key in cls.model_fields if key != "name"]

    def values(self) -> dict[str, Any]:
        """The options without the name."""
        return self.model_dump(exclude={"name"})


def _words(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def choice(table: Mapping[str, Any], what: str, default: str) -> tuple[Any, PartOptions]:
    """The config field's type for one part of ``table`` (name -> a part with ``Options``; ``what`` names the
    kind of part in errors) and its default value (part ``default`` with its defaults)."""
    tagged = {name: pydantic.create_model(f"{name}_options", __base__=part.Options, __module__=__name__,
                                          name=(Literal[name], name))
              for name, part in table.items()}

    def named(value: Any) -> Any:
        if isinstance(value, str):
            value = {"name": value}
        if not isinstance(value, Mapping):
            return value  # an options object (checked by its tag), or a wrong type pydantic refuses
        name = value.get("name", default)
        if name not in tagged:
            close = difflib.get_close_matches(str(name), list(tagged), n=1)
            raise ValueError(f"unknown {what} {name!r}; choose one of {', '.join(tagged)}"
                             + (f"; did you mean {close[0]}?" if close else ""))
        takes = tagged[name].option_names()
        for key in value:
            if key != "name" and key not in takes:
                others = [other for other, model in tagged.items() if key in model.model_fields]
                close = difflib.get_close_matches(str(key), takes, n=1)
                who = (f"{_words(others)} {'takes' if len(others) == 1 else 'take'} it" if others
                       else f"did you mean {close[0]}?" if close else f"no {what} does")
                raise ValueError(f"{what} {name} takes no option {key} ({who}; {name} takes "
                                 f"{_words(takes) if takes else 'none'})")
        return {**value, "name": name}

    union = Union[tuple(tagged.values())]  # type: ignore[valid-type]
    field = Annotated[union, pydantic.Field(discriminator="name"), pydantic.BeforeValidator(named)]
    return field, tagged[default]()


def members(annotation: Any) -> tuple[type[PartOptions], ...]:
    """The tagged options models of a :func:`choice` field's annotation (empty for any other field)."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) is Union:
        parts = tuple(a for a in get_args(annotation) if isinstance(a, type) and issubclass(a, PartOptions))
        return parts if len(parts) == len(get_args(annotation)) else ()
    return ()
