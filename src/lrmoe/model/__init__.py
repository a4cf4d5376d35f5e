from lrmoe.model.moe import MoELayer, MoERuntime
from lrmoe.model.transformer import MoEForCausalLM

__all__ = ["MoEForCausalLM", "MoELayer", "MoERuntime"]
