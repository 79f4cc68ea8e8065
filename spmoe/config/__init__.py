from spmoe.config.model import ModelConfig
from spmoe.config.parallel import ParallelConfig

__all__ = ["ModelConfig", "ParallelConfig"]
