"""lrmoe: Mixture-of-Experts training with memory-aware replication, backward load
recalibration and physical compaction (LRMoE), beside static EP and SYMI baselines."""

from lrmoe.errors import LrmoeError

__version__ = "0.1.0"

# Imported on first use, so that ``import lrmoe.cli`` (the ``lrmoe`` command) does not
# import torch before it can handle Ctrl-C.
_LAZY = {"ModelConfig": "lrmoe.config", "MoEForCausalLM": "lrmoe.model",
         "get_preset": "lrmoe.presets", "load_hf": "lrmoe.hf_load", "save_hf": "lrmoe.hf"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lrmoe' has no attribute {name!r}")


__all__ = ["LrmoeError", "MoEForCausalLM", "ModelConfig", "get_preset", "load_hf", "save_hf"]
