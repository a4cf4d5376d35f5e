"""lrmoe: Mixture-of-Experts training with memory-aware replication, backward load
recalibration and physical compaction (LRMoE), beside static EP and SYMI baselines."""

from lrmoe.errors import LrmoeError

__version__ = "0.1.0"

# Imported on first use, so that ``import lrmoe.cli`` (the ``lrmoe`` command) does not
# import torch before it can handle Ctrl-C.
_LAZY = {"ModelConfig": "lrmoe.config", "MoEForCausalLM": "lrmoe.model",
         "get_preset": "lrmoe.presets"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lrmoe' has no attribute {name!r}")


def load_hf(path, **kw):
    """Load a HF-format directory (config.json + *.safetensors) into an MoEForCausalLM."""
    from lrmoe.hf_load import load_hf as _load
    return _load(path, **kw)


def save_hf(model, path, **kw):
    """Save ``model`` as HF ``config.json`` + safetensors in ``path`` (atomically)."""
    from lrmoe.hf import save_hf as _save
    return _save(model, path, **kw)


__all__ = ["LrmoeError", "MoEForCausalLM", "ModelConfig", "get_preset", "load_hf", "save_hf"]
