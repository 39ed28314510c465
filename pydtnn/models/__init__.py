"""The model zoo: one builder function per architecture, registered by name below.

    pydtnn.models.names()                                 # ['alexnet_cifar10', ..., 'vgg19bn_imagenet']
    model = pydtnn.models.create("resnet50_imagenet", backend=CPUBackend(seed=1))

A builder takes (input_shape, num_classes, **options) and returns its layers (a list, a dict or a
Sequential); `create` builds them into a Model, and `layers` returns them unbuilt, as a Sequential
whose layers can be replaced or inserted by path before a Model builds it (docs/layers.md):

    tree = pydtnn.models.layers("resnet20_cifar10")     # what create builds, unbuilt
    tree.replace("relu", PReLU())                       # the stem's ReLU
    model = Model(tree, (3, 32, 32), backend, name="resnet20_prelu")

A model of the user's own, from a Python file, is built the same way by models/model_file.py.
Defaults come from the dataset the architecture was designed for: *_imagenet models take 3x224x224 (Inception v3: 3x299x299) and 1000 classes,
*_cifar10 models 3x32x32 and 10 classes. The ImageNet models reproduce torchvision's architectures
and state-dict names, so torchvision weights load (see models/convert.py). docs/models.md lists
every model with its parameters and FLOPs.
"""

from pydtnn.backends import CPUBackend
from pydtnn.errors import ConfigError
from pydtnn.layers import Sequential
from pydtnn.model import Model
from pydtnn.models import alexnet, densenet, inception, lenet, mobilenet, resnet, simple, transformer, vgg
from pydtnn.models.family_table import FAMILIES, family_of, pick

# (default input shape, default number of classes) of each dataset
IMAGENET, IMAGENET_299 = ((3, 224, 224), 1000), ((3, 299, 299), 1000)
CIFAR10, MNIST = ((3, 32, 32), 10), ((1, 28, 28), 10)
BYTES_128, BYTES_256 = ((128,), 256), ((256,), 256)  # windows of byte tokens (a text dataset's, any vocabulary)

# name -> (builder, default input shape, default number of classes)
_REGISTRY = {
    name: (builder, *defaults)
    for name, builder, defaults in [
        ("simplecnn", simple.simplecnn, MNIST),
        ("simplemlp", simple.simplemlp, MNIST),
        ("lenet5", lenet.lenet5, MNIST),
        ("alexnet_cifar10", alexnet.alexnet_cifar10, CIFAR10),
        ("alexnet_imagenet", alexnet.alexnet_imagenet, IMAGENET),
        ("vgg11_cifar10", vgg.vgg11_cifar10, CIFAR10),
        ("vgg13_cifar10", vgg.vgg13_cifar10, CIFAR10),
        ("vgg16_cifar10", vgg.vgg16_cifar10, CIFAR10),
        ("vgg19_cifar10", vgg.vgg19_cifar10, CIFAR10),
        ("vgg11bn_cifar10", vgg.vgg11bn_cifar10, CIFAR10),
        ("vgg13bn_cifar10", vgg.vgg13bn_cifar10, CIFAR10),
        ("vgg16bn_cifar10", vgg.vgg16bn_cifar10, CIFAR10),
        ("vgg19bn_cifar10", vgg.vgg19bn_cifar10, CIFAR10),
        ("vgg11_imagenet", vgg.vgg11_imagenet, IMAGENET),
        ("vgg13_imagenet", vgg.vgg13_imagenet, IMAGENET),
        ("vgg16_imagenet", vgg.vgg16_imagenet, IMAGENET),
        ("vgg19_imagenet", vgg.vgg19_imagenet, IMAGENET),
        ("vgg11bn_imagenet", vgg.vgg11bn_imagenet, IMAGENET),
        ("vgg13bn_imagenet", vgg.vgg13bn_imagenet, IMAGENET),
        ("vgg16bn_imagenet", vgg.vgg16bn_imagenet, IMAGENET),
        ("vgg19bn_imagenet", vgg.vgg19bn_imagenet, IMAGENET),
        ("resnet20_cifar10", resnet.resnet20_cifar10, CIFAR10),
        ("resnet32_cifar10", resnet.resnet32_cifar10, CIFAR10),
        ("resnet44_cifar10", resnet.resnet44_cifar10, CIFAR10),
        ("resnet56_cifar10", resnet.resnet56_cifar10, CIFAR10),
        ("resnet110_cifar10", resnet.resnet110_cifar10, CIFAR10),
        ("resnet18_imagenet", resnet.resnet18_imagenet, IMAGENET),
        ("resnet34_imagenet", resnet.resnet34_imagenet, IMAGENET),
        ("resnet50_imagenet", resnet.resnet50_imagenet, IMAGENET),
        ("resnet101_imagenet", resnet.resnet101_imagenet, IMAGENET),
        ("resnet152_imagenet", resnet.resnet152_imagenet, IMAGENET),
        ("densenet_cifar10", densenet.densenet_cifar10, CIFAR10),
        ("densenet121_imagenet", densenet.densenet121_imagenet, IMAGENET),
        ("densenet169_imagenet", densenet.densenet169_imagenet, IMAGENET),
        ("densenet201_imagenet", densenet.densenet201_imagenet, IMAGENET),
        ("googlenet_cifar10", inception.googlenet_cifar10, CIFAR10),
        ("googlenet_imagenet", inception.googlenet_imagenet, IMAGENET),
        ("inceptionv3_imagenet", inception.inceptionv3_imagenet, IMAGENET_299),
        ("mobilenetv1_cifar10", mobilenet.mobilenetv1_cifar10, CIFAR10),
        ("mobilenetv1_imagenet", mobilenet.mobilenetv1_imagenet, IMAGENET),
        ("vit_tiny_cifar10", transformer.vit_tiny_cifar10, CIFAR10),
        ("vit_small_cifar10", transformer.vit_small_cifar10, CIFAR10),
        ("gpt_nano", transformer.gpt_nano, BYTES_128),
        ("gpt_mini", transformer.gpt_mini, BYTES_256),
    ]
}


def names():
    """Registered architecture names, sorted."""
    return sorted(_REGISTRY)


def family_names():
    """Family names (vgg16, resnet50, ...) that resolve to a registered variant (models/families.py)."""
    return sorted(FAMILIES)


def defaults(name):
    """(input_shape, num_classes) that `create(name)` uses when none are given."""
    _, shape, classes = _entry(name)
    return shape, classes


def create(name, input_shape=None, num_classes=None, backend=None, **options):
    """Built Model of architecture `name` on `backend` (CPU float32 seed 0 by default).

    options go to the builder (e.g. dropout=0.3, or alpha=0.5 for MobileNet); an option the
    builder does not take is a ConfigError.
    """
    name, shape, tree = _unbuilt(name, input_shape, num_classes, options)
    return Model(tree, shape, backend if backend is not None else CPUBackend(), name=name)


def layers(name, input_shape=None, num_classes=None, **options):
    """The layers of architecture `name` as `create` would build them, unbuilt: a Sequential to change
    (Sequential.replace, .insert) and build with Model(tree, input_shape, backend, name=...).
    Arguments as create's; input_shape must then be the one the Model is built for."""
    return _unbuilt(name, input_shape, num_classes, options)[2]


def _unbuilt(name, input_shape, num_classes, options):
    """(registered name, input shape, Sequential of unbuilt layers) of architecture or family `name`."""
    if name not in _REGISTRY:  # a family name: the variant for this input shape
        if name not in FAMILIES:
            raise unknown_model(name)
        name = pick(name, tuple(input_shape or (3, 224, 224)))
    builder, default_shape, default_classes = _entry(name)
    shape = tuple(input_shape or default_shape)
    try:
        tree = builder(shape, num_classes or default_classes, **options)
    except TypeError as e:
        if "unexpected keyword argument" not in str(e):
            raise
        raise ConfigError(f"model {name!r} does not take option(s) {sorted(options)}: {e}") from None
    return name, shape, tree if isinstance(tree, Sequential) else Sequential(tree)


def _entry(name):
    if name not in _REGISTRY:
        raise unknown_model(name)
    return _REGISTRY[name]


def unknown_model(name):
    """ConfigError for a name that is neither registered nor a family, with the closest one."""
    from pydtnn.suggest import did_you_mean

    known = names() + family_names()
    plain = [n for n in names() if family_of(n) is None]  # simplecnn, lenet5, ...: neither family nor variant
    return ConfigError(f"unknown model {name!r}{did_you_mean(name, known) or ';'} expected a family name "
                       f"({', '.join(family_names())}), {', '.join(plain)}, or a registered variant (pydtnn.models.names())")
