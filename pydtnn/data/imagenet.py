"""ImageNet (ILSVRC-2012) as a folder tree of JPEG files, or as preprocessed .npy shards.

Folder tree: ROOT/train/<class>/*.JPEG and ROOT/val/<class>/*.JPEG; the class index is the position
of the class folder in sorted order (n01440764 -> 0, ...). Images are decoded with Pillow per batch,
never all held in memory. Evaluation view: shorter side resized to 256, centre 224x224 crop.
Training view (a batch Generator given): a random-resized crop (8-100% of the area, aspect ratio
3/4-4/3) resized to 224x224, mirrored with probability 0.5.

Shards: ROOT/train_images_000.npy (uint8 N x 3 x H x W, or float in [0, 1]) with
ROOT/train_labels_000.npy (integers, N), then _001, ...; the same with val_ (or test_) for the
test split. Memory-mapped with np.load(mmap_mode="r"), never unpickled; float shards are checked
to lie in [0, 1] batch by batch, as they are read.

Both are normalized with the ImageNet mean and std.
"""

import math
import os
import re

import numpy as np

from pydtnn.data.folder import require_folder
from pydtnn.data.streamed import (
    PIXEL_RANGE,
    ShardedArrayDataset,
    StreamedDataset,
    check_dataset_labels,
    check_pixel_dtype,
)
from pydtnn.errors import ConfigError, DataError
from pydtnn.files import open_regular, read_bytes

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
EXTENSIONS = (".jpeg", ".jpg", ".png")
FOLDER_LAYOUT = "ROOT/train/<class>/*.JPEG and ROOT/val/<class>/*.JPEG (class index = sorted folder order)"
SHARD_LAYOUT = ("ROOT/train_images_000.npy (uint8 N x 3 x H x W) + ROOT/train_labels_000.npy (N integers), _001, ...; "
                "val_images_000.npy + val_labels_000.npy likewise")
CLASSES_LIMIT = 4 << 20  # bytes of classes.txt: ImageNet-21k's 21,841 WordNet ids take about 220 KB


class ImageFolder(StreamedDataset):
    """Image files under directory/<class>/, decoded and resized per batch; x (N, 3, size, size).

    classes: class folder names in label order (default: the sorted folders of `directory`; pass the
    training set's for a validation folder). flip: mirror training images with probability 0.5.
    """

    def __init__(self, directory, classes=None, size=224, resize=256, flip=True, name="imagenet"):
        directory = os.fspath(directory)
        found = sorted(e.name for e in _scan(directory, f"image folder {directory}") if e.is_dir())
        classes = found if classes is None else list(classes)
        unknown = sorted(set(found) - set(classes))
        if unknown:
            raise DataError(f"{directory}: class folder {unknown[0]} is not among the {len(classes)} training classes")
        files, labels = [], []
        for label, cls in enumerate(classes):
            sub = os.path.join(directory, cls)
            names = sorted(e.name for e in _scan(sub, f"class folder {sub}")
                           if e.is_file() and e.name.lower().endswith(EXTENSIONS)) if os.path.isdir(sub) else []
            files += [f"{cls}/{n}".encode() for n in names]
            labels += [label] * len(names)
        if not files:
            raise DataError(f"{directory} has 0 samples: no {'/'.join(EXTENSIONS)} images in its class folders; "
                            f"expected {FOLDER_LAYOUT}")
        super().__init__(np.array(labels, np.int64), len(classes), (3, size, size), name,
                         scale=1 / 255, mean=IMAGENET_MEAN, std=IMAGENET_STD)
        self.directory, self.classes = directory, classes
        self.files = np.array(files)  # fixed-width bytes: ~40 B per image, not a Python str each
        self.size, self.resize, self.flip = size, resize, flip

    def _read(self, rows, rng):
        from PIL import Image, UnidentifiedImageError  # Pillow only when images are decoded

        out = np.empty((len(rows), 3, self.size, self.size), np.uint8)
        for i, row in enumerate(rows):
            r = rng.generator(i) if hasattr(rng, "generator") else rng  # the sample's own stream (randomness.py)
            path = os.path.join(self.directory, self.files[row].decode())
            try:
                f = open_regular(path, "image", DataError)  # a FIFO put there since the listing must not hang
            except FileNotFoundError:
                raise DataError(f"cannot read image {path}: no such file (deleted since its folder was listed)") \
                    from None
            try:
                with f, Image.open(f) as img:
                    pixels = self._crop(img, r)
            except (OSError, ValueError, Image.DecompressionBombError) as e:
                reason = "unknown image format" if isinstance(e, UnidentifiedImageError) else " ".join(str(e).split())
                raise DataError(f"{path}: cannot decode image ({reason}); expected a JPEG or PNG file") from None
            if r is not None and self.flip and r.random() < 0.5:
                pixels = pixels[:, ::-1]
            out[i] = pixels.transpose(2, 0, 1)
        return out

    def _crop(self, img, rng):
        """(size, size, 3) uint8 of one opened image: random-resized crop (rng) or resize + centre crop."""
        from PIL import Image

        w, h = img.size
        if rng is None:
            side = min(w, h) * self.size / self.resize  # the centre crop, in original pixels
            box = ((w - side) / 2, (h - side) / 2, (w + side) / 2, (h + side) / 2)
        else:
            box = random_resized_box(w, h, rng)
        # Let the JPEG decoder scale down (1/2, 1/4, 1/8) while the box stays >= size pixels.
        sx, sy = self.size / (box[2] - box[0]), self.size / (box[3] - box[1])
        img.draft("RGB", (math.ceil(w * sx), math.ceil(h * sy)))
        fx, fy = img.size[0] / w, img.size[1] / h
        box = (box[0] * fx, box[1] * fy, box[2] * fx, box[3] * fy)
        rgb = img.convert("RGB") if img.mode != "RGB" else img
        return np.asarray(rgb.resize((self.size, self.size), Image.Resampling.BILINEAR, box=box))


def _scan(directory, what):
    """os.scandir entries of `directory`, listed at once; DataError naming `what` if it cannot be read."""
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except OSError as e:
        raise DataError(f"cannot read {what}: {e.strerror or e}; expected {FOLDER_LAYOUT}") from None


def random_resized_box(w, h, rng, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """(left, top, right, bottom) of a random crop covering `scale` of the area with aspect `ratio`
    (torchvision's RandomResizedCrop: 10 tries, then the centre crop of the clamped aspect)."""
    area = w * h
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        cw, ch = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            top, left = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
            return (left, top, left + cw, top + ch)
    aspect = w / h
    if aspect < ratio[0]:
        cw, ch = w, min(h, round(w / ratio[0]))
    elif aspect > ratio[1]:
        cw, ch = min(w, round(h * ratio[1])), h
    else:
        cw, ch = w, h
    return ((w - cw) // 2, (h - ch) // 2, (w - cw) // 2 + cw, (h - ch) // 2 + ch)


# -- .npy shards ----------------------------------------------------------------------------------
def _load_npy(path, what):
    try:  # np.load opens the file itself (to map it): refuse a FIFO or a device before it does
        open_regular(path, ".npy file", DataError).close()
    except FileNotFoundError:
        raise DataError(f"cannot read .npy file {path}: no such file; expected {what}") from None
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError, OverflowError) as e:
        raise DataError(f"{path}: not a readable .npy array ({' '.join(str(e).split())}); expected {what}") from None


def load_shards(directory, prefix, num_classes, name):
    """ShardedArrayDataset of ROOT/{prefix}_images_NNN.npy + {prefix}_labels_NNN.npy, NNN = 000, 001, ..."""
    pattern = re.compile(rf"{re.escape(prefix)}_images_(\d{{3}})\.npy")
    try:
        names = os.listdir(directory)
    except OSError as e:
        raise DataError(f"cannot read {directory}: {e.strerror}; expected {SHARD_LAYOUT}") from None
    numbers = sorted(m.group(1) for m in map(pattern.fullmatch, names) if m)
    if not numbers:
        raise DataError(f"{directory}: no {prefix}_images_000.npy; expected {SHARD_LAYOUT}")
    if numbers != [f"{i:03d}" for i in range(len(numbers))]:
        raise DataError(f"{directory}: {prefix} shards numbered {', '.join(numbers)}; "
                        f"expected 000 to {len(numbers) - 1:03d} without gaps")
    shards, labels, files = [], [], []
    for n in numbers:
        img_path = os.path.join(directory, f"{prefix}_images_{n}.npy")
        lbl_path = os.path.join(directory, f"{prefix}_labels_{n}.npy")
        images = _load_npy(img_path, "uint8 images N x 3 x H x W")
        if images.ndim != 4 or images.shape[1] != 3:
            raise DataError(f"{img_path}: images of shape {images.shape} and dtype {images.dtype}; "
                            f"expected N x 3 x H x W uint8 (or float in [0, 1])")
        if len(images) == 0:
            raise DataError(f"{img_path} has 0 samples (images of shape {images.shape}); expected at least 1 image")
        if images[0].size == 0:
            raise DataError(f"{img_path}: images of shape {images.shape[1:]}; expected at least 1 pixel")
        check_pixel_dtype(images.dtype, img_path)
        if not os.path.lexists(lbl_path):
            raise DataError(f"{directory}: no {prefix}_labels_{n}.npy for {prefix}_images_{n}.npy; "
                            f"expected {SHARD_LAYOUT}")
        y = np.array(_load_npy(lbl_path, f"{len(images)} integer labels"))
        if y.shape != (len(images),):
            raise DataError(f"{lbl_path}: labels of shape {y.shape}; expected ({len(images)},) to match {img_path}")
        shards.append(images)
        labels.append(check_dataset_labels(y, num_classes, lbl_path))
        files.append(img_path)
    scale = 1 / 255 if shards[0].dtype == np.uint8 else 1.0
    return ShardedArrayDataset(shards, np.concatenate(labels), num_classes, files, name,
                               scale=scale, mean=IMAGENET_MEAN, std=IMAGENET_STD, value_range=PIXEL_RANGE)


def _num_classes(root):
    """Non-blank lines of ROOT/classes.txt when present (a subset of ImageNet), else 1000."""
    path = os.path.join(root, "classes.txt")
    if not os.path.lexists(path):
        return 1000
    try:
        raw = read_bytes(path, "class list", CLASSES_LIMIT, DataError)
    except FileNotFoundError:  # a dangling symlink
        raise DataError(f"cannot read class list {path}: no such file") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}: not UTF-8 text (byte {raw[e.start]:#04x} on line {line}); "
                        f"expected one class name per line") from None
    count = sum(1 for line in text.splitlines() if line.strip())
    if count == 0:
        raise DataError(f"{path} holds no class names; expected one class name per line (or no file: 1000 classes)")
    return count


def load_imagenet(train_path=None, test_path=None, size=224, resize=256):
    """(train, test) of ImageNet from a folder tree or .npy shards under train_path (see module doc).

    test_path: the validation root (holding val/ or val_*.npy) or the validation folder itself.
    """
    if train_path is None:
        raise ConfigError(f"dataset imagenet needs train_path=ROOT holding {FOLDER_LAYOUT}, "
                          f"or {SHARD_LAYOUT} (it cannot be downloaded without an image-net.org account)")
    root = os.fspath(train_path)
    require_folder(root, "dataset folder", f"{FOLDER_LAYOUT}, or {SHARD_LAYOUT}", "train/ or train_images_000.npy")
    if test_path:
        test_path = os.fspath(test_path)
        require_folder(test_path, "dataset test folder", "val/<class>/*.JPEG (or the <class> folders directly), "
                       "or val_images_000.npy + val_labels_000.npy", "val/")
    if os.path.lexists(os.path.join(root, "train_images_000.npy")):
        test_root = test_path or root
        num_classes = _num_classes(root)
        prefix = "val" if os.path.lexists(os.path.join(test_root, "val_images_000.npy")) else "test"
        return (load_shards(root, "train", num_classes, "imagenet/train"),
                load_shards(test_root, prefix, num_classes, f"imagenet/{prefix}"))
    if not os.path.isdir(os.path.join(root, "train")):
        raise DataError(f"{root}: neither train/ nor train_images_000.npy; expected {FOLDER_LAYOUT}, or {SHARD_LAYOUT}")
    train = ImageFolder(os.path.join(root, "train"), size=size, resize=resize, name="imagenet/train")
    val_dir = test_path or os.path.join(root, "val")
    if os.path.isdir(os.path.join(val_dir, "val")):
        val_dir = os.path.join(val_dir, "val")
    if not os.path.isdir(val_dir):
        raise DataError(f"dataset folder {root} has no val/ folder; expected {FOLDER_LAYOUT}")
    return train, ImageFolder(val_dir, classes=train.classes, size=size, resize=resize, name="imagenet/val")
