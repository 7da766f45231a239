"""asyncflow: asynchronous, streaming RL post-training for LLMs.

Kept import-light on purpose: `asyncflow` must validate configs and CLI arguments before torch,
transformers or ray are imported, so nothing heavy is imported here.
"""

__version__ = "0.1.0"
