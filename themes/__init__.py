"""The bundled themes (one TOML file each), installed as the package tuichat.bundled_themes: this file makes
the folder a package, which setuptools' editable install needs to map it (see pyproject.toml)."""
