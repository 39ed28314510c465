"""AlexNet: torchvision's single-tower ImageNet model, and PyDTNN's 32x32 CIFAR-10 adaptation.

Both use torchvision's names: features.<i>, classifier.<i> (the indices count parameter-free
layers too, so ImageNet state dicts load from torchvision unchanged).
"""

from pydtnn.layers import AdaptiveAvgPool2D, Conv2D, Dense, Dropout, Flatten, MaxPool2D, ReLU, Sequential


def _classifier(num_classes, hidden, dropout):
    """torchvision's order: Dropout, Linear, ReLU, Dropout, Linear, ReLU, Linear (indices 1, 4, 6)."""
    return Sequential([
        Dropout(dropout), Dense(hidden), ReLU(),
        Dropout(dropout), Dense(hidden), ReLU(),
        Dense(num_classes, weight_init="glorot_uniform"),
    ])


def alexnet_imagenet(input_shape=(3, 224, 224), num_classes=1000, dropout=0.5):
    """torchvision's alexnet (Krizhevsky 2014, "One weird trick"): 61,100,840 parameters.

    Five convolutions (64, 192, 384, 256, 256), adaptive 6x6 average pooling, and a 4096-4096
    classifier. The adaptive pooling makes any input of at least 63x63 valid.
    """
    features = Sequential([
        Conv2D(64, 11, stride=4, padding=2), ReLU(), MaxPool2D(3, stride=2),
        Conv2D(192, 5, padding=2), ReLU(), MaxPool2D(3, stride=2),
        Conv2D(384, 3, padding=1), ReLU(),
        Conv2D(256, 3, padding=1), ReLU(),
        Conv2D(256, 3, padding=1), ReLU(), MaxPool2D(3, stride=2),
    ])
    return Sequential({
        "features": features, "avgpool": AdaptiveAvgPool2D(6), "flatten": Flatten(),
        "classifier": _classifier(num_classes, 4096, dropout),
    })


def alexnet_cifar10(input_shape=(3, 32, 32), num_classes=10, dropout=0.5):
    """PyDTNN's alexnet_cifar10: 3x3 convolutions, the first with stride 2, and 2x2 pools.

    32x32 -> 16 -> 8 -> 4 -> 2, so the classifier sees 256*2*2 = 1024 features;
    23,272,266 parameters for 10 classes.
    """
    features = Sequential([
        Conv2D(64, 3, stride=2, padding=1), ReLU(), MaxPool2D(2),
        Conv2D(192, 3, padding=1), ReLU(), MaxPool2D(2),
        Conv2D(384, 3, padding=1), ReLU(),
        Conv2D(256, 3, padding=1), ReLU(),
        Conv2D(256, 3, padding=1), ReLU(), MaxPool2D(2),
    ])
    return Sequential({
        "features": features, "flatten": Flatten(), "classifier": _classifier(num_classes, 4096, dropout),
    })
