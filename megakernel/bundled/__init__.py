"""Model files shipped inside the package: north_nano, the embedded default model (see default_model.py)."""
