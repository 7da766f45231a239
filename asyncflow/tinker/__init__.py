"""A Tinker-compatible training service (`asyncflow tinker-serve`): the official `tinker` SDK's
training and sampling calls answered on asyncflow's engines (docs/tinker.md)."""
