"""Reading a user's YAML or JSON file into a validated pydantic model, with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

import pydantic
import yaml

Model = TypeVar("Model", bound=pydantic.BaseModel)


def load_model(path: Path, model: type[Model], what: str) -> Model:
    """``model`` from a YAML (or ``.json``) file; raises ValueError naming ``what``, the file and the problem."""
    try:
        text = Path(path).read_text()
        data = json.loads(text) if Path(path).suffix == ".json" else yaml.safe_load(text)
    except OSError as exc:
        raise ValueError(f"{what} {path}: {exc.strerror}") from None
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"{what} {path}: cannot parse: {exc}") from None
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"{what} {path}: {problems}") from None
