"""Your own images: a folder with one subfolder of images per class (``clipless train --data DIR``).

``DIR/<class>/<image>`` as torchvision's ``ImageFolder`` reads it: the subfolders' names are the
classes (sorted, or the ``classes`` given, in that order), every file whose extension is one of
:data:`EXTENSIONS` is one record, hidden files are skipped. Every image goes through a fixed,
public transform only: converted to 8-bit grayscale when every image of the folder is grayscale,
else to RGB, and its pixels divided by 255 (values in ``[0, 1]``), so ``sqrt(C H W)``
(:func:`folder_max_norm`) bounds every record's norm. Nothing is fitted on the images (no mean,
no scale), and the images must share one size: resize them beforehand (a size chosen from the
data would be a function of it).

The test set is ``test_path`` (the same layout and classes) or, without it, the public split of
:func:`clipless.data.table.public_split`, as for a table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from clipless.data.registry import DatasetInfo
from clipless.data.table import public_split

__all__ = ["EXTENSIONS", "folder_max_norm", "is_image_folder", "load_image_folder"]

EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")
_GRAY = ("1", "L", "LA", "I", "I;16", "F")


def is_image_folder(path: str | Path) -> bool:
    """Whether ``--data`` names a directory (an image folder) rather than a table file."""
    return Path(path).is_dir()


def folder_max_norm(input_shape: Sequence[int]) -> float:
    """``sqrt(C H W)``: every pixel is in ``[0, 1]``.

    Args:
        input_shape: one image's ``(channels, height, width)``.
    """
    return math.sqrt(math.prod(int(d) for d in input_shape))


def _class_files(root: Path, classes: tuple[str, ...] | None) -> dict[str, list[Path]]:
    """Each class's image files (sorted), the classes in their order; refused when the folder,
    a class's subfolder or a class's images are missing."""
    if not root.is_dir():
        raise ValueError(f"{root} is not a directory")
    found = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    names = classes if classes is not None else tuple(found)
    if len(names) < 2:
        raise ValueError(f"{root} needs one subfolder per class, at least two; found {found}")
    missing = [c for c in names if c not in found]
    if missing:
        raise ValueError(f"{root} has no subfolder for class(es) {', '.join(missing)}")
    out: dict[str, list[Path]] = {}
    for name in names:
        out[name] = sorted(
            p
            for p in (root / name).iterdir()
            if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in EXTENSIONS
        )
        if not out[name]:
            raise ValueError(f"{root / name} holds no image (extensions {', '.join(EXTENSIONS)})")
    return out


def _read(root: Path, classes: tuple[str, ...] | None) -> tuple[TensorDataset, tuple[str, ...]]:
    """The images of ``root`` as a ``[n, C, H, W]`` float tensor in ``[0, 1]`` and their labels."""
    from PIL import Image, UnidentifiedImageError

    files = _class_files(root, classes)
    images: list[Image.Image] = []
    labels: list[int] = []
    for label, paths in enumerate(files.values()):
        for path in paths:
            try:
                with Image.open(path) as image:
                    images.append(image.copy())
            except (OSError, UnidentifiedImageError) as exc:
                raise ValueError(f"{path} is not a readable image ({exc})") from None
            labels.append(label)
    sizes = sorted({image.size for image in images})
    if len(sizes) > 1:
        shown = ", ".join(f"{w}x{h}" for w, h in sizes[:3])
        raise ValueError(
            f"the images of {root} have {len(sizes)} sizes ({shown}, ...): resize them to one "
            "size first"
        )
    mode = "L" if all(image.mode in _GRAY for image in images) else "RGB"
    width, height = sizes[0]
    channels = 1 if mode == "L" else 3
    raw = b"".join(image.convert(mode).tobytes() for image in images)
    x = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    x = x.reshape(len(images), height, width, channels).permute(0, 3, 1, 2)
    y = torch.tensor(labels, dtype=torch.long)
    return TensorDataset(x.float().div_(255.0).contiguous(), y), tuple(files)


def load_image_folder(
    path: str | Path,
    classes: tuple[str, ...] | None = None,
    test_path: str | Path | None = None,
) -> tuple[TensorDataset, TensorDataset, DatasetInfo]:
    """``(train, test, info)`` of an image folder (module docstring).

    Args:
        path: the folder, one subfolder of images per class.
        classes: the subfolders to use, in class order (``None``: all, sorted by name).
        test_path: a second folder of the same classes for the test set (``None``: a public
            split of ``path``).

    Raises:
        ValueError: a folder without usable images or classes, or test images of another shape.
    """
    data, names = _read(Path(path), classes)
    if test_path is not None:
        train = data
        test, _ = _read(Path(test_path), names)
        if test.tensors[0].shape[1:] != train.tensors[0].shape[1:]:
            raise ValueError(
                f"the test images of {test_path} have shape {tuple(test.tensors[0].shape[1:])}, "
                f"the training images {tuple(train.tensors[0].shape[1:])}"
            )
    else:
        train, test = public_split(data, f"{path} has {len(data)} image(s)")
    shape = tuple(int(d) for d in train.tensors[0].shape[1:])
    info = DatasetInfo(
        name=f"images:{Path(path).name}",
        input_shape=shape,
        num_classes=len(names),
        class_names=names,
        num_train=len(train),
        num_test=len(test),
        preprocessing="public: 8-bit grayscale or RGB, pixels / 255 (no data-dependent step)",
        source=str(path),
        license="the user's own data",
    )
    return train, test, info
