"""lrmoe: Mixture-of-Experts training with memory-aware replication, backward load
recalibration and physical compaction (LRMoE), beside static EP and SYMI baselines."""

from lrmoe.config import ModelConfig
from lrmoe.errors import LrmoeError
from lrmoe.model import MoEForCausalLM
from lrmoe.presets import get_preset

__version__ = "0.1.0"


def load_hf(path, **kw):
    """Load a HF-format directory (config.json + *.safetensors) into an MoEForCausalLM."""
    from lrmoe.hf import load_hf as _load
    return _load(path, **kw)


def save_hf(model, path, **kw):
    """Save ``model`` as HF ``config.json`` + safetensors in ``path`` (atomically)."""
    from lrmoe.hf import save_hf as _save
    return _save(model, path, **kw)


__all__ = ["LrmoeError", "MoEForCausalLM", "ModelConfig", "get_preset", "load_hf", "save_hf"]
