"""`raytrain-fast bench ...`: measurements behind the design's speed claims, each a JSON-able dict.

Modules are imported by the command that needs them (each pulls in torch, Ray or both).
"""
