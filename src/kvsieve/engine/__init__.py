"""The engine: ``KVCache`` and the one owner of append → attend → observe → plan → act for its layers."""
