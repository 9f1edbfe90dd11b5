"""pdserve's `kernels` package and Hugging Face's `kernels` share an import name (transformers >= 5.25
requires the latter). A clash must fail with the reason, and must not break attribute probes."""
import importlib.metadata

import pytest

import kernels


def test_a_missing_name_is_an_attribute_error_without_hub_kernels(monkeypatch):
    real = importlib.metadata.version

    def version(dist):
        if dist == "kernels":
            raise importlib.metadata.PackageNotFoundError(dist)
        return real(dist)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert not hasattr(kernels, "CUDAProperties")
    assert kernels.get_backend is not None


def test_transformers_reaching_for_hub_kernels_is_told_why(monkeypatch):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda dist: "0.19.1" if dist == "kernels" else real(dist))
    # What transformers' hub_kernels integration does when it believes Hugging Face's is installed.
    with pytest.raises(ImportError, match=r"shadows Hugging Face's `kernels` 0\.19\.1.*transformers<5\.25"):
        from kernels import CUDAProperties  # noqa: F401
    # Dunder probes (copy, pickle, inspect) still get AttributeError.
    assert not hasattr(kernels, "__wrapped__")
    # Its own submodules, imported or not, stay importable: the import system sees AttributeError
    # for one not imported yet and goes on to load it.
    with pytest.raises(AttributeError):
        kernels.__getattr__("triton_cache")
    from kernels import reference
    assert reference.paged_decode_attention is not None


def test_the_installed_transformers_does_not_pull_hub_kernels():
    # The pin in pyproject.toml: with it, the tree's `kernels` is the only one importable.
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("kernels")
    import transformers
    assert transformers.LlamaConfig is not None
