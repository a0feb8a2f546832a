"""Module state as flat ``name -> numpy array`` maps: what travels on the wire.

Every place that sends or receives weights (model deltas, generators, VAEs,
checkpoints) goes through these helpers, so there is one convention:

- keys are the module's ``state_dict`` keys;
- floating tensors travel as C-contiguous ``float32``, integer buffers (such
  as BatchNorm's ``num_batches_tracked``) as ``int64``; any other dtype
  (bool, complex) is refused;
- a delta is ``new - old`` for float tensors and the new value for integer
  buffers (a step counter is not something to average or add).

Head growth: :func:`load_arrays` into a module with a growable ``head``
(an :class:`~fcl_emu.methods.models.classifier.IncrementalClassifier`) whose
``head.weight`` in the arrays has more rows than the module's grows the head
first, so a client learns the class count from the state it receives. A
smaller head in the arrays is a shape error (heads never shrink).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

__all__ = ["StateError", "state_to_arrays", "load_arrays", "delta_arrays", "apply_delta", "wire_dtype", "read_only",
           "strip_prefix", "model_arrays", "head_size"]

Arrays = dict[str, np.ndarray]

_HEAD_W, _HEAD_B = "head.weight", "head.bias"
_NOT_WRITABLE = "The given NumPy array is not writable"


class StateError(ValueError):
    """Arrays that do not fit a module (or each other): missing, unexpected, wrong shape or dtype."""


def wire_dtype(t: torch.Tensor) -> np.dtype:
    """The numpy dtype a tensor travels as: float32 for floats, int64 for integers."""
    if t.is_floating_point():
        return np.dtype(np.float32)
    if t.dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        return np.dtype(np.int64)
    raise TypeError(f"tensors of dtype {t.dtype} cannot travel as model state")


def state_to_arrays(module: nn.Module) -> Arrays:
    """The module's state dict as C-contiguous numpy arrays (float32 / int64).

    No copy where torch allows it: for a float32 / int64 contiguous tensor
    on the CPU the array is a *view of the module's memory*, so it changes
    when the module is trained or loaded. Take ``np.array(a, copy=True)``
    for a snapshot. Other dtypes, other devices or non-contiguous tensors
    are copied.
    """
    out: Arrays = {}
    for name, t in module.state_dict().items():
        t = t.detach()
        dt = wire_dtype(t)
        if t.dtype != (torch.float32 if dt.kind == "f" else torch.int64):
            t = t.to(torch.float32 if dt.kind == "f" else torch.int64)
        a = t.cpu().numpy()
        if not a.flags.c_contiguous:
            a = np.ascontiguousarray(a)
        out[name] = a
    return out


def _growable_head(module: nn.Module) -> nn.Linear | None:
    head = getattr(module, "head", None)
    if isinstance(head, nn.Linear) and callable(getattr(module, "expand", None)):
        return head
    return None


def _fmt_keys(keys: set[str], limit: int = 8) -> str:
    ks = sorted(keys)
    more = f" and {len(ks) - limit} more" if len(ks) > limit else ""
    return ", ".join(ks[:limit]) + more


def _check_keys(expected: set[str], received: set[str], what: str) -> None:
    missing, unexpected = expected - received, received - expected
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing keys: {_fmt_keys(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {_fmt_keys(unexpected)}")
        raise StateError(f"{what}: " + "; ".join(parts))


def _as_array(name: str, value: object) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    raise StateError(f"{name}: expected a numpy array, got {type(value).__name__}")


def _to_tensor(a: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``a``'s memory, used only as the source of a copy.

    ``torch.from_numpy`` warns (once per process) when ``a`` is read-only,
    as received wire buffers are, because the tensor could be written to.
    Here it is only read, so that one warning is filtered out for this call.
    ``warnings.catch_warnings`` is process-global: another thread's warning
    raised in the same instant could be hidden too, a harmless loss; since
    torch emits this warning only once, later calls pay nothing.
    Negative strides (which torch cannot view) are copied first.
    """
    if any(s < 0 for s in a.strides):
        a = np.ascontiguousarray(a)
    if a.flags.writeable:
        return torch.from_numpy(a)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NOT_WRITABLE, category=UserWarning)
        return torch.from_numpy(a)


def load_arrays(module: nn.Module, arrays: Mapping[str, np.ndarray]) -> nn.Module:
    """Copy ``arrays`` into ``module``'s parameters and buffers; returns ``module``.

    The arrays must hold exactly the module's state-dict keys, each with the
    module's shape and the wire dtype (float32 for float tensors, int64 for
    integer buffers); otherwise :class:`StateError` (a ``ValueError``) names
    the keys, or the key with the expected and received shape / dtype.
    Everything is checked before anything is written, so a failed load
    leaves the module as it was. A larger ``head`` in the arrays grows the
    module's head first (see the module docstring).

    The arrays may be read-only views of received buffers: they are only
    read (``tensor.copy_``), never kept, so the module owns its memory
    afterwards and the buffers may be released.
    """
    state = module.state_dict()
    received = {k: _as_array(k, v) for k, v in arrays.items()}
    _check_keys(set(state), set(received), f"cannot load state into {type(module).__name__}")

    expected = {k: (tuple(t.shape), wire_dtype(t)) for k, t in state.items()}
    grow_to = None
    head = _growable_head(module)
    if head is not None and _HEAD_W in received and received[_HEAD_W].ndim == 2:
        rows = received[_HEAD_W].shape[0]
        if rows > head.out_features:
            grow_to = rows
            expected[_HEAD_W] = ((rows, head.in_features), expected[_HEAD_W][1])
            if _HEAD_B in expected:
                expected[_HEAD_B] = ((rows,), expected[_HEAD_B][1])

    errors = []
    for k, (shape, dt) in expected.items():
        a = received[k]
        if a.shape != shape:
            errors.append(f"{k}: expected shape {shape}, received {a.shape}")
        elif a.dtype != dt:
            errors.append(f"{k}: expected dtype {dt}, received {a.dtype} (shape {a.shape})")
    if errors:
        raise StateError(f"cannot load state into {type(module).__name__}: " + "; ".join(errors))

    if grow_to is not None:
        # The new rows are overwritten right away: draw them from a private
        # generator so that loading never advances torch's global RNG.
        module.expand(grow_to, generator=torch.Generator().manual_seed(0))
        state = module.state_dict()
    with torch.no_grad():
        for k, t in state.items():
            t.copy_(_to_tensor(received[k]))
    return module


def _check_pair(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray], what: str,
                names: tuple[str, str], same_keys: bool) -> None:
    """Keys, shapes and dtypes of ``b`` against ``a``; ``names`` label them in messages."""
    na, nb = names
    only_a, only_b = set(a) - set(b), set(b) - set(a)
    parts = []
    if only_a and same_keys:
        parts.append(f"keys only in {na}: {_fmt_keys(only_a)}")
    if only_b:
        parts.append(f"keys only in {nb}: {_fmt_keys(only_b)}")
    if parts:
        raise StateError(f"{what}: " + "; ".join(parts))
    errors = []
    for k in b:
        x, y = np.asarray(a[k]), np.asarray(b[k])
        if x.shape != y.shape:
            errors.append(f"{k}: {na} has shape {x.shape}, {nb} has {y.shape}")
        elif x.dtype != y.dtype:
            errors.append(f"{k}: {na} has dtype {x.dtype}, {nb} has {y.dtype}")
        elif x.dtype.kind not in "fiu":
            errors.append(f"{k}: dtype {x.dtype} is neither float nor integer")
    if errors:
        raise StateError(f"{what}: " + "; ".join(errors))


def delta_arrays(new: Mapping[str, np.ndarray], old: Mapping[str, np.ndarray]) -> Arrays:
    """``new - old`` for float arrays, ``new``'s value (a copy) for integer arrays.

    Both maps must have the same keys, shapes and dtypes (a grown head is a
    shape error: grow the old state's model before taking a delta). The
    result never aliases ``new`` or ``old``.
    """
    _check_pair(new, old, "cannot take delta", ("new", "old"), same_keys=True)
    out: Arrays = {}
    for k, n in new.items():
        n = np.asarray(n)
        if n.dtype.kind == "f":
            out[k] = np.subtract(n, old[k])
        else:
            out[k] = np.array(n, copy=True)
    return out


def apply_delta(arrays: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray], scale: float = 1.0) -> Arrays:
    """A new map ``arrays + scale * delta`` (the inverse of :func:`delta_arrays` at ``scale=1``).

    Float arrays: ``a + scale * d`` in ``a``'s dtype. Integer arrays: ``d``
    (the new value; ``scale`` does not apply). Keys absent from ``delta``
    are carried over unchanged (the same array objects); a key of ``delta``
    that ``arrays`` lacks, or a shape / dtype mismatch, is a
    :class:`StateError`. The inputs are not modified (they may be read-only).
    """
    _check_pair(arrays, delta, "cannot apply delta", ("state", "delta"), same_keys=False)
    out: Arrays = dict(arrays)
    for k, d in delta.items():
        a = np.asarray(arrays[k])
        d = np.asarray(d)
        if a.dtype.kind == "f":
            step = d if scale == 1.0 else d * a.dtype.type(scale)
            out[k] = np.add(a, step, dtype=a.dtype)
        else:
            out[k] = np.array(d, copy=True)
    return out


def read_only(arrays: Mapping[str, np.ndarray], copy: bool = True) -> Arrays:
    """The arrays made read-only (copied first unless ``copy`` is False): a server part's state is sent
    zero-copy, so it must never change after sending."""
    out = {}
    for k, v in arrays.items():
        a = np.array(v, copy=True) if copy else v
        a.flags.writeable = False
        out[k] = a
    return out


def strip_prefix(arrays: Mapping[str, np.ndarray], prefix: str) -> Arrays:
    """The tensors whose names start with ``prefix``, under the rest of their names."""
    return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}


def model_arrays(arrays: Mapping[str, np.ndarray]) -> Arrays:
    """The classifier's own tensors of a received state: state-dict keys never hold a '/', method tensors
    that ride along (``<method>/...``, such as LANDER's projector) always do."""
    return {k: v for k, v in arrays.items() if "/" not in k}


def head_size(arrays: Mapping[str, np.ndarray]) -> int:
    """The classes of the head in a classifier's state (0 without a head)."""
    return int(arrays[_HEAD_W].shape[0]) if _HEAD_W in arrays else 0
