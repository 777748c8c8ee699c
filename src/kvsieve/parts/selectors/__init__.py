"""Selectors: decoding-time subset attention without deletion (one file per method).

Each file registers its parts and ends with its presets (see :mod:`kvsieve.policies.catalog`)."""
