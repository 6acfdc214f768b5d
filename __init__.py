"""deepinfer: an ahead-of-time, compile-first inference engine for DeepSeek-V3-architecture MoE LLMs."""

__version__ = "0.1.0"
