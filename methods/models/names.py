"""The model names, readable without importing torch (the command line's help lists them when it starts): the
backbones of :data:`fcl_emu.methods.models.classifier.BACKBONES` and ``auto``, as its ``MODELS`` has them
(tests/test_cli_surface.py holds the two equal)."""

MODELS: tuple[str, ...] = ("cnn", "cnn_bn", "resnet18", "resnet32", "cnn_leaky", "auto")


def one_of(names: tuple[str, ...] | list[str]) -> str:
    """``a, b or c``."""
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else list(names))


#: The names as the help lists them, ``auto`` first.
CHOICES: str = one_of(("auto", *(m for m in MODELS if m != "auto")))
