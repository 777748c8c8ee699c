"""The engine: append → attend → observe → plan → act, for every layer of a kvsieve cache."""
