"""Load torchvision weights: a torchvision state dict, minus what these models do not keep.

    from safetensors.numpy import load_file
    model = pydtnn.models.create("resnet50_imagenet")
    model.load_state_dict(torchvision_state_dict(load_file("resnet50.safetensors")))

The ImageNet models of the zoo use torchvision's names and layouts, so the only differences are
BatchNorm's `num_batches_tracked` counters (pydtnn's BatchNorm has a fixed momentum and keeps no
counter) and the auxiliary classifiers of GoogLeNet (aux1, aux2) and Inception v3 (AuxLogits),
which the zoo does not build.
"""

import numpy as np

DROPPED_PREFIXES = ("aux1.", "aux2.", "AuxLogits.")


def torchvision_state_dict(state):
    """{name: NumPy array} without num_batches_tracked and auxiliary-classifier entries.

    `state`: a dict of NumPy arrays or torch tensors (e.g. torchvision's model.state_dict(), or a
    safetensors file loaded with safetensors.numpy.load_file).
    """
    out = {}
    for name, value in state.items():
        if name.endswith("num_batches_tracked") or name.startswith(DROPPED_PREFIXES):
            continue
        if hasattr(value, "detach"):  # a torch tensor; torch itself is not imported here
            value = value.detach().cpu().numpy()
        out[name] = np.asarray(value)
    return out
