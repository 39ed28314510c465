"""VGG (Simonyan and Zisserman 2015), with and without batch normalization, as torchvision builds it.

One builder, `vgg(config, batch_norm, ...)`; the named variants below only pick the configuration
and the head. State-dict names are torchvision's: features.<i>.weight (i counts the ReLU, BatchNorm
and MaxPool layers too), classifier.0/3/6.weight.
"""

from pydtnn.layers import AdaptiveAvgPool2D, BatchNorm, Conv2D, Dense, Dropout, Flatten, MaxPool2D, ReLU, Sequential

# Output channels of each 3x3 convolution; "M" is a 2x2 max pool (torchvision's cfgs A, B, D, E).
CONFIGS = {
    11: [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    13: [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    16: [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    19: [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"],
}


def vgg(depth, batch_norm, num_classes, pool_size=7, hidden=4096, dropout=0.5):
    """features (3x3 convolutions [+ BatchNorm] + ReLU, max pools), avgpool, classifier.

    pool_size: side of the adaptive average pooling before the classifier (torchvision: 7, so the
    first Dense sees 512*7*7 = 25,088 features); None leaves it out and flattens the features.
    """
    features = []
    for v in CONFIGS[depth]:
        if v == "M":
            features.append(MaxPool2D(2))
        else:
            features += [Conv2D(v, 3, padding=1)] + ([BatchNorm()] if batch_norm else []) + [ReLU()]
    head = {"avgpool": AdaptiveAvgPool2D(pool_size)} if pool_size else {}
    classifier = Sequential([
        Dense(hidden), ReLU(), Dropout(dropout),
        Dense(hidden), ReLU(), Dropout(dropout),
        Dense(num_classes, weight_init="glorot_uniform"),
    ])
    return Sequential({"features": Sequential(features), **head, "flatten": Flatten(), "classifier": classifier})


def vgg_imagenet(depth, batch_norm, num_classes, dropout=0.5):
    """torchvision's vgg<depth>[_bn]: adaptive 7x7 pooling and a 4096-4096 classifier."""
    return vgg(depth, batch_norm, num_classes, pool_size=7, dropout=dropout)


def vgg_cifar10(depth, batch_norm, num_classes, dropout=0.5):
    """PyDTNN's vgg<depth>_cifar10: the same features on 32x32 (ending at 512x1x1) and a
    512-4096-4096 classifier without the adaptive pooling."""
    return vgg(depth, batch_norm, num_classes, pool_size=None, dropout=dropout)


def vgg11_imagenet(input_shape=(3, 224, 224), num_classes=1000, **options):
    return vgg_imagenet(11, False, num_classes, **options)


def vgg13_imagenet(input_shape=(3, 224, 224), num_classes=1000, **options):
    return vgg_imagenet(13, False, num_classes, **options)


def vgg16_imagenet(input_shape=(3, 224, 224), num_classes=1000, **options):
    return vgg_imagenet(16, False, num_classes, **options)


def vgg19_imagenet(input_shape=(3, 224, 224), num_classes=1000, **options):
    return vgg_imagenet(19, False, num_classes, **options)


def vgg11bn_imagenet(input_shape=(3, 224, 224), num_classes=1000, **options):
    return vgg_imagenet(11, True, num_classes, **options)


def vgg13bn_imagenet(input_shape=(3, 224, 224), num_classes=1000, **options):
    return vgg_imagenet(13, True, num_classes, **options)


def vgg16bn_imagenet(input_shape=(3, 224, 224), num_classes=1000, **options):
    return vgg_imagenet(16, True, num_classes, **options)


def vgg19bn_imagenet(input_shape=(3, 224, 224), num_classes=1000, **options):
    return vgg_imagenet(19, True, num_classes, **options)


def vgg11_cifar10(input_shape=(3, 32, 32), num_classes=10, **options):
    return vgg_cifar10(11, False, num_classes, **options)


def vgg13_cifar10(input_shape=(3, 32, 32), num_classes=10, **options):
    return vgg_cifar10(13, False, num_classes, **options)


def vgg16_cifar10(input_shape=(3, 32, 32), num_classes=10, **options):
    return vgg_cifar10(16, False, num_classes, **options)


def vgg19_cifar10(input_shape=(3, 32, 32), num_classes=10, **options):
    return vgg_cifar10(19, False, num_classes, **options)


def vgg11bn_cifar10(input_shape=(3, 32, 32), num_classes=10, **options):
    return vgg_cifar10(11, True, num_classes, **options)


def vgg13bn_cifar10(input_shape=(3, 32, 32), num_classes=10, **options):
    return vgg_cifar10(13, True, num_classes, **options)


def vgg16bn_cifar10(input_shape=(3, 32, 32), num_classes=10, **options):
    return vgg_cifar10(16, True, num_classes, **options)


def vgg19bn_cifar10(input_shape=(3, 32, 32), num_classes=10, **options):
    return vgg_cifar10(19, True, num_classes, **options)
