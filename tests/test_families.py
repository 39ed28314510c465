"""Family names (vgg16, resnet50) resolve to the variant that fits the data; padding; default learning rates."""

import numpy as np
import pytest

from pydtnn import data, models
from pydtnn.backends import CPUBackend
from pydtnn.data.pad import PaddedDataset
from pydtnn.errors import ConfigError
from pydtnn.losses import SoftmaxCrossEntropy
from pydtnn.models.families import FAMILIES, recipe, resolve, variant


def params_of(variant_name, shape, classes=10):
    return models.create(variant_name, input_shape=shape, num_classes=classes).count_params()


def test_every_family_names_registered_variants():
    for family, variants in FAMILIES.items():
        assert any(variants.values()), family
        for v in filter(None, variants.values()):
            assert v in models.names(), (family, v)
    assert not set(FAMILIES) & set(models.names())


@pytest.mark.parametrize("family,shape,expected", [
    ("vgg16", (1, 28, 28), "vgg16_cifar10"), ("vgg16", (3, 32, 32), "vgg16_cifar10"),
    ("vgg16", (3, 64, 64), "vgg16_cifar10"), ("vgg16", (3, 65, 65), "vgg16_imagenet"),
    ("vgg16", (3, 224, 224), "vgg16_imagenet"), ("vgg11bn", (3, 32, 32), "vgg11bn_cifar10"),
    ("resnet20", (3, 224, 224), "resnet20_cifar10"), ("resnet50", (1, 28, 28), "resnet50_imagenet"),
    ("densenet121", (3, 32, 32), "densenet121_imagenet"), ("densenet100", (3, 32, 32), "densenet_cifar10"),
    ("mobilenetv1", (3, 224, 224), "mobilenetv1_imagenet"), ("inceptionv3", (3, 299, 299), "inceptionv3_imagenet"),
    ("resnet20_cifar10", (3, 224, 224), "resnet20_cifar10"),  # a registered name is taken as it is
])
def test_variant_by_image_size(family, shape, expected):
    assert variant(family, shape) == expected


def test_small_images_are_padded_to_the_design_size_and_the_header_notes_say_so():
    choice, n = resolve("vgg16", (1, 28, 28), 10, build=params_of)
    assert choice.name == "vgg16_cifar10" and choice.input_shape == (1, 32, 32)
    # the design architecture: vgg16_cifar10 at 3x32x32 less the first layer's two missing input channels
    assert n == models.create("vgg16_cifar10").count_params() - 2 * 64 * 9
    notes = " | ".join(choice.notes)
    assert "vgg16 is vgg16_cifar10" in notes and "1 channel (designed for 3)" in notes
    assert "28x28 images zero-padded to its design size 32x32" in notes


def test_resnet20_on_digits_is_resnet20_with_one_input_channel_stated():
    choice, n = resolve("resnet20_cifar10", (1, 28, 28), 10, build=params_of)
    assert n == 272_474 - 2 * 16 * 9 and choice.input_shape == (1, 32, 32)
    assert any("1 channel (designed for 3)" in s for s in choice.notes)


def test_imagenet_variant_on_small_images_is_built_for_them_and_classes_are_stated():
    choice, _ = resolve("resnet18", (1, 28, 28), 10, build=lambda v, s: None)
    assert choice.name == "resnet18_imagenet" and choice.input_shape == (1, 28, 28)  # 224 would be 64x the pixels
    assert any("10 classes (designed for 1000)" in s for s in choice.notes)
    choice, _ = resolve("resnet20_cifar10", (3, 32, 32), 10, build=lambda v, s: None)
    assert choice.notes == []


@pytest.mark.parametrize("name", ["inceptionv3", "densenet121", "vgg16_imagenet"])
def test_a_model_that_cannot_take_the_images_names_what_fits(name):
    with pytest.raises(ConfigError) as e:
        resolve(name, (1, 28, 28), 10)
    msg = str(e.value)
    assert "cannot take 1x28x28 images" in msg and "(imagenet)" in msg and "resnet20" in msg
    assert "\n" not in msg


def test_create_takes_family_names():
    m = models.create("resnet20", input_shape=(3, 32, 32))
    assert m.name == "resnet20_cifar10" and m.count_params() == 272_474


def test_misspelled_model_gets_a_suggestion():
    with pytest.raises(ConfigError, match="did you mean 'mobilenetv1'"):
        models.create("mobilenet")


def test_padded_dataset_centres_the_image_on_normalized_black():
    x = np.arange(2 * 3 * 4 * 5, dtype=np.uint8).reshape(2, 3, 4, 5)
    mean, std = np.array([10.0, 20.0, 30.0]), np.array([2.0, 4.0, 5.0])
    ds = data.ArrayDataset(x, np.array([0, 1]), 2, mean=mean, std=std)
    padded = PaddedDataset(ds, (3, 8, 7))
    assert padded.input_shape == (3, 8, 7) and len(padded) == 2
    out, y = padded.get_batch(np.array([1, 0]), np.float64)
    inner, _ = ds.get_batch(np.array([1, 0]), np.float64)
    assert out.shape == (2, 3, 8, 7) and list(y) == [1, 0]
    np.testing.assert_array_equal(out[:, :, 2:6, 1:6], inner)
    black = (0 - mean) / std
    border = out.copy()
    border[:, :, 2:6, 1:6] = np.nan
    for c in range(3):
        vals = border[:, c][~np.isnan(border[:, c])]
        np.testing.assert_allclose(vals, black[c])
    assert PaddedDataset(ds, (3, 8, 7)).subset(np.array([1])).get_batch(np.array([0]))[0].shape == (1, 3, 8, 7)
    with pytest.raises(ConfigError, match="cannot pad 3x4x5 images to 3x3x7"):
        PaddedDataset(ds, (3, 3, 7))


# -- every family trains from its default learning rate ---------------------------------------
@pytest.fixture(scope="module", autouse=True)
def every_core():
    """The training tests below take minutes: they split their kernels over every core this process may
    use (BLAS one thread inside each split, as the trainer sets it), whatever thread count the tests
    before them left; the count is restored after the module."""
    from threadpoolctl import threadpool_limits

    from pydtnn.backends.cpu import threads

    before = threads.threads()
    threads.set_threads(threads.default_threads())
    with threadpool_limits(1, user_api="blas"):
        yield
    threads.set_threads(before)


# Families that take the 28x28 digits; the others (inceptionv3, densenet121/169/201) stop with one
# line on them (above) and are trained on synthetic images of a size they take.
HEAVY = {"googlenet": 8, "densenet100": 8}  # steps: 1.5 and 0.6 GFLOPs a sample forward; the rest take 8 or 24
# Families that repeat a shallower member of their kind with more of the same blocks, under the same recipe, are
# trained here by one representative each: VGG 11 and 16 (the README's) with and without BatchNorm at 11, ResNet
# 20 and 110 (CIFAR: the shallowest and the deepest, zero-initialized residuals at depth), 18 and 50 (basic and
# bottleneck blocks), DenseNet-121; vit_tiny is vit. tests/test_models.py runs forward and backward of every
# variant.
SAME_AS_ANOTHER = {"vgg13", "vgg19", "vgg13bn", "vgg16bn", "vgg19bn", "resnet32", "resnet44", "resnet56", "resnet34",
                   "resnet101", "resnet152", "densenet169", "densenet201", "vit_tiny"}
DIGIT_FAMILIES = sorted(f for f in FAMILIES if f not in ("inceptionv3", "densenet121", "densenet169", "densenet201")
                        and not FAMILIES[f].get("text") and f not in SAME_AS_ANOTHER)


def _losses(family, shape, train, processes=2, steps=None):
    """Losses of steps of the family's default optimizer (SGD with momentum 0.9, AdamW for ViT) at the command
    line's defaults for this family (learning rate, batch size per process) as `processes` processes take
    them: global batch batch x processes, the rate scaled by `processes`. Families whose recipe has small
    batches take more steps."""
    from pydtnn import optim
    from pydtnn.models.families import DEFAULT_LR, default_optimizer

    backend = CPUBackend(seed=0)
    choice, model = resolve(family, shape, train.num_classes, build=lambda v, s: models.create(
        v, input_shape=s, num_classes=train.num_classes, backend=backend))
    if choice.input_shape != tuple(train.input_shape):
        train = PaddedDataset(train, choice.input_shape)
    name = default_optimizer(choice.name)
    r = recipe(choice.name, name)
    lr = r.get("learning_rate", DEFAULT_LR[name]) * processes
    n = r["batch_size"] * processes
    steps = steps or max(8, 768 // n)  # 768 samples: 8 steps at the default batch, 24 for VGG's small ones
    opt = optim.create(name, model.parameters(), lr=lr, **({"momentum": 0.9} if name == "sgd" else {}))
    loss_fn = SoftmaxCrossEntropy()
    order, out = np.random.default_rng(0).permutation(len(train)), []
    for step in range(steps):
        x, y = train.get_batch(np.sort(order[step * n:(step + 1) * n]), np.float32)
        loss = loss_fn.forward(model.forward(x, training=True), y)
        model.backward(loss_fn.backward())
        opt.step()
        out.append(float(loss))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", DIGIT_FAMILIES)
def test_family_default_learning_rate_trains_on_the_digits(family):
    train, _ = data.load("mnist5k")
    losses = _losses(family, (1, 28, 28), train, steps=HEAVY.get(family))
    assert np.all(np.isfinite(losses)), losses
    k = max(2, len(losses) // 5)
    assert np.mean(losses[-k:]) < np.mean(losses[:k]), losses


@pytest.mark.parametrize("name,shape", [("resnet56_cifar10", (1, 32, 32)), ("resnet50_imagenet", (1, 28, 28))])
def test_deep_resnets_start_as_shallow_networks(name, shape):
    """Each residual block's last BatchNorm weight starts at 0 (zero_init_residual): the first loss is
    about ln(10). With torchvision's default init (all ones) the deep ResNets start far above it and
    diverge at 0.1 (tests above)."""
    from pydtnn.layers import BatchNorm

    train, _ = data.load("mnist5k")
    x, y = PaddedDataset(train, shape).get_batch(np.arange(0, 4000, 40), np.float32) if shape[1] == 32 else \
        train.get_batch(np.arange(0, 4000, 40), np.float32)
    loss = {}
    for zero in (True, False):
        model = models.create(name, input_shape=shape, num_classes=10, backend=CPUBackend(seed=0),
                              zero_init_residual=zero)
        last = [layer for path, layer in model.layers() if isinstance(layer, BatchNorm) and path.startswith("layer")
                and path.rsplit(".", 1)[-1] == ("bn3" if "50" in name else "bn2")]
        assert last and all(np.all(b.params["weight"] == (0.0 if zero else 1.0)) for b in last)
        loss[zero] = float(SoftmaxCrossEntropy().forward(model.forward(x, training=True), y))
    assert abs(loss[True] - np.log(10)) < 0.3 < loss[False] - np.log(10), loss


@pytest.mark.parametrize("family", sorted(f for f in FAMILIES if FAMILIES[f].get("text")))
def test_token_family_default_recipe_trains_on_text(family, tmp_path):
    """A GPT at its family's defaults (AdamW, its batch) on a small English text: the loss falls."""
    from pydtnn.data.text import load_text

    path = tmp_path / "book.txt"
    path.write_text("It was the best of times, it was the worst of times, it was the age of wisdom.\n" * 400)
    train, _ = load_text(str(path), context_length=32)
    losses = _losses(family, train.input_shape, train, steps=6)
    assert np.all(np.isfinite(losses)) and np.mean(losses[-2:]) < np.mean(losses[:2]), losses


# The families that cannot take the 28x28 digits, on synthetic (learnable) images of the smallest
# size they take: 8 steps of the default global batch, as two processes take it.
LARGE_IMAGE_FAMILIES = {"inceptionv3": (3, 75, 75), "densenet121": (3, 64, 64), "densenet169": (3, 64, 64),
                        "densenet201": (3, 64, 64)}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(set(LARGE_IMAGE_FAMILIES) - SAME_AS_ANOTHER))
def test_family_default_learning_rate_trains_on_larger_images(family):
    shape = LARGE_IMAGE_FAMILIES[family]
    train, _ = data.load("synthetic", input_shape=shape, num_classes=10, train_size=1024, test_size=8)
    losses = _losses(family, shape, train, steps=8)
    assert np.all(np.isfinite(losses)), losses
    assert np.mean(losses[-2:]) < np.mean(losses[:2]), losses


def test_vit_families_default_to_adamw_and_others_to_sgd():
    from pydtnn.cli import parse_args
    from pydtnn.models.families import default_optimizer

    assert [default_optimizer(n) for n in ("vit", "vit_small", "vit_tiny_cifar10", "resnet20", None)] == [
        "adamw", "adamw", "adamw", "sgd", "sgd"]
    assert parse_args(["--model", "vit"]).optimizer == "adamw"
    assert parse_args(["--model", "vit", "--optimizer", "sgd"]).optimizer == "sgd"
    assert parse_args(["--model", "resnet20"]).optimizer == "sgd"
    assert recipe("vit_small_cifar10", "adamw") == {"batch_size": 64, "num_epochs": 4, "lr_schedulers": "cosine"}


def test_the_performance_model_takes_the_family_optimizer_where_none_is_given():
    from pydtnn.perfmodel.cli import build_parser, update_class

    parser = build_parser()
    assert update_class(parser.parse_args(["predict", "--model", "vit", "--batch_size", "8"])) == "adam"
    assert update_class(parser.parse_args(["memory", "--model", "resnet20_cifar10", "--batch_size", "8"])) == "sgd_momentum"
    assert update_class(parser.parse_args(["predict", "--model", "vit", "--batch_size", "8", "--optimizer", "sgd"])) == "sgd"
