"""The package's version, and its only copy: pyproject.toml reads this literal
(``[tool.setuptools.dynamic]``), so the wheel's metadata always agrees with it. A module
of its own so that the client, the server and the CLI name it without the package's face
(which names the whole public API)."""

__version__ = "0.1.0"
