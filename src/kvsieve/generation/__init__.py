"""Generation on a compressed context: compress once, ask many (:mod:`kvsieve.generation.context`)."""

from kvsieve.generation.context import Answer, CompressedContext, ContextStats, compress_context

__all__ = ["Answer", "CompressedContext", "ContextStats", "compress_context"]
