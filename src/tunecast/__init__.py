"""tunecast: plan, price and run LLM fine-tuning on rented or owned GPUs."""

from tunecast.version import SCHEMA_VERSION, __version__

__all__ = ["SCHEMA_VERSION", "__version__"]
