"""What torch's DataLoader, Lightning and torchdata's StatefulDataLoader expect of a dataset, without importing torch.

:class:`LoaderProtocols`, the base of :class:`gdsload.GDSDataset` and :class:`gdsload.Mixture`, is registered as
a virtual subclass of ``torch.utils.data.IterableDataset`` as soon as that class exists: at ``import gdsload``
when torch came first, else by :class:`RegisterOnImport`, a ``sys.meta_path`` finder that answers only for
``torch.utils.data.dataset`` and leaves once it has registered. A batching DataLoader is refused when it starts
iterating (:func:`refuse_collation`), as are worker processes (:func:`refuse_worker`) and pickling. Why, and
what each loader does with a dataset: docs/design.md, "Fork safety".
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

from .errors import GDSLoadError

#: The module that defines ``torch.utils.data.IterableDataset``.
TORCH_DATASET_MODULE = "torch.utils.data.dataset"

#: Why a dataset is not read in DataLoader worker processes, and what to do instead.
NO_WORKERS = ("a GDSDataset is read in the process that opened it, by its own reader threads (and, on a GPU, "
              "that process's CUDA context), so DataLoader worker processes (num_workers > 0) add nothing but "
              "copies; use DataLoader(ds, batch_size=None) with num_workers=0 (the default), or iterate the "
              "dataset itself")


class EpochSetter:
    """What Lightning takes for a sampler: ``set_epoch(n)`` is the dataset's ``set_epoch(n)``."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)


class LoaderProtocols:
    """The base of gdsload's datasets: a ``torch.utils.data.IterableDataset`` once torch is imported (module
    docstring), with what Lightning needs beyond ``state_dict`` / ``load_state_dict`` and a refusal to be
    pickled. Subclasses define ``set_epoch``, ``state_dict``, ``load_state_dict``, ``__iter__``, ``__len__``."""

    @property
    def sampler(self) -> EpochSetter:
        """For Lightning, which calls ``loader.sampler.set_epoch(epoch)`` at the start of each epoch of a fit:
        an object whose ``set_epoch`` is this dataset's (a new one each time: nothing refers back to it)."""
        return EpochSetter(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(f"{type(self).__name__} cannot be pickled or copied: it holds open files, reader threads "
                        f"and buffers of this process; {NO_WORKERS}; in another process, open a new "
                        f"{type(self).__name__} there")


def refuse_worker(dataset: Any) -> None:
    """Raise GDSLoadError when called in a torch DataLoader worker process (never imports torch)."""
    data = sys.modules.get("torch.utils.data")
    info = getattr(data, "get_worker_info", None)
    if info is not None and info() is not None:
        where = dataset.meta.path if hasattr(dataset, "meta") else repr(dataset)
        raise GDSLoadError(f"{where}: iterated in DataLoader worker process {info().id} "
                           f"(num_workers > 0): {NO_WORKERS}")


#: The module and class of the fetcher a torch DataLoader iterates an IterableDataset with.
FETCH_MODULE, FETCHER = "torch.utils.data._utils.fetch", "_IterableDatasetFetcher"

#: Why a dataset is not given to a DataLoader that batches, and what to do instead.
NO_COLLATION = ("it yields whole batches already, so a DataLoader that batches (batch_size not None; its default "
                "is 1) would collate several of them into one, or fail in torch's collate at a batch of another "
                "size; use DataLoader(ds, batch_size=None) and set the batch size on the dataset")


def refuse_collation(dataset: Any) -> None:
    """Raise ValueError when ``dataset`` is being iterated for a torch DataLoader that batches. Called from
    ``__iter__``: such a loader's fetcher (:data:`FETCHER` in :data:`FETCH_MODULE`, also what torchdata's
    StatefulDataLoader uses) calls ``iter(dataset)`` from its constructor, holding the dataset and
    ``auto_collation`` (True where the loader has a batch size), so a frame just above running that
    constructor tells. Only that frame's locals are read: reading another's would keep its variables alive
    (a user's ``del ds`` would free nothing). Never imports torch; without its fetch module loaded there is no
    DataLoader, and nothing is looked at."""
    fetcher = getattr(sys.modules.get(FETCH_MODULE), FETCHER, None)
    code = getattr(getattr(fetcher, "__init__", None), "__code__", None)
    if code is None:
        return
    frame = sys._getframe(2)  # 0: here, 1: the dataset's __iter__, 2: who called iter()
    for _ in range(3):
        if frame is None:
            return
        if frame.f_code is code:
            owner = frame.f_locals.get("self")
            if getattr(owner, "dataset", None) is dataset and getattr(owner, "auto_collation", False) is True:
                where = dataset.meta.path if hasattr(dataset, "meta") else repr(dataset)
                raise ValueError(f"{where}: iterated by a torch DataLoader that batches: {NO_COLLATION}")
            return
        frame = frame.f_back


def register(iterable_dataset: type) -> None:
    """Make :class:`LoaderProtocols` (so every gdsload dataset) a virtual subclass of ``iterable_dataset``."""
    iterable_dataset.register(LoaderProtocols)  # type: ignore[attr-defined]


class RegisterOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for :data:`TORCH_DATASET_MODULE` it asks the finders after it for the module's
    spec and wraps that spec's loader so the module, once executed, registers :class:`LoaderProtocols`."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != TORCH_DATASET_MODULE:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        run = getattr(loader, "exec_module", None)
        if run is None:
            return spec

        def exec_module(module: Any) -> None:
            try:
                run(module)
            finally:
                vars(loader).pop("exec_module", None)
            register(module.IterableDataset)
            if self in sys.meta_path:
                sys.meta_path.remove(self)

        try:
            loader.exec_module = exec_module  # this module's loader only: every module has a loader of its own
        except AttributeError:  # a loader that takes no attributes: left as it is
            pass
        return spec


def install() -> None:
    """Register now if torch's IterableDataset exists, else when it is imported (module docstring)."""
    loaded = sys.modules.get(TORCH_DATASET_MODULE)
    if loaded is not None and hasattr(loaded, "IterableDataset"):
        register(loaded.IterableDataset)
    elif not any(isinstance(f, RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, RegisterOnImport())


install()
