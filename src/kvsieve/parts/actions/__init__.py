"""Actions: what happens to the entries a plan does not keep (evict; merge).

Each file registers its parts and ends with its presets (see :mod:`kvsieve.policies.catalog`)."""
