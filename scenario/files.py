"""Reading a user's data file (YAML, JSON or a plain pickle) and validating it, with errors that name the file."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import yaml

Model = TypeVar("Model", bound=pydantic.BaseModel)


class _PlainUnpickler(pickle.Unpickler):
    """Builds only builtin containers, strings and numbers: a data file cannot run code."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"the file may hold only dicts, lists and numbers, not {module}.{name}")


def read_data(path: Path, what: str) -> Any:
    """The contents of a pickle (protocol 2+, plain data only: FedScale ships its traces so), ``.json`` or YAML
    file; raises ValueError naming ``what``, the file and the problem."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what} {path}: {exc.strerror}") from None
    try:
        if raw[:1] == b"\x80":  # a pickle protocol 2+ stream
            return _PlainUnpickler(io.BytesIO(raw)).load()
        if Path(path).suffix == ".json":
            return json.loads(raw)
        return yaml.safe_load(raw)
    except (pickle.UnpicklingError, json.JSONDecodeError, yaml.YAMLError, EOFError, ValueError) as exc:
        raise ValueError(f"{what} {path}: cannot parse: {exc}") from None


def validate(data: Any, model: type[Model], what: str, path: Path) -> Model:
    """``data`` as ``model``; raises ValueError naming ``what``, the file and each problem."""
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"{what} {path}: {problems}") from None


def load_model(path: Path, model: type[Model], what: str) -> Model:
    """``model`` from a YAML, JSON or plain-pickle file (:func:`read_data`, :func:`validate`)."""
    return validate(read_data(path, what), model, what, path)
