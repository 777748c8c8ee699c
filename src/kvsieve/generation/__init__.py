"""Generation on a compressed context: compress once, ask many (:mod:`kvsieve.generation.context`), and keep
it for later (:mod:`kvsieve.generation.saved_context`)."""

from kvsieve.generation.context import Answer, CompressedContext, ContextStats, compress_context, load_context
from kvsieve.generation.saved_context import SavedContextError

__all__ = ["Answer", "CompressedContext", "ContextStats", "SavedContextError", "compress_context", "load_context"]
