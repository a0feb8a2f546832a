"""The shared models package: backbones, the growing classifier, state helpers."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

from fcl_emu.methods.models.backbones import Backbone, ResNet18Cifar, ResNet32, SmallCNN, SmallCNNBN
from fcl_emu.methods.models.classifier import MODELS, IncrementalClassifier, build_model, resolve_model
from fcl_emu.methods.models.state import StateError, apply_delta, delta_arrays, load_arrays, state_to_arrays


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _received(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What a receiver holds: read-only arrays over bytes, as np.frombuffer gives them."""
    out = {}
    for k, v in arrays.items():
        a = np.frombuffer(v.tobytes(), dtype=v.dtype).reshape(v.shape)
        assert not a.flags.writeable
        out[k] = a
    return out


# --- backbones --------------------------------------------------------------

@pytest.mark.parametrize("cls,channels,size,dim", [
    (SmallCNN, 1, 28, 256), (SmallCNN, 1, 32, 256), (SmallCNN, 3, 32, 256), (SmallCNN, 3, 64, 256),
    (ResNet18Cifar, 3, 32, 512), (ResNet18Cifar, 3, 64, 512), (ResNet18Cifar, 1, 28, 512),
    (ResNet32, 3, 32, 64), (ResNet32, 3, 64, 64), (ResNet32, 1, 28, 64),
])
def test_backbone_feature_shapes(cls, channels, size, dim):
    torch.manual_seed(0)
    net = cls(in_channels=channels)
    assert isinstance(net, Backbone)
    assert net.out_dim == dim and net.in_channels == channels
    with torch.no_grad():
        f = net(torch.randn(2, channels, size, size))
    assert f.shape == (2, dim)
    assert torch.isfinite(f).all()


def test_parameter_counts():
    cnn = _n_params(SmallCNN(1))
    assert 100_000 <= cnn <= 500_000 and cnn == 281_216
    r18 = _n_params(ResNet18Cifar(3))
    assert 11.1e6 <= r18 <= 11.3e6 and r18 == 11_168_832
    r32 = _n_params(ResNet32(3))
    assert 0.45e6 <= r32 <= 0.47e6 and r32 == 463_504  # option-A shortcuts: no parameters
    assert _n_params(build_model("resnet32", (3, 32, 32), 10)) == 464_154  # He et al.'s 0.46M


def test_small_cnn_has_no_batchnorm_state():
    state = SmallCNN(1).state_dict()
    assert all(t.is_floating_point() for t in state.values())
    assert set(state) == {n for n, _ in SmallCNN(1).named_parameters()}


def test_resnet32_shortcuts_are_parameter_free():
    net = ResNet32(3)
    assert not any("shortcut" in name for name in net.state_dict())


# --- classifier and build_model ---------------------------------------------

@pytest.mark.parametrize("name,shape,concrete", [
    ("auto", (1, 28, 28), "cnn"), ("auto", (3, 32, 32), "cnn_bn"), ("auto", (3, 64, 64), "cnn_bn"),
    ("cnn", (3, 32, 32), "cnn"), ("resnet32", (3, 32, 32), "resnet32"),
])
def test_resolve_model(name, shape, concrete):
    assert resolve_model(name, shape) == concrete


def test_models_names():
    assert set(MODELS) == {"cnn", "cnn_bn", "resnet18", "resnet32", "cnn_leaky", "auto"}


@pytest.mark.parametrize("name,shape,backbone", [
    ("cnn", (1, 28, 28), SmallCNN), ("auto", (1, 28, 28), SmallCNN), ("cnn", (3, 32, 32), SmallCNN),
    ("resnet32", (3, 32, 32), ResNet32), ("resnet32", (1, 28, 28), ResNet32),
])
def test_build_model_logits(name, shape, backbone):
    model = build_model(name, shape, 7)
    assert isinstance(model, IncrementalClassifier) and isinstance(model.backbone, backbone)
    assert model.backbone.in_channels == shape[0]
    assert model.num_classes == 7 and isinstance(model.head, nn.Linear) and type(model.head) is nn.Linear
    x = torch.randn(2, *shape)
    with torch.no_grad():
        logits, feats = model.logits_and_features(x)
        assert model(x).shape == (2, 7) and torch.equal(model(x), logits)
        assert torch.equal(model.features(x), feats) and feats.shape == (2, model.feature_dim)
    assert {"head.weight", "head.bias"} <= set(model.state_dict())
    assert all(k.startswith(("backbone.", "head.")) for k in model.state_dict())


def test_build_model_auto_on_colour_images_and_resnet18():
    model = build_model("auto", (3, 32, 32), 3)
    assert type(model.backbone) is SmallCNNBN and model.feature_dim == 256
    model = build_model("resnet18", (3, 32, 32), 3)
    assert isinstance(model.backbone, ResNet18Cifar) and model.feature_dim == 512


@pytest.mark.parametrize("name,shape,num_classes,match", [
    ("vgg", (3, 32, 32), 10, "unknown model 'vgg'; choose one of cnn, cnn_bn, resnet18, resnet32, cnn_leaky, auto"),
    ("", (3, 32, 32), 10, "unknown model"),
    ("cnn", (28, 28), 10, r"input_shape must be \(channels, height, width\)"),
    ("cnn", (0, 28, 28), 10, "input_shape must be"),
    ("cnn", (1, 28.5, 28), 10, "input_shape must be"),
    ("cnn", (1, 4, 4), 10, "'cnn' needs inputs of at least 8x8 pixels, got 4x4"),
    ("resnet18", (3, 32, 2), 10, "'resnet18' needs inputs of at least 8x8"),
    ("auto", (28, 28, 1), 10, "'cnn' needs inputs of at least"),  # channels-last by mistake
    ("cnn", (1, 28, 28), -1, "num_classes must be >= 0"),
    ("cnn", (1, 28, 28), 2.5, "num_classes must be an integer"),
])
def test_build_model_errors(name, shape, num_classes, match):
    with pytest.raises(ValueError, match=match):
        build_model(name, shape, num_classes)


def test_build_model_is_deterministic_and_equals_growth_from_zero():
    torch.manual_seed(3)
    a = build_model("cnn", (1, 28, 28), 5)
    torch.manual_seed(3)
    b = build_model("cnn", (1, 28, 28), 0).expand(5)
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_zero_classes():
    model = build_model("cnn", (1, 28, 28), 0)
    assert model.num_classes == 0
    with torch.no_grad():
        assert model(torch.randn(2, 1, 28, 28)).shape == (2, 0)
    arrays = state_to_arrays(model)
    assert arrays["head.weight"].shape == (0, 256) and arrays["head.bias"].shape == (0,)


def test_expand_keeps_old_logits():
    torch.manual_seed(0)
    model = build_model("resnet32", (3, 32, 32), 4).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        before = model(x)
    old_w, old_b = model.head.weight.detach().clone(), model.head.bias.detach().clone()
    assert model.expand(9) is model
    assert model.num_classes == 9 and model.head.weight.shape == (9, 64) and model.head.bias.shape == (9,)
    assert torch.equal(model.head.weight[:4], old_w) and torch.equal(model.head.bias[:4], old_b)
    with torch.no_grad():
        after = model(x)
    assert after.shape == (2, 9)
    # Equal up to float32 rounding: BLAS picks its reduction order by the
    # output width, so bit-equality of the logits is not guaranteed.
    scale = before.abs().max().item()
    torch.testing.assert_close(after[:, :4], before, rtol=1e-5, atol=1e-6 * scale)
    assert not model.head.training  # keeps eval mode


def test_expand_new_rows_deterministic_and_fresh():
    def grown(seed):
        torch.manual_seed(0)
        m = build_model("cnn", (1, 28, 28), 2)
        torch.manual_seed(seed)
        return m.expand(6).head
    a, b, c = grown(1), grown(1), grown(2)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    assert not torch.equal(a.weight[2:], c.weight[2:])
    assert torch.equal(a.weight[:2], c.weight[:2])
    bound = 1 / 256 ** 0.5
    assert a.weight[2:].abs().max() <= bound and a.bias[2:].abs().max() <= bound
    assert a.weight[2:].std() > bound / 4  # really initialised, not zeros
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    h1 = build_model("cnn", (1, 28, 28), 0).expand(3, generator=g1).head
    h2 = build_model("cnn", (1, 28, 28), 0).expand(3, generator=g2).head
    assert torch.equal(h1.weight, h2.weight)


def test_expand_noop_and_shrink_error():
    model = build_model("cnn", (1, 28, 28), 5)
    head = model.head
    rng = torch.get_rng_state()
    model.expand(5)
    assert model.head is head and torch.equal(torch.get_rng_state(), rng)
    with pytest.raises(ValueError, match="cannot shrink the head from 5 to 3"):
        model.expand(3)
    with pytest.raises(TypeError):
        model.expand(6.0)


def test_expand_keeps_requires_grad_and_gradients_flow():
    model = build_model("cnn", (1, 28, 28), 2)
    model.head.weight.requires_grad_(False)
    model.expand(3)
    assert not model.head.weight.requires_grad and model.head.bias.requires_grad
    model.head.weight.requires_grad_(True)
    model(torch.randn(2, 1, 28, 28)).sum().backward()
    assert model.head.weight.grad is not None and model.head.weight.grad.shape == (3, 256)


def test_classifier_needs_out_dim():
    with pytest.raises(TypeError, match="out_dim"):
        IncrementalClassifier(nn.Linear(3, 4))


# --- state helpers -------------------------------------------------------------

def test_state_to_arrays_dtypes_and_views():
    model = build_model("resnet32", (3, 32, 32), 3)
    arrays = state_to_arrays(model)
    assert list(arrays) == list(model.state_dict())
    for k, a in arrays.items():
        assert a.flags.c_contiguous
        assert a.dtype == (np.int64 if k.endswith("num_batches_tracked") else np.float32), k
    # Zero-copy: the arrays are views of the module's memory.
    assert np.shares_memory(arrays["head.weight"], model.head.weight.detach().numpy())
    with torch.no_grad():
        model.head.bias.fill_(7.0)
    assert (arrays["head.bias"] == 7.0).all()


def test_state_to_arrays_converts_other_dtypes():
    lin = nn.Linear(3, 2).double()
    lin.register_buffer("steps", torch.tensor(3, dtype=torch.int32))
    arrays = state_to_arrays(lin)
    assert arrays["weight"].dtype == np.float32 and arrays["steps"].dtype == np.int64
    lin.register_buffer("mask", torch.ones(2, dtype=torch.bool))
    with pytest.raises(TypeError, match="torch.bool"):
        state_to_arrays(lin)


@pytest.mark.parametrize("name,shape", [("cnn", (1, 28, 28)), ("resnet32", (3, 32, 32))])
def test_state_round_trip(name, shape):
    torch.manual_seed(0)
    src = build_model(name, shape, 4)
    if name == "resnet32":  # move BatchNorm statistics away from their defaults
        src.train()
        with torch.no_grad():
            src(torch.randn(4, *shape))
    src.eval()
    torch.manual_seed(1)
    dst = build_model(name, shape, 4).eval()
    x = torch.randn(2, *shape)
    with torch.no_grad():
        assert not torch.equal(src(x), dst(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read-only buffers load without a warning
        assert load_arrays(dst, _received(state_to_arrays(src))) is dst
    with torch.no_grad():
        assert torch.equal(src(x), dst(x))
    for k, t in dst.state_dict().items():
        assert torch.equal(t, src.state_dict()[k]), k


def test_load_does_not_keep_references_to_the_arrays():
    model = build_model("cnn", (1, 28, 28), 2)
    arrays = {k: np.array(v, copy=True) for k, v in state_to_arrays(model).items()}
    load_arrays(model, arrays)
    arrays["head.bias"][:] = 123.0
    assert not (model.head.bias == 123.0).any()


def test_load_grows_head_without_touching_global_rng():
    torch.manual_seed(0)
    server = build_model("cnn", (1, 28, 28), 2).expand(7)
    client = build_model("cnn", (1, 28, 28), 2)
    rng = torch.get_rng_state()
    load_arrays(client, _received(state_to_arrays(server)))
    assert torch.equal(torch.get_rng_state(), rng)
    assert client.num_classes == 7
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        assert torch.equal(client(x), server(x))


def test_load_smaller_head_is_a_shape_error():
    small = state_to_arrays(build_model("cnn", (1, 28, 28), 2))
    big = build_model("cnn", (1, 28, 28), 5)
    with pytest.raises(StateError, match=r"head\.weight: expected shape \(5, 256\), received \(2, 256\)"):
        load_arrays(big, small)
    assert big.num_classes == 5


def _state(classes=3):
    return {k: np.array(v, copy=True) for k, v in state_to_arrays(build_model("cnn", (1, 28, 28), classes)).items()}


def test_load_missing_key():
    arrays = _state()
    del arrays["backbone.conv1.weight"]
    with pytest.raises(StateError, match=r"missing keys: backbone\.conv1\.weight"):
        load_arrays(build_model("cnn", (1, 28, 28), 3), arrays)


def test_load_unexpected_key():
    arrays = _state()
    arrays["backbone.extra"] = np.zeros(3, np.float32)
    with pytest.raises(StateError, match=r"unexpected keys: backbone\.extra"):
        load_arrays(build_model("cnn", (1, 28, 28), 3), arrays)


def test_load_wrong_shape_names_key_and_shapes_and_changes_nothing():
    model = build_model("cnn", (1, 28, 28), 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    arrays = _state()
    arrays["backbone.fc.bias"] = np.zeros(255, np.float32)
    arrays["head.bias"][:] = 5.0  # a valid key that must not be written
    with pytest.raises(StateError) as err:
        load_arrays(model, arrays)
    assert "backbone.fc.bias: expected shape (256,), received (255,)" in str(err.value)
    assert isinstance(err.value, ValueError)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_load_wrong_head_width_does_not_grow():
    model = build_model("cnn", (1, 28, 28), 3)
    arrays = _state(6)
    arrays["head.weight"] = np.zeros((6, 128), np.float32)
    with pytest.raises(StateError, match=r"head\.weight: expected shape \(6, 256\), received \(6, 128\)"):
        load_arrays(model, arrays)
    assert model.num_classes == 3


def test_load_wrong_dtype():
    arrays = _state()
    arrays["backbone.conv2.bias"] = arrays["backbone.conv2.bias"].astype(np.float64)
    with pytest.raises(StateError, match=r"backbone\.conv2\.bias: expected dtype float32, received float64"):
        load_arrays(build_model("cnn", (1, 28, 28), 3), arrays)
    resnet = build_model("resnet32", (3, 32, 32), 2)
    arrays = state_to_arrays(resnet)
    key = "backbone.bn1.num_batches_tracked"
    arrays[key] = arrays[key].astype(np.float32)
    with pytest.raises(StateError, match=r"num_batches_tracked: expected dtype int64, received float32"):
        load_arrays(resnet, arrays)


def test_load_rejects_non_arrays():
    arrays = _state()
    arrays["head.bias"] = [0.0, 0.0, 0.0]
    with pytest.raises(StateError, match=r"head\.bias: expected a numpy array, got list"):
        load_arrays(build_model("cnn", (1, 28, 28), 3), arrays)


def _trained_pair():
    """(old, new) states of a ResNet-32 with changed weights, BN statistics and step counters."""
    torch.manual_seed(0)
    model = build_model("resnet32", (3, 16, 16), 3)
    old = {k: np.array(v, copy=True) for k, v in state_to_arrays(model).items()}
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        loss = nn.functional.cross_entropy(model(torch.randn(4, 3, 16, 16)), torch.tensor([0, 1, 2, 0]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    new = {k: np.array(v, copy=True) for k, v in state_to_arrays(model).items()}
    return old, new


def test_delta_and_apply_are_inverse():
    old, new = _trained_pair()
    old_ro = _received(old)
    delta = delta_arrays(new, old_ro)
    assert set(delta) == set(new)
    nbt = "backbone.bn1.num_batches_tracked"
    assert delta[nbt].dtype == np.int64 and delta[nbt] == new[nbt] == 2
    assert delta["head.weight"].dtype == np.float32
    assert np.abs(delta["backbone.conv1.weight"]).max() > 0
    assert not any(np.shares_memory(delta[k], new[k]) or np.shares_memory(delta[k], old[k]) for k in delta)
    back = apply_delta(old_ro, delta)
    for k in new:
        assert back[k].dtype == new[k].dtype
        if new[k].dtype.kind == "f":
            np.testing.assert_allclose(back[k], new[k], rtol=0, atol=1e-6)
        else:
            assert np.array_equal(back[k], new[k])
    half = apply_delta(old, delta, scale=0.5)
    np.testing.assert_allclose(half["head.bias"], (old["head.bias"] + new["head.bias"]) / 2, atol=1e-6)
    assert half["head.bias"].dtype == np.float32 and half[nbt] == 2
    assert all(np.array_equal(old[k], old_ro[k]) for k in old)  # inputs untouched


def test_apply_partial_delta_carries_other_keys():
    old, new = _trained_pair()
    delta = {"head.bias": new["head.bias"] - old["head.bias"]}
    out = apply_delta(old, delta)
    assert out["backbone.conv1.weight"] is old["backbone.conv1.weight"]
    np.testing.assert_allclose(out["head.bias"], new["head.bias"], atol=1e-6)


def test_delta_errors():
    old, new = _trained_pair()
    missing = dict(new)
    del missing["head.bias"]
    with pytest.raises(StateError, match=r"cannot take delta: keys only in old: head\.bias"):
        delta_arrays(missing, old)
    grown = dict(new, **{"head.weight": np.zeros((4, 64), np.float32)})
    with pytest.raises(StateError, match=r"head\.weight: new has shape \(4, 64\), old has \(3, 64\)"):
        delta_arrays(grown, old)
    wrong = dict(new, **{"head.bias": new["head.bias"].astype(np.float64)})
    with pytest.raises(StateError, match=r"head\.bias: new has dtype float64, old has float32"):
        delta_arrays(wrong, old)
    extra = dict(new, **{"head.extra": np.zeros(1, np.float32)})
    with pytest.raises(StateError, match=r"keys only in new: head\.extra"):
        delta_arrays(extra, old)
    flags = {"m": np.ones(2, bool)}
    with pytest.raises(StateError, match="neither float nor integer"):
        delta_arrays(flags, flags)


def test_apply_delta_errors():
    old, new = _trained_pair()
    delta = delta_arrays(new, old)
    with pytest.raises(StateError, match=r"cannot apply delta: keys only in delta: head\.extra"):
        apply_delta(old, dict(delta, **{"head.extra": np.zeros(1, np.float32)}))
    with pytest.raises(StateError, match=r"head\.bias: state has shape \(3,\), delta has \(4,\)"):
        apply_delta(old, dict(delta, **{"head.bias": np.zeros(4, np.float32)}))
    with pytest.raises(StateError, match=r"head\.bias: state has dtype float32, delta has float64"):
        apply_delta(old, dict(delta, **{"head.bias": np.zeros(3, np.float64)}))
