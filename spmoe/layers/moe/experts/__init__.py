"""Routed-expert backends and the rule that picks one for a deployment (see `selection.py`)."""
