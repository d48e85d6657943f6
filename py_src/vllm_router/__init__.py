"""gRPC front end for a vLLM engine: token ids in, token ids + text deltas + load out."""

__version__ = "0.1.0"
