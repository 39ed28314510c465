"""The zoo's families (vgg16, resnet50, ...) and their registered variants: which variant images of a shape take.

A leaf of the zoo: models/__init__.py resolves a family name through it when it builds, and families.py
adds how a model adapts to the data (channels, classes, padding) and each family's training recipe.
"""

SMALL_SIDE = 64


def _variants(stem, cifar=True, imagenet=True):
    return {"cifar10": f"{stem}_cifar10" if cifar else None, "imagenet": f"{stem}_imagenet" if imagenet else None}


# family name -> {"cifar10": variant or None, "imagenet": variant or None}
FAMILIES = {
    **{f"vgg{d}{bn}": _variants(f"vgg{d}{bn}") for d in (11, 13, 16, 19) for bn in ("", "bn")},
    **{f"resnet{d}": _variants(f"resnet{d}", imagenet=False) for d in (20, 32, 44, 56, 110)},
    **{f"resnet{d}": _variants(f"resnet{d}", cifar=False) for d in (18, 34, 50, 101, 152)},
    **{f"densenet{d}": _variants(f"densenet{d}", cifar=False) for d in (121, 169, 201)},
    "densenet100": {"cifar10": "densenet_cifar10", "imagenet": None},
    "alexnet": _variants("alexnet"),
    "googlenet": _variants("googlenet"),
    "inceptionv3": _variants("inceptionv3", cifar=False),
    "mobilenetv1": _variants("mobilenetv1"),
    "vit_tiny": _variants("vit_tiny", imagenet=False),
    "vit": _variants("vit_tiny", imagenet=False),  # the tiny one
    "vit_small": _variants("vit_small", imagenet=False),
    # token models: "text" is the variant for (T,) token windows (a text dataset); they take no images
    "gpt": {"cifar10": None, "imagenet": None, "text": "gpt_nano"},
}


def family_of(name):
    """The family a registered variant belongs to (vgg16_cifar10 -> vgg16), or None."""
    for family, variants in FAMILIES.items():
        if name in variants.values():
            return family
    return None


def pick(family, input_shape):
    """The variant of `family` (a key of FAMILIES) for samples of input_shape (C, H, W): the CIFAR-10 one for
    images of at most SMALL_SIDE pixels a side, else the ImageNet one; a family with one variant takes it. A token
    family's variant is its "text" one, whatever the shape (building it for images then says what it takes)."""
    variants = FAMILIES[family]
    if variants.get("text"):
        return variants["text"]
    small = len(input_shape) == 3 and max(input_shape[1:]) <= SMALL_SIDE
    return variants["cifar10" if small else "imagenet"] or variants["imagenet"] or variants["cifar10"]
