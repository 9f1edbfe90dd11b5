"""Attention and KV-block kernels behind one small interface (see kernels.backend)."""
import importlib.metadata
import os

from kernels.backend import KernelBackend, get_backend

__all__ = ["KernelBackend", "get_backend"]


def _hub_kernels_version() -> str | None:
    """The version of Hugging Face's `kernels` distribution if one is installed, else None."""
    try:
        return importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return None


def __getattr__(name: str):
    # Hugging Face's `kernels` (a dependency of transformers >= 5.25) has the same import name as
    # this package. Where both are installed and this one comes first on sys.path, transformers
    # imports this package for Hugging Face's and fails on a name it lacks: say why, not just which.
    # A submodule not imported yet is missing too: `from kernels import x` must go on to import it.
    own = any(os.path.exists(os.path.join(d, name + ".py")) or os.path.isdir(os.path.join(d, name))
              for d in __path__)
    hub = None if own else _hub_kernels_version()
    if hub is not None and not name.startswith("__"):
        raise ImportError(
            f"kernels.{name}: `kernels` here is pdserve's kernel package ({__file__}), which shadows "
            f"Hugging Face's `kernels` {hub} (installed with transformers >= 5.25). pdserve supports "
            "transformers < 5.25: pip install 'transformers<5.25' && pip uninstall -y kernels",
            name=__name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
