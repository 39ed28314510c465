"""LeNet-5 (LeCun et al. 1998) for 28x28 MNIST digits."""

from pydtnn.layers import AvgPool2D, Conv2D, Dense, Flatten, Sequential, Tanh


def lenet5(input_shape=(1, 28, 28), num_classes=10):
    """C1 6@5x5 (padded to keep 28x28) - S2 - C3 16@5x5 - S4 - C5 120@5x5 - F6 84 - output.

    Tanh and 2x2 average pooling as in the paper; the paper's trainable subsampling coefficients,
    partial C3 connectivity and RBF output are replaced by plain pooling, full C3 and a Dense
    classifier. 61,706 parameters for 10 classes. C5 is a 5x5 convolution on the 5x5 map of a
    28x28 input; larger inputs leave it a spatial map, which Flatten hands to F6.
    """
    return Sequential({
        "conv1": Conv2D(6, 5, padding=2, weight_init="glorot_uniform"), "tanh1": Tanh(), "pool1": AvgPool2D(2),
        "conv2": Conv2D(16, 5, weight_init="glorot_uniform"), "tanh2": Tanh(), "pool2": AvgPool2D(2),
        "conv3": Conv2D(120, 5, weight_init="glorot_uniform"), "tanh3": Tanh(),
        "flatten": Flatten(),
        "fc1": Dense(84, weight_init="glorot_uniform"), "tanh4": Tanh(),
        "fc2": Dense(num_classes, weight_init="glorot_uniform"),
    })
