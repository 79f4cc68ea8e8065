from spmoe.config.parallel import ParallelConfig

__all__ = ["ParallelConfig"]
